"""The output layer's tile kernels: the compiled kernels (grpo.cpu.tile_math), the eager in-place
operations and the plain definition (grpo.models.tiles) agree, alone and inside the tiled logprobs (values and
gradients); and how cpu.compile is resolved."""

import logging
from types import SimpleNamespace

import pytest
import torch

from grpo.backends import single
from grpo.config.errors import ConfigError
from grpo.config.loading import from_dict
from grpo.cpu import compiling, tile_math
from grpo.models import tiles
from grpo.models.logprobs import OutputLayerKernels, TileBuffers, token_logprobs_from_hidden


def _tile(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, cols = 6, 37
    product = (3 * torch.randn(rows, cols, generator=g)).to(dtype)
    bias = torch.randn(cols, generator=g)
    # targets at both edges, and two rows whose target is elsewhere
    column = torch.tensor([0, -1, 36, 5, -1, 17])
    return product, bias, column


def _dense(product, bias, softcap, temperature):
    """The tile's float64 logits, written out."""
    z = product.double() + (bias.double() if bias is not None else 0)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


# softcap, temperature, bias
SETTINGS = [
    (None, 1.0, False),
    (None, 0.7, True),
    (30.0, 1.0, True),
    (3.0, 1.3, False),
]
COMPILED_SETTINGS = [(None, 1.0, False), (30.0, 0.7, True)]
"""Each (dtype, softcap or not, bias or not) is a kernel of its own to compile (seconds each on a
machine's first run): the compiled tests take the plain one and the one with every option."""


@pytest.mark.parametrize("softcap, temperature, with_bias", SETTINGS)
def test_definition_is_the_log_sum_exp_and_the_softmax_gradient(softcap, temperature, with_bias):
    """forward_tile from the empty statistics gives each row's max, sum exp(z - max),
    sum exp(z - max)(z - max) and the target's logit; backward_tile gives
    g * (onehot - softmax) through the temperature and the softcap (float64 autograd)."""
    product, bias, column = _tile()
    bias = bias if with_bias else None
    rows = product.shape[0]
    start = (
        torch.full((rows,), float("-inf")),
        torch.zeros(rows),
        torch.zeros(rows),
        torch.zeros(rows),
    )
    m, S, U, target = tiles.forward_tile(product, bias, column, *start, softcap, temperature)
    z = _dense(product, bias, softcap, temperature)
    zs = z - z.amax(-1, keepdim=True)
    close = dict(rtol=1e-5, atol=1e-5)  # float32 against float64
    torch.testing.assert_close(m.double(), z.amax(-1), **close)
    torch.testing.assert_close(S.double(), zs.exp().sum(-1), **close)
    torch.testing.assert_close(U.double(), (zs.exp() * zs).sum(-1), **close)
    hit = column >= 0
    torch.testing.assert_close(
        target[hit].double(), z[hit.nonzero().squeeze(1), column[hit]], **close
    )
    assert (target[~hit] == 0).all()

    lse = torch.logsumexp(z, -1).float()
    grad = torch.linspace(-1, 2, rows)
    gz, _ = tiles.backward_tile(
        product, bias, column, lse, grad, softcap, temperature, torch.float32, False
    )
    p = product.double().requires_grad_()
    zp = _dense(p, bias, softcap, temperature)
    onehot = torch.zeros_like(zp)
    onehot[hit.nonzero().squeeze(1), column[hit]] = 1
    # the gradient of sum_r g_r (onehot . z_r - lse_r) with lse held at its value
    ((onehot * zp).sum(-1) - (zp - lse.double()[:, None]).exp().sum(-1)).mul(
        grad.double()
    ).sum().backward()
    torch.testing.assert_close(gz.double(), p.grad, rtol=1e-5, atol=1e-6)


def _both(kernels, product, bias, column, softcap, temperature, out_dtype):
    """One tile through `kernels`: the forward statistics (from a non-empty start, so the
    rescaling is exercised) and the backward's gradient and column sums."""
    rows = product.shape[0]
    g = torch.Generator().manual_seed(5)
    start = (
        torch.randn(rows, generator=g),
        torch.rand(rows, generator=g) + 1,
        torch.randn(rows, generator=g),
        torch.randn(rows, generator=g),
    )
    buffers = TileBuffers(product.device, OutputLayerKernels(tile=kernels))
    forward = kernels.forward(product.clone(), bias, column, *start, softcap, temperature, buffers)
    lse = torch.logsumexp(_dense(product, bias, softcap, temperature), -1).float()
    grad = torch.linspace(-1, 2, rows)
    buffers = TileBuffers(product.device, OutputLayerKernels(tile=kernels))
    backward = kernels.backward(
        product.clone(),
        bias,
        column,
        lse,
        grad,
        softcap,
        temperature,
        out_dtype,
        bias is not None,
        buffers,
    )
    return forward, backward


DEFINITION = SimpleNamespace(  # the plain functions, called like the kernels (without the buffers)
    forward=lambda *args: tiles.forward_tile(*args[:-1]),
    backward=lambda *args: tiles.backward_tile(*args[:-1]),
)


def _assert_same(got, want, dtype, with_bias, forward_tolerance, gradient_tolerance):
    """Two _both results: the forward statistics, the gradient (in `dtype`) and its column sums."""
    (forward, (gradient, sums)), (forward_want, (gradient_want, sums_want)) = got, want
    for a, b in zip(forward, forward_want):
        torch.testing.assert_close(a, b, **forward_tolerance)
    assert gradient.dtype == gradient_want.dtype == dtype
    torch.testing.assert_close(gradient, gradient_want, **gradient_tolerance)
    if with_bias:
        torch.testing.assert_close(sums, sums_want, **forward_tolerance)
    else:
        assert sums is None and sums_want is None


@pytest.mark.parametrize("softcap, temperature, with_bias", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_in_place_equals_the_definition(dtype, softcap, temperature, with_bias):
    product, bias, column = _tile(dtype)
    bias = bias if with_bias else None
    exact = dict(rtol=1e-6, atol=1e-6)
    _assert_same(
        _both(tiles.EAGER, product, bias, column, softcap, temperature, dtype),
        _both(DEFINITION, product, bias, column, softcap, temperature, dtype),
        dtype,
        with_bias,
        exact,
        exact,
    )


@pytest.mark.needs_compile
@pytest.mark.parametrize("softcap, temperature, with_bias", COMPILED_SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_equal_eager(dtype, softcap, temperature, with_bias):
    product, bias, column = _tile(dtype)
    bias = bias if with_bias else None
    # a bf16 gradient may round a float32 value that differs in its last bit the other way
    gradient_tolerance = (
        dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    )
    compiled = _both(tile_math.COMPILED, product, bias, column, softcap, temperature, dtype)
    _assert_same(
        compiled,
        _both(tiles.EAGER, product, bias, column, softcap, temperature, dtype),
        dtype,
        with_bias,
        dict(rtol=1e-5, atol=1e-5),
        gradient_tolerance,
    )
    assert compiled[1][0].t().is_contiguous()  # column-major, for the products that follow
    # the cast and the accumulation
    out = torch.empty(product.shape, dtype=torch.bfloat16)
    tile_math.COMPILED.cast_into(out, product.float())
    # exact: a cast rounds correctly in any implementation
    assert torch.equal(out, product.float().bfloat16())
    acc = torch.ones(product.shape)
    tile_math.COMPILED.accumulate(acc, product)
    assert torch.equal(acc, 1 + product.float())  # exact: so does a single addition


@pytest.mark.needs_compile
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("softcap, temperature, with_bias", COMPILED_SETTINGS)
def test_tiled_logprobs_compiled_equal_eager_values_and_gradients(
    precision, softcap, temperature, with_bias
):
    """The whole tiled pass over several token chunks and vocabulary blocks (the last ones
    smaller), the weight's gradient added in place into its .grad: compiled and eager agree on logp, entropy and every
    gradient."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 70, bias=with_bias)
    hidden0 = torch.randn(11, 16)
    targets = torch.randint(0, 70, (11,))
    upstream = torch.randn(11)
    results = {}
    for compiled in (False, True):
        hidden = hidden0.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        layer.weight.grad = torch.zeros_like(layer.weight)
        kernels = OutputLayerKernels(
            tile=tile_math.COMPILED if compiled else tiles.EAGER, weight_grad_in_place=True
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logp, entropy = token_logprobs_from_hidden(
                hidden,
                layer,
                targets,
                temperature=temperature,
                softcap=softcap,
                chunk_size=4,
                vocab_block=16,
                kernels=kernels,
            )
        (logp * upstream).sum().backward()
        results[compiled] = (
            logp,
            entropy,
            hidden.grad,
            layer.weight.grad,
            layer.bias.grad if with_bias else None,
        )
    tolerance = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=1e-2, atol=1e-3)
    for name, a, b in zip(
        ("logp", "entropy", "grad h", "grad w", "grad b"), results[True], results[False]
    ):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(
            a, b, **(tolerance if name.startswith("grad") else dict(rtol=1e-5, atol=1e-5)), msg=name
        )


# -- cpu.compile ---------------------------------------------------------------------------


def test_unknown_setting_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="cpu.compile.*auto.*compiled.*eager"):
        from_dict({"cpu": {"compile": "fast"}})


def _failing_probe(monkeypatch):
    calls = []

    def probe(device_type):
        calls.append(device_type)
        return "CppCompileError: no C++ compiler"

    monkeypatch.setattr(compiling, "compile_works", probe)
    return calls


class _Model:
    """Just what use_compiled reads: the output layer's weight (numel and device)."""

    def __init__(self, numel: int, device: str = "cpu"):
        self.numel, self.device = numel, torch.device(device)

    def get_output_embeddings(self):
        return SimpleNamespace(weight=SimpleNamespace(numel=lambda: self.numel, device=self.device))


def test_auto_compiles_only_large_cpu_output_layers(monkeypatch):
    calls = []
    monkeypatch.setattr(compiling, "compile_works", lambda device_type: calls.append(device_type))
    big = compiling.AUTO_COMPILE_MIN_WEIGHTS
    assert compiling.use_compiled("auto", _Model(big)) is True
    assert compiling.use_compiled("auto", _Model(big - 1)) is False  # not worth loading the kernels
    assert compiling.use_compiled("auto", _Model(big, "cuda")) is False
    assert compiling.use_compiled("eager", _Model(big)) is False
    assert compiling.use_compiled("compiled", _Model(10)) is True
    assert calls == ["cpu", "cpu"]  # probed only where the answer depends on it


def test_a_failing_compiler_falls_back_under_auto_and_is_an_error_when_asked_for(
    monkeypatch, caplog
):
    _failing_probe(monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert compiling.use_compiled("auto", _Model(compiling.AUTO_COMPILE_MIN_WEIGHTS)) is False
    assert "no C++ compiler" in caplog.text
    with pytest.raises(
        ConfigError, match="cpu.compile=compiled.*no C\\+\\+ compiler.*cpu.compile=eager"
    ):
        compiling.use_compiled("compiled", _Model(10))


def test_the_backend_decides_once_per_run(monkeypatch, model):
    calls = _failing_probe(monkeypatch)
    monkeypatch.setattr(compiling, "AUTO_COMPILE_MIN_WEIGHTS", 1)
    backend = single.SingleProcess(
        from_dict({"cpu": {"compile": "auto"}, "training": {"device": "cpu"}})
    )
    backend.prepare_model(model)  # the CPU layer resolves cpu.compile here, once
    assert backend.cpu.compiled is False
    assert backend.output_layer_kernels().tile is tiles.EAGER
    assert backend.output_layer_kernels().tile is tiles.EAGER
    assert calls == ["cpu"]


@pytest.mark.needs_compile
@pytest.mark.parametrize("bf16", [False, True])
def test_training_with_compiled_kernels_equals_eager(
    tokenizer, tmp_path, bf16, monkeypatch, make_trainer
):
    """cpu.compile=compiled against eager, a few steps of a tiny model (the updates through
    the compiled tiles and norms): the same completions, and weights equal to float tolerance."""
    from grpo.cpu import compiled_norms

    # the tiny model's norms compiled in the update and the prefill (thousands of elements), not when decoding
    monkeypatch.setattr(compiled_norms, "MIN_ELEMENTS", 4096)

    runs = {}
    for kernels in ("eager", "compiled"):
        trainer = make_trainer(
            tokenizer,
            tmp_path / kernels,
            [
                "training.max_steps=3",
                "training.per_device_train_batch_size=32",
                "rollout.max_completion_length=3",
                f"cpu.compile={kernels}",
                f"training.bf16={str(bf16).lower()}",
                "training.logprob_chunk_size=5",
            ],
        )
        assert trainer.backend.cpu.compiled is (kernels == "compiled")
        assert trainer.backend.output_layer_kernels().tile is (
            tile_math.COMPILED if kernels == "compiled" else tiles.EAGER
        )
        completions = []
        for _ in range(3):
            batch = trainer.collect_batch()
            completions.append(batch.rollout.completion_ids.clone())
            trainer.update(batch)
        runs[kernels] = (
            completions,
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        )
    for a, b in zip(runs["compiled"][0], runs["eager"][0]):
        # exact: the compiled prefill and updates may differ from eager in the last bits, but a draw
        # changes only if its uniform lies that close to a step of the CDF (the nearest of these
        # 1148 draws is 1e-5 away)
        assert torch.equal(a, b)
    for name, weight in runs["eager"][1].items():
        torch.testing.assert_close(
            runs["compiled"][1][name], weight, rtol=1e-4, atol=1e-5, msg=name
        )


def test_a_compile_failing_mid_run_falls_back_to_the_definition(monkeypatch, caplog):
    """A compile that fails after the probe (a full disk, an inductor error at a new shape) warns
    once, and the run goes on with the definitions computed eagerly: the same values."""
    from torch._dynamo.exc import BackendCompilerFailed

    def broken(fn):
        def call(*args):
            raise BackendCompilerFailed(
                lambda *a: None, RuntimeError("No space left on device"), None
            )

        return call

    monkeypatch.setattr(compiling, "compiled", broken)
    monkeypatch.setattr(compiling, "broken", [])
    product, bias, column = _tile()
    with caplog.at_level(logging.WARNING):
        got = _both(tile_math.COMPILED, product, bias, column, 3.0, 0.7, torch.float32)
        _both(tile_math.COMPILED, product, bias, column, 3.0, 0.7, torch.float32)
    want = _both(tiles.EAGER, product, bias, column, 3.0, 0.7, torch.float32)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert caplog.text.count("compiling a kernel of cpu.compile failed") == 1
    assert "No space left" in caplog.text
