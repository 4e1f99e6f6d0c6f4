import copy

import pytest
import torch
import torch.nn.functional as F

from grpo.cpu import kernels

pytestmark = pytest.mark.skipif(
    not kernels.onednn_available(), reason="this torch build has no usable oneDNN"
)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("mkl_fast", [True, False])
def test_products_take_onednn_for_few_rows_and_by_cpu_make_otherwise(mkl_fast, monkeypatch):
    """Decoding's few rows go through oneDNN on any CPU; training's larger products through MKL
    where it has its fast path (Intel), oneDNN elsewhere; values and gradients agree with
    float64 either way."""
    monkeypatch.setattr(kernels, "mkl_fast_path", lambda: mkl_fast)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 40, generator=g)
    assert kernels.uses_onednn(torch.randn(kernels.FEW_ROWS, 40), w)
    assert kernels.uses_onednn(torch.randn(2, 3, 40), w)
    assert kernels.uses_onednn(torch.randn(100, 40), w[:8])  # few rows on the weight's side
    assert kernels.uses_onednn(torch.randn(kernels.FEW_ROWS + 1, 40), w) == (not mkl_fast)
    assert not kernels.uses_onednn(torch.randn(4, 40).bfloat16(), w.bfloat16())
    for rows in (3, 100):
        x = torch.randn(rows, 40, generator=g, requires_grad=True)
        weight = w.clone().requires_grad_()
        out = kernels.linear(x, weight)
        upstream = torch.randn(out.shape, generator=g)
        (out * upstream).sum().backward()
        xd, wd = x.detach().double().requires_grad_(), w.double().requires_grad_()
        ref = xd @ wd.t()
        (ref * upstream.double()).sum().backward()
        assert (
            _rel_err(out, ref) < 1e-5
            and _rel_err(x.grad, xd.grad) < 1e-5
            and _rel_err(weight.grad, wd.grad) < 1e-5
        )


@pytest.mark.parametrize("shape", [(1, 40), (5, 40), (2, 3, 40), (32, 40), (33, 40), (0, 40)])
def test_tall_product_matches_float64_in_pieces(shape, monkeypatch):
    """The transposed output-layer product (pieces of the weight, a last one shorter) gives the
    float64 answer to float32 rounding, for any number of rows (more than FEW_ROWS: linear_nt)."""
    # 160 // rows rows a piece: several pieces
    monkeypatch.setattr(kernels, "TALL_PIECE_OUTPUT", 160)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(1003, 40, generator=g)
    out = kernels.tall_linear_nt(x, w)
    assert out.shape == (*shape[:-1], 1003) and out.dtype == torch.float32 and out.is_contiguous()
    if x.numel():
        assert _rel_err(out, x.double() @ w.double().t()) < 1e-5
    bf16 = kernels.tall_linear_nt(x.bfloat16(), w.bfloat16())  # other dtypes: linear_nt
    assert torch.equal(bf16, kernels.linear_nt(x.bfloat16(), w.bfloat16()))  # exact: that very call


@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 33), (0, 33)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_float64_values_and_gradients(shape, bias):
    """float32 through oneDNN is as accurate as torch's own float32 product (checked against float64)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(21, 33, generator=g, requires_grad=True)
    b = torch.randn(21, generator=g, requires_grad=True) if bias else None
    out = kernels.linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (*shape[:-1], 21)
    upstream = torch.randn(out.shape, generator=g)
    (out * upstream).sum().backward()

    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if bias else None
    ref = F.linear(xd, wd, bd)
    (ref * upstream.double()).sum().backward()
    if x.numel() == 0:
        assert out.numel() == 0 and (w.grad == 0).all()
        return
    assert _rel_err(out, ref) < 1e-5
    assert _rel_err(x.grad, xd.grad) < 1e-5
    assert _rel_err(w.grad, wd.grad) < 1e-5
    if bias:
        assert _rel_err(b.grad, bd.grad) < 1e-5


def test_linear_nt_accepts_strided_views():
    g = torch.Generator().manual_seed(1)
    a, c = torch.randn(12, 9, generator=g), torch.randn(12, 30, generator=g)
    # a.t() is [9, 12] and c.t() is [30, 12], both non-contiguous views: a.t() @ c
    ours = kernels.linear_nt(a.t(), c.t())
    torch.testing.assert_close(ours, a.t() @ c, rtol=1e-5, atol=1e-5)


def test_linear_nt_writes_into_out_outside_onednn():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 8, generator=g).bfloat16(), torch.randn(5, 8, generator=g).bfloat16()
    out = torch.full((6, 5), float("nan"), dtype=torch.bfloat16)
    result = kernels.linear_nt(a, b, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, a @ b.t())


def test_falls_back_outside_float32_cpu():
    """bf16 tensors and bf16 autocast take F.linear (autocast decides the dtype as usual)."""
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.linear(x, w).dtype == torch.bfloat16
    assert kernels.linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    assert kernels.linear(x.double(), w.double()).dtype == torch.float64


def test_use_cpu_linear_swaps_plain_linears_only(model):
    class Custom(torch.nn.Linear):
        pass

    model.extra = Custom(4, 4)
    before = copy.deepcopy(model.state_dict())
    plain = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert kernels.use_cpu_linear(model) == plain > 0
    assert type(model.extra) is Custom  # subclasses (LoRA, quantized layers) untouched
    assert all(
        isinstance(m, torch.nn.Linear) for m in model.modules() if isinstance(m, kernels.CPULinear)
    )
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert kernels.use_cpu_linear(model) == 0  # idempotent


def test_swapped_model_same_outputs_and_gradients(model, tokenizer):
    del tokenizer
    ids = torch.randint(5, 90, (3, 11), generator=torch.Generator().manual_seed(2))
    reference = copy.deepcopy(model)
    kernels.use_cpu_linear(model)
    out = model(input_ids=ids).logits
    ref = reference(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


packing = pytest.mark.skipif(
    not kernels.packing_available(), reason="this torch build cannot reorder bf16 weights"
)


@packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("piece_rows", [None, 128])
def test_packed_decoding_gives_the_autocast_result(bias, piece_rows, monkeypatch):
    """Inside packed_for_decoding, under bf16 autocast and without gradients, a CPULinear
    returns what F.linear under autocast returns (bf16), from a reordered copy dropped on
    exit; in one piece, or in pieces of 128 output rows (300 = 128 + 128 + 44)."""
    if piece_rows:
        monkeypatch.setattr(kernels, "PACK_PIECE_ELEMENTS", 48 * piece_rows)
    g = torch.Generator().manual_seed(3)
    layer = kernels.CPULinear(48, 300, bias=bias)
    x = torch.randn(5, 1, 48, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, layer.weight, layer.bias)
        with kernels.packed_for_decoding(layer, rows=5):
            assert len(layer.packed[1]) == (3 if piece_rows else 1)
            out = layer(x)
    assert layer.packed is None
    assert out.dtype == torch.bfloat16 and out.shape == (5, 1, 300)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


@packing
def test_packed_weights_are_not_used_with_gradients_or_without_autocast():
    layer = kernels.CPULinear(16, 8)
    x = torch.randn(2, 16)
    with kernels.packed_for_decoding(layer, rows=2):
        assert layer.packed is None  # float32: nothing to replace
    already_bf16 = kernels.CPULinear(16, 8).bfloat16()
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        kernels.packed_for_decoding(already_bf16, rows=2),
    ):
        # autocast makes no copy of it: a packed one would be extra
        assert already_bf16.packed is None
    with torch.autocast("cpu", dtype=torch.bfloat16), kernels.packed_for_decoding(layer, rows=2):
        assert layer.packed is not None
        out = layer(x)  # gradients enabled: the live weight, through autocast
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert layer.weight.grad is not None and layer.packed is None


@packing
def test_generation_with_packed_weights_matches_autocast(
    model, tokenizer, monkeypatch, assert_same_greedy
):
    """Greedy completions under bf16 autocast through transformers' modules (the path for
    models grpo.cpu.fused_decoding does not cover): the same tokens with and without the packed weights."""
    import contextlib

    from grpo.config.training import CPUConfig
    from grpo.cpu.layer import CPULayer
    from grpo.rollout import SamplingParams, generate

    kernels.use_cpu_linear(model)
    prompts = [tokenizer(t)["input_ids"] for t in ["abc", "hello world", "1+2="]]
    # the CPU layer's decoding when not fused: transformers' modules inside kernels.packed_for_decoding
    decoding = CPULayer(CPUConfig(decoding="plain")).decoding

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate(
                model,
                prompts,
                2,
                SamplingParams(16, temperature=0),
                eos_token_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id,
                decoding=decoding,
            )

    real, packed_rows = kernels.packed_for_decoding, []

    def spy(m, rows):
        packed_rows.append(rows)
        return real(m, rows)

    # the module grpo.cpu.layer calls it from
    monkeypatch.setattr(kernels, "packed_for_decoding", spy)
    packed = run()
    assert packed_rows == [6]
    monkeypatch.setattr(kernels, "packed_for_decoding", lambda m, rows: contextlib.nullcontext())
    plain = run()
    # oneDNN's product from the reordered copy vs autocast's F.linear: other kernels (which ones
    # depends on the CPU), bf16 logits a step (~0.002 here) apart at most, so the same tokens but at a tie
    assert_same_greedy(model, packed, plain, atol=0.02, autocast_dtype=torch.bfloat16)
    assert all(m.packed is None for m in model.modules() if isinstance(m, kernels.CPULinear))


def test_capability_checks_do_not_depend_on_the_callers_autocast():
    """The checks are cached for the process: the first call may come from inside bf16
    autocast (a rollout), and must give the same answer as outside it."""
    outside = (kernels.onednn_available(), kernels.packing_available())
    kernels.onednn_available.cache_clear()
    kernels.packing_available.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = (kernels.packing_available(), kernels.onednn_available())[::-1]
    finally:
        kernels.onednn_available.cache_clear()
        kernels.packing_available.cache_clear()
    assert inside == outside
