"""The decoder's RMS norms as compiled kernels (grpo.cpu.compiled_norms): the compiled forward equals the
module's own, values and gradients, in float32 and bf16; small inputs stay eager; which modules are
switched; and a trainer with cpu.compile=compiled trains as the eager one does."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from grpo.cpu import compiled_norms, compiling


def _norm(cls, size: int):
    norm = cls(size, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(1)))
    return norm


def _forward_backward(norm, x):
    x = x.detach().clone().requires_grad_()
    norm.zero_grad()
    y = norm(x)
    up = torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype)
    (y * up).float().sum().backward()
    return y.detach(), x.grad, norm.weight.grad.clone()


@pytest.mark.needs_compile
@pytest.mark.parametrize("cls", [Gemma3RMSNorm, LlamaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_norm_equals_the_module_values_and_gradients(cls, dtype):
    # above MIN_ELEMENTS, shaped like a micro-batch of query heads [batch, heads, tokens, head_dim]
    x = (3 * torch.randn(2, 4, 70, 128, generator=torch.Generator().manual_seed(0))).to(dtype)
    assert x.numel() >= compiled_norms.MIN_ELEMENTS
    eager = _norm(cls, 128)
    compiled = _norm(cls, 128)
    assert compiled_norms.use_compiled_norms(torch.nn.Sequential(compiled)) == 1
    assert isinstance(compiled, cls) and isinstance(compiled, compiled_norms.CompiledNorm)
    assert type(compiled).__name__ == cls.__name__  # transformers matches norms by class name
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    got, want = _forward_backward(compiled, x), _forward_backward(eager, x)
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    # float32 to its rounding; bf16 outputs are rounded from float32 values that may differ in the last bit
    close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **close)


def test_small_inputs_run_eagerly_and_large_ones_compiled(monkeypatch):
    calls = []
    monkeypatch.setattr(
        compiling, "call", lambda fn, *args: calls.append(args[1].shape) or fn(*args)
    )
    norm = _norm(Gemma3RMSNorm, 64)
    compiled_norms.use_compiled_norms(torch.nn.Sequential(norm))
    norm(torch.randn(16, 1, 64))  # a decoding step's few rows
    assert calls == []
    big = torch.randn(compiled_norms.MIN_ELEMENTS // 64, 64)
    torch.testing.assert_close(norm(big), Gemma3RMSNorm.forward(norm, big))
    assert calls == [big.shape]


def test_every_rms_norm_of_a_model_is_switched_once(gemma3_tiny):
    model = gemma3_tiny()
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    # per layer: four around attention and MLP, the query and key norms; the final one
    assert len(norms) == 2 * 6 + 1
    assert compiled_norms.use_compiled_norms(model) == len(norms)
    assert all(isinstance(m, compiled_norms.CompiledNorm) for m in norms)
    assert compiled_norms.use_compiled_norms(model) == 0  # idempotent
    assert not any(
        isinstance(m, compiled_norms.CompiledNorm) for m in model.modules() if m not in norms
    )


def test_the_trainer_switches_norms_only_with_compiled_kernels(
    tokenizer, tmp_path, monkeypatch, make_trainer
):
    # no compile happens below
    monkeypatch.setattr(compiling, "compile_works", lambda device_type: None)
    for kernels, switched in (("eager", False), ("compiled", True)):
        trainer = make_trainer(
            tokenizer, tmp_path / kernels, [f"cpu.compile={kernels}", "training.max_steps=1"]
        )
        norms = [m for m in trainer.model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(isinstance(m, compiled_norms.CompiledNorm) is switched for m in norms)
