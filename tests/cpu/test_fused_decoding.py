"""FusedDecoder computes transformers' decoding steps: the same logits at every step, the
same greedy completions, for each supported architecture."""

import pytest
import torch

from grpo.backends.single import SingleProcess
from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.config.training import CPUConfig
from grpo.cpu import kernels
from grpo.cpu.fused_decoding import FusedDecoder, fused_decoding_applies
from grpo.cpu.layer import CPULayer
from grpo.models import logprobs
from grpo.models.tiny import tiny_model
from grpo.rollout import SamplingParams, TransformersEngine, generate
from grpo.rollout.hf import TransformersSteps, left_pad

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


def _model(arch, tokenizer, gemma3_tiny):
    """A tiny random model of `arch` with grouped-query attention (4 query heads, 2 key/value)."""
    if arch == "llama":
        return tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=3).eval()
    if arch == "gemma3":  # a sliding window of 4 tokens: shorter than the prompts
        return gemma3_tiny(num_attention_heads=4, num_key_value_heads=2).eval()
    import transformers

    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=arch == "qwen2",
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    if arch == "qwen2":  # its query/key/value biases start at zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    return model


def _install(model):
    """The CPU layer's kernels on `model`, as a CPU run's backend installs them (cpu: defaults)."""
    CPULayer(CPUConfig()).install(model)


def _prompts(tokenizer):
    # different lengths, so the batch is left-padded
    return [tokenizer(t)["input_ids"] for t in ["abc", "hello world", "1+2=", "the quick brown"]]


def _step_logits(steps, ids, mask, positions, n_steps, drop_at=3, tokens=None):
    """Logits of a prefill and `n_steps` greedy decoding steps, with the cache's batch doubled
    after the prefill (prefix sharing) and its row 1 dropped at step `drop_at` (compaction), and
    the tokens fed. `tokens` (another run's): fed instead of this run's own argmax, which could
    take the other side of a tie where two code paths' logits differ in their last bits."""
    out, fed = [steps(ids, mask, positions)], []
    steps.repeat_interleave(2)
    logits = out[0].repeat_interleave(2, 0)
    mask, pos = mask.repeat_interleave(2, 0), mask.sum(-1).repeat_interleave(2, 0)
    for t in range(n_steps):
        if t == drop_at:
            keep = torch.tensor([i for i in range(logits.shape[0]) if i != 1])
            steps.select(keep)
            logits, mask, pos = logits[keep], mask[keep], pos[keep]
        nxt = logits.argmax(-1, keepdim=True) if tokens is None else tokens[t]
        fed.append(nxt)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits = steps(nxt, mask, pos[:, None])
        out.append(logits)
        pos = pos + 1
    return out, fed


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers_at_every_step_float32(arch, tokenizer, gemma3_tiny):
    model = _model(arch, tokenizer, gemma3_tiny)
    ids, mask = left_pad(_prompts(tokenizer), tokenizer.pad_token_id)
    positions = logprobs.position_ids_from_mask(mask)
    n = 8
    with torch.no_grad():
        reference, tokens = _step_logits(TransformersSteps(model), ids, mask, positions, n)
        ours, _ = _step_logits(
            FusedDecoder(model, 8, ids.shape[1] + n, pack=False),
            ids,
            mask,
            positions,
            n,
            tokens=tokens,
        )
    assert len(ours) == len(reference) == n + 1
    for t, (a, b) in enumerate(zip(ours, reference)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {t}")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_logits_equal_transformers_under_bf16_autocast(arch, tokenizer, gemma3_tiny):
    """The fast path: packed bf16 products, bf16 cache. transformers rounds to bf16 at the
    same places, so the logits agree to within bf16 rounding of the products."""
    if not kernels.packing_available():
        pytest.skip("oneDNN weight packing is not available in this torch build")
    model = _model(arch, tokenizer, gemma3_tiny)
    _install(model)
    ids, mask = left_pad(_prompts(tokenizer), tokenizer.pad_token_id)
    positions = logprobs.position_ids_from_mask(mask)
    n = 8
    assert fused_decoding_applies(model, torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with kernels.packed_for_decoding(model, rows=8):
            reference, tokens = _step_logits(TransformersSteps(model), ids, mask, positions, n)
        ours, _ = _step_logits(
            FusedDecoder(model, 8, ids.shape[1] + n), ids, mask, positions, n, tokens=tokens
        )
    for t, (a, b) in enumerate(zip(ours, reference)):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02, msg=f"step {t}")


FUSED = CPULayer(CPUConfig(decoding="fused")).decoding
"""Decoding steps that are always FusedDecoder's (None: transformers' modules)."""


def _generate_all_ways(model, tokenizer, stop_token, **kw):
    params = SamplingParams(max_new_tokens=20, temperature=0)
    return {
        (fused, share, compact): generate(
            model,
            _prompts(tokenizer),
            2,
            params,
            eos_token_ids=[tokenizer.eos_token_id, stop_token],
            pad_token_id=tokenizer.pad_token_id,
            share_prefix=share,
            compact=compact,
            decoding=FUSED if fused else None,
            **kw,
        )
        for fused in (False, True)
        for share in (False, True)
        for compact in (False, True)
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_completions_equal_transformers(arch, tokenizer, gemma3_tiny, assert_same_greedy):
    model = _model(arch, tokenizer, gemma3_tiny)
    # a token some rows emit early: rows finish at different steps, so compaction happens
    free = generate(
        model,
        _prompts(tokenizer),
        1,
        SamplingParams(20, temperature=0),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    counts = torch.bincount(free.completion_ids[:, :10].flatten(), minlength=len(tokenizer))
    stop_token = int(counts.argmax())
    results = _generate_all_ways(model, tokenizer, stop_token)
    plain = results[(False, False, False)]
    assert not plain.truncated.all()
    for key, r in results.items():
        # other kernels, batch shapes (shared prefixes, compacted rows) and attention: logits equal to
        # float32 rounding, so the same tokens (and rows ending alike) but at a tie
        diverged = assert_same_greedy(model, r, plain, atol=1e-5, msg=str(key))
        same = [i for i in range(len(r.truncated)) if i not in diverged]
        assert torch.equal(r.truncated[same], plain.truncated[same]), key


def _engine(model, tokenizer, decoding="auto", bf16=True):
    """The engine as a CPU run builds it: the backend prepares the model (installing the CPU layer,
    which refuses cpu.decoding=fused for a model it cannot decode) and hands over its decoding."""
    cfg = config.from_dict(
        {"cpu": {"decoding": decoding}, "training": {"bf16": bf16, "device": "cpu"}}
    )
    backend = SingleProcess(cfg)
    backend.prepare_model(model)
    return TransformersEngine(model, tokenizer, cfg, decoding=backend.decoding)


def _decodes_fused(engine, tokenizer) -> bool:
    """Whether a generate of `engine` decodes with a FusedDecoder (one is built per rollout)."""
    built = []
    original = FusedDecoder.__init__

    def spy(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(FusedDecoder, "__init__", spy)
        engine.generate(
            _prompts(tokenizer)[:1],
            1,
            SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True),
        )
    assert len(built) <= 1
    return bool(built)


def test_engine_decodes_fused_in_bf16_on_the_cpu(
    tokenizer, gemma3_tiny, monkeypatch, assert_same_greedy
):
    """The default path of a prepared CPU model in a bf16 run (cpu.decoding=auto), with
    the same greedy completions as transformers' modules (cpu.decoding=plain)."""
    if not kernels.packing_available():
        pytest.skip("oneDNN weight packing is not available in this torch build")
    model = _model("gemma3", tokenizer, gemma3_tiny)
    _install(model)
    calls = []
    original = FusedDecoder.__call__
    monkeypatch.setattr(
        FusedDecoder, "__call__", lambda self, *a: calls.append(1) or original(self, *a)
    )
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    auto, plain = _engine(model, tokenizer), _engine(model, tokenizer, "plain")
    ours = auto.generate(_prompts(tokenizer), 2, params)
    assert len(calls) == params.max_new_tokens  # the prefill and every step but the last sample
    reference = plain.generate(_prompts(tokenizer), 2, params)
    assert len(calls) == params.max_new_tokens
    # bf16 logits through other code (and on another CPU, other bf16 kernels): a logit a bf16 step
    # (~0.002 here) apart may pick the other side of a tie; the logits agree to 0.02 (above)
    assert_same_greedy(model, ours, reference, atol=0.02, autocast_dtype=torch.bfloat16)
    assert _decodes_fused(auto, tokenizer) and not _decodes_fused(plain, tokenizer)
    # the choice is the engine's, whatever autocast the caller is under
    with torch.autocast("cpu", enabled=False):
        assert _decodes_fused(auto, tokenizer)
    assert (
        _decodes_fused(_engine(model, tokenizer, bf16=False), tokenizer)
        == kernels.onednn_available()
    )
    assert not _decodes_fused(_engine(model, tokenizer, "plain", bf16=False), tokenizer)
    assert _decodes_fused(_engine(model, tokenizer, "fused", bf16=False), tokenizer)
    # which the CPU layer decides from the model and the compute dtype
    layer = CPULayer(CPUConfig())
    assert layer.uses_fused_decoding(model, torch.bfloat16)
    assert layer.uses_fused_decoding(model, torch.float32) == kernels.onednn_available()
    assert not CPULayer(CPUConfig(decoding="plain")).uses_fused_decoding(model, torch.bfloat16)
    assert CPULayer(CPUConfig(decoding="fused")).uses_fused_decoding(model, torch.float32)


def test_engine_decodes_fused_in_float32_on_the_cpu(tokenizer, gemma3_tiny, assert_same_greedy):
    """A float32 run decodes fused too (oneDNN products, no weight copies), with the same
    greedy completions as transformers' modules, and the same sampled ones from the same seeds."""
    if not kernels.onednn_available():
        pytest.skip("oneDNN is not available in this torch build")
    model = _model("gemma3", tokenizer, gemma3_tiny)
    _install(model)
    auto, plain = (
        _engine(model, tokenizer, bf16=False),
        _engine(model, tokenizer, "plain", bf16=False),
    )
    assert _decodes_fused(auto, tokenizer) and not _decodes_fused(plain, tokenizer)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, ignore_eos=True)
        ours = auto.generate(_prompts(tokenizer), 2, params, seeds=[3, 4, 5, 6])
        reference = plain.generate(_prompts(tokenizer), 2, params, seeds=[3, 4, 5, 6])
        if temperature == 0:  # logits equal to float32 rounding: the same tokens but at a tie
            assert_same_greedy(model, ours, reference, atol=1e-5)
        else:
            # exact: a draw changes only if its uniform lies within the paths' rounding (~1e-7) of a
            # step of the CDF; the nearest of these 96 draws is 1e-4 away
            assert torch.equal(ours.completion_ids, reference.completion_ids)


def test_float32_decodes_fused_only_with_grpo_kernels(model, tokenizer):
    # plain nn.Linear layers: transformers' modules
    assert not fused_decoding_applies(model, torch.float32)
    _install(model)
    assert fused_decoding_applies(model, torch.float32) == kernels.onednn_available()
    assert fused_decoding_applies(model, torch.bfloat16) == kernels.packing_available()
    assert not fused_decoding_applies(model, torch.float16)


def test_unsupported_architectures_decode_through_transformers(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    _install(model)
    with pytest.raises(ValueError, match="'gpt2'"):
        FusedDecoder(model, rows=2, max_length=8)
    with pytest.raises(
        ConfigError, match="cpu.decoding: fused decoding does not support this model"
    ):
        _engine(model, tokenizer, "fused")  # at start-up, not at the first rollout
    assert not _decodes_fused(_engine(model, tokenizer), tokenizer)
    assert not fused_decoding_applies(model, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(
            model,
            _prompts(tokenizer),
            2,
            SamplingParams(6, temperature=0),
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
        )
    assert out.completion_ids.shape[0] == 8


@pytest.mark.parametrize("setting", ["bidirectional", "dropout"])
def test_models_it_does_not_compute_decode_through_transformers(setting, tokenizer, gemma3_tiny):
    model = _model("gemma3", tokenizer, gemma3_tiny)
    if setting == "bidirectional":
        model.config.use_bidirectional_attention = True
    else:
        model.config.attention_dropout = 0.1
        model.train()
    _install(model)
    with pytest.raises(
        ValueError, match="bidirectional" if setting == "bidirectional" else "dropout"
    ):
        FusedDecoder(model, rows=2, max_length=8)
    assert not fused_decoding_applies(model, torch.bfloat16)
    model.eval()  # dropout applies in training mode only
    assert fused_decoding_applies(model, torch.bfloat16) == (
        setting == "dropout" and kernels.packing_available()
    )


def test_cache_bound_is_checked(model, tokenizer):
    ids, mask = left_pad(_prompts(tokenizer), tokenizer.pad_token_id)
    decoder = FusedDecoder(model, 4, ids.shape[1], pack=False)
    with torch.no_grad():
        decoder(ids, mask, logprobs.position_ids_from_mask(mask))
        with pytest.raises(ValueError, match="holds"):
            decoder(ids[:, :1], torch.cat([mask, mask[:, :1]], 1), mask.sum(-1, keepdim=True))
