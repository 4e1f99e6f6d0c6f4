"""Every tensor grpo makes names the device it is made on.

A factory call without `device=` makes a CPU tensor; on a GPU run that tensor then meets CUDA
tensors and the run stops (`Expected all tensors to be on the same device`), or is silently
copied every step. The first GPU run found both, in paths a CPU run never tells apart. So every
`torch.zeros/ones/full/empty/arange/tensor/as_tensor/rand/randn/randint/eye/linspace` call in
src/grpo names its device: the device of what it works with, or `device="cpu"` for what is
host-side on purpose (reward tables, batch assembly before the transfer, row indices). The CPU
layer (src/grpo/cpu/), which only ever runs on the CPU, is exempt."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "grpo"
FACTORIES = {
    "zeros",
    "ones",
    "full",
    "empty",
    "arange",
    "tensor",
    "as_tensor",
    "rand",
    "randn",
    "randint",
    "eye",
    "linspace",
}
EXEMPT = SRC / "cpu"


def unplaced_factory_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of each `torch.<factory>(...)` in `source` that passes no `device=`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords)
        ):
            found.append((node.lineno, ast.unparse(node)[:100]))
    return found


def test_the_check_finds_an_unplaced_call_and_passes_a_placed_one():
    source = (
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.zeros(3, device=x.device)\n"
        "c = torch.tensor([1], dtype=torch.long)\n"
        "d = x.new_zeros(3)\n"  # a method of a tensor: its device
    )
    assert [line for line, _ in unplaced_factory_calls(source)] == [2, 4]


def test_every_tensor_factory_call_outside_the_cpu_layer_names_its_device():
    offenders = [
        f"{path.relative_to(SRC.parent)}:{line}: {call}"
        for path in sorted(SRC.rglob("*.py"))
        if EXEMPT not in path.parents
        for line, call in unplaced_factory_calls(path.read_text())
    ]
    assert not offenders, "tensor factory calls that name no device:\n" + "\n".join(offenders)


def test_bf16_auto_is_on_exactly_for_a_cuda_device_that_computes_in_bf16(monkeypatch):
    import torch

    from grpo.models.precision import uses_bf16

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not uses_bf16("auto", cpu)
    assert uses_bf16(True, cpu) and not uses_bf16(False, cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert uses_bf16("auto", cuda) and not uses_bf16("auto", cpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a V100
    assert not uses_bf16("auto", cuda)


def test_a_run_on_the_suites_device_computes_as_bf16_auto_says(
    tokenizer, tmp_path, make_trainer, device
):
    import torch

    trainer = make_trainer(tokenizer, tmp_path, ["training.max_steps=1"])
    assert trainer.cfg.training.bf16 == "auto" and trainer.backend.device.type == device.type
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    assert trainer.backend.bf16 is bf16 and trainer.engine.bf16 is bf16
    explicit = make_trainer(tokenizer, tmp_path / "b", ["training.bf16=true"])
    assert explicit.backend.bf16 is True and explicit.engine.bf16 is True


@pytest.mark.gpu
def test_a_step_on_cuda_keeps_the_rollout_and_the_model_on_the_gpu(
    tokenizer, tmp_path, make_trainer
):
    trainer = make_trainer(tokenizer, tmp_path, ["training.max_steps=1"])
    assert next(trainer.model.parameters()).device.type == "cuda"
    metrics, batch = trainer.train_step()
    ro = batch.rollout
    assert {t.device.type for t in (ro.prompt_ids, ro.completion_ids, ro.completion_mask)} == {
        "cuda"
    }
    assert batch.rewards.device.type == "cpu"  # reward tables are host-side
    assert metrics["completions/mean_length"] > 0
