"""The config's `rollout:` and `rewards:` sections: generation (the engine, sampling, tools and
environments, `rollout.vllm`) and the reward functions (their limits, reward models, and
`rewards.sandbox`, where model-written programs run); each section checks its own fields."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from grpo import registry
from grpo.config import safe_yaml
from grpo.config.checks import (
    MAX_MIB,
    MAX_PROCESSES,
    MAX_SECONDS,
    WholeConfig,
    one_of,
    positive,
    within,
)
from grpo.config.errors import ConfigError

MAX_WORKERS_PER_CORE = 4
"""rewards.workers above this many per core only adds processes that wait for a core."""
MAX_STALENESS = 32
"""rollout.max_staleness's bound: up to max_staleness + 1 generated batches are held in memory and
in every checkpoint (grpo.training.ahead)."""


@dataclass
class VLLMConfig:
    """Settings of the `vllm` rollout engine (rollout.engine: vllm, grpo.rollout.vllm): a vLLM
    engine in the training process, on the policy's device, its weights pushed after each
    optimizer step."""

    gpu_memory_utilization: float = 0.3
    """Fraction of the GPU's memory vLLM may hold (its weights, activations and KV cache); the
    rest is training's, in the same process. The CPU build reads it as the fraction of the
    machine's memory to reserve, which must be free at start: there, prefer kv_cache_gb."""
    kv_cache_gb: float | None = None
    """KV cache size in GiB, instead of what gpu_memory_utilization leaves for it; None: vLLM
    sizes it from gpu_memory_utilization."""
    enforce_eager: bool = False
    """Run vLLM's model eagerly: no CUDA graphs and no torch.compile, so a faster start and
    slower decoding (on the CPU it also skips a long compile)."""
    sleep_mode: bool = True
    """On CUDA, free vLLM's weights and KV cache while the update runs (vLLM's sleep mode;
    the weights come back with the next sync). Nothing to free on the CPU build."""

    def check(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"rollout.vllm.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_gb is not None:
            positive("rollout.vllm.kv_cache_gb", self.kv_cache_gb)


@dataclass
class ServerConfig:
    """Settings of the `server` rollout engine (rollout.engine: server, grpo.rollout.server): a
    generation server (`grpo serve`) that the trainer sends prompts to and, after each optimizer
    step, streams its weights to. Its shared secret is read from the environment variable
    GRPO_SERVE_API_KEY, never from a config file."""

    url: str = "http://127.0.0.1:8000"
    """The server's base URL (TRL's vllm_server_base_url), as `grpo serve` prints it."""
    timeout: float = 240.0
    """Seconds to wait for the server to answer at start, and for it to come back when it stops
    answering mid-run (TRL's vllm_server_timeout); then the run stops with one line naming it."""
    request_timeout: float = 600.0
    """Seconds one generation request may take, all of it (TRL's request_timeout)."""
    weight_sync_timeout: float = 600.0
    """Seconds each step of a weight push may take: the handshake, the transfer, the finish
    (TRL's weight_sync_timeout)."""
    group_port: int = 0
    """The port the trainer opens for the weight-transfer group the server joins (TRL's
    vllm_group_port); 0: a free port."""
    bucket_mb: int = 64
    """MiB of weights sent per transfer: tensors are packed into buckets of this size, so at most
    one bucket (or one tensor larger than it) is held for the push at a time."""

    def check(self) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(self.url) if isinstance(self.url, str) and len(self.url) <= 2048 else None
        if parts is None or parts.scheme != "http" or not parts.hostname or parts.query:
            raise ConfigError(
                f"rollout.server.url: {safe_yaml.shown(self.url)} is not an http://HOST:PORT URL; write e.g. "
                "http://127.0.0.1:8000 (what `grpo serve` prints)"
            )
        try:
            port = parts.port  # urlsplit checks it on reading
        except ValueError:
            port = -1
        if port is not None and not 0 < port < 65536:
            raise ConfigError(
                f"rollout.server.url: {safe_yaml.shown(self.url)} has a bad port; write e.g. http://127.0.0.1:8000"
            )
        for key in ("timeout", "request_timeout", "weight_sync_timeout"):
            value = getattr(self, key)
            if not 0 < value <= MAX_SECONDS:
                raise ConfigError(
                    f"rollout.server.{key}: seconds in (0, {MAX_SECONDS}], got {value}"
                )
        if not 0 <= self.group_port <= 65535:
            raise ConfigError(
                f"rollout.server.group_port: a port in [1, 65535], or 0 for a free one; got {self.group_port}"
            )
        if not 1 <= self.bucket_mb <= 4096:
            raise ConfigError(f"rollout.server.bucket_mb: MiB in [1, 4096], got {self.bucket_mb}")


@dataclass
class RolloutConfig:
    num_generations: int = 8
    """G: completions sampled per prompt (one group)."""
    max_completion_length: int = 512
    """Most tokens generated per completion."""
    max_prompt_length: int | None = None
    """Prompts longer than this (in tokens) keep their first token when it is BOS and their
    last max_prompt_length - 1 tokens (the instruction's end, where the question is): the
    start goes (few-shot text first). Counted in `prompts/truncated`; None keeps them whole."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p x the most likely one (0: off; TRL's min_p)."""
    repetition_penalty: float = 1.0
    """Penalise every token already in the prompt or the completion: its logit is divided by this
    when positive, multiplied when negative (1: off; >1 discourages repeats; TRL's
    repetition_penalty). It shapes the distribution the sampling logprobs are taken from."""
    ignore_eos: bool = False
    """Always generate `max_completion_length` tokens (for benchmarks)."""
    min_new_tokens: int = 0
    """No EOS before this many tokens of a turn (its logit is -inf there, as transformers'
    min_new_tokens and vLLM's min_tokens do; stop strings still end a completion); 0: off."""
    stop_strings: list[str] = field(default_factory=list)
    """End a completion once it contains one of these strings (e.g. ["\\n\\n"] after
    few-shot examples, so a base model does not write the next example)."""
    engine: str = "hf"
    """Generation engine (grpo.registry.ROLLOUT_ENGINES): `hf`, transformers' model with
    grpo's prefix sharing and compaction; `vllm`, a vLLM engine in the training process
    (needs the vllm package; settings under rollout.vllm); `server`, a generation server
    started with `grpo serve` (settings under rollout.server)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The `vllm` engine's settings (read only when rollout.engine is vllm)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """The `server` engine's settings (read only when rollout.engine is server): where
    `grpo serve` listens and how long each exchange with it may take."""
    max_staleness: int = 0
    """Asynchronous GRPO: generation runs up to this many steps ahead of training, on a generation
    server (rollout.engine: server), while the trainer trains. The batch of step s (counted from 1)
    is sampled from the weights after step max(0, s - 1 - max_staleness): a fixed schedule, so the
    same run twice, or one killed and resumed, takes the same steps, and a batch is never more than
    max_staleness steps stale. The update weights each token by its importance ratio against the
    sampler's logprobs (algorithm.rollout_correction: auto). 0: synchronous, each batch sampled from
    the weights of the step before (TRL's max_staleness; docs/async.md). At most 32."""
    weight_sync_steps: int = 1
    """With max_staleness > 0: push the weights to the generation server every this many steps
    (TRL's weight_sync_steps), at most max_staleness + 1, so that no batch is more than
    max_staleness steps stale; the batch of step s is then sampled from the oldest pushed weights
    within the bound."""
    cuda_decoding: str = "auto"
    """How the `hf` engine decodes on a CUDA device (grpo.cuda): `graphs`, a loop of fixed shape
    from a bf16 copy of the weights (LoRA merged in), each token step one replayed CUDA graph;
    `eager`, transformers' modules step by step under autocast, as on any device; `auto`: graphs
    where they apply and a self-check on the run's own model agrees with the eager step, else
    eager, with one warning naming why. Off CUDA it changes nothing (`graphs` is refused there).
    Both sample the same distribution from the same seeds; graphs keep bf16 between the products
    where eager keeps float32, so their tokens part where that rounding decides one. The GPU
    speed of graphs is unmeasured."""
    tools: list[str] = field(default_factory=list)
    """Functions the model may call during a completion, as 'module:function' or
    'path/to/file.py:function' names, as reward functions are given (type hints and a docstring
    give each its schema), or `python`, the built-in tool that runs the model's
    code in grpo.sandbox (rewards.sandbox's settings); their results are appended to the
    completion and left out of the loss (grpo.rollout.multiturn, docs/agents.md). Empty: one
    turn, no tools."""
    max_tool_calls: int = 5
    """Most turns with tool calls per completion (TRL's max_tool_calling_iterations); the turn
    after the last of them is the model's last."""
    tool_timeout: float = 10.0
    """Seconds a tool call may take; one that takes longer is abandoned and answered with a
    timeout message (counted in tools/timeouts)."""
    tool_output_chars: int = 4096
    """A tool's result (and error text) is cut to this many characters."""
    malformed_tool_calls: str = "end"
    """A call that cannot be parsed (not JSON, no tool name, arguments not an object, too long).
    end: it is not a call, so a turn with no other call is the model's answer and ends the
    completion (TRL's behaviour); counted in tools/malformed_frequency. answer: it is answered
    with the parse error as its result and counted as a failed call, and the model goes on (a
    base model learning the call format sees its mistake)."""
    tool_isolation: str = "process"
    """process: each call in a forked process, killed at the timeout (a tool that crashes or calls
    os._exit costs only its call); thread: in a thread of the training process (cheaper; a hung
    call's thread is left running, a tool that ends the process ends the run)."""
    tool_memory_mb: int = 1024
    """Memory each process-isolated tool call may write, in MiB: its own cgroup's limit where the
    trainer runs as root with writable cgroups (every page the call writes counts, copies of the
    trainer's included), else RLIMIT_DATA past the trainer's data size at the fork, which a call
    beside a long-lived trainer can exceed by reusing its freed heap (docs/agents.md); a call past
    it gets an error as its result (MemoryError), counted in tools/failure_frequency; 0 = no
    limit. Calls in threads have none."""
    environment: str | dict[str, str] | None = None
    """TRL's environment_factory: 'module:Factory' or 'path/to/file.py:Factory' (a class or a
    function returning an environment: an object with reset(**row) whose public methods are the
    completion's tools and whose optional get_reward() scores it), one instance per completion;
    or environment names mapped to such names, each row's `environment` column choosing its
    own (grpo.rollout.environments, docs/agents.md)."""

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        registry.ROLLOUT_ENGINES.check(self.engine)
        self.vllm.check()
        self.server.check()
        one_of("rollout.cuda_decoding", self.cuda_decoding, ("auto", "eager", "graphs"))
        if self.cuda_decoding == "graphs" and (
            self.engine != "hf" or cfg.training.sharding != "none"
        ):
            raise ConfigError(
                "rollout.cuda_decoding=graphs is the hf engine's decoding of an unsharded model; "
                "set rollout.cuda_decoding=auto, or rollout.engine=hf and training.sharding=none"
            )
        self._check_tools()
        self._check_ahead(cfg, world_size)
        if self.engine == "vllm" and cfg.model.lora.quantize != "none":
            raise ConfigError(
                f"rollout.engine: vllm pushes the policy's merged weights into vLLM, which cannot be done for "
                f"a quantized base (model.lora.quantize={cfg.model.lora.quantize}); set model.lora.quantize: none, "
                "or rollout.engine: hf"
            )
        if self.engine == "server" and (
            cfg.model.lora.quantize != "none" or cfg.training.sharding != "none"
        ):
            raise ConfigError(
                "rollout.engine: server pushes the policy's whole (merged) weights from rank 0, which is not "
                f"built for a quantized base (model.lora.quantize={cfg.model.lora.quantize}) or sharded training "
                f"(training.sharding={cfg.training.sharding}) yet; set them to none, or rollout.engine: hf"
            )
        if self.engine == "vllm" and world_size > 1:
            raise ConfigError(
                "rollout.engine: vllm runs in one process on the first visible GPU and starts its own process "
                f"group; it does not run under torchrun ({world_size} processes) yet: use rollout.engine: hf there"
            )
        if self.num_generations < 2:
            raise ConfigError(
                f"rollout.num_generations: must be >= 2 (advantages compare completions within a group), got {self.num_generations}"
            )
        positive("rollout.max_completion_length", self.max_completion_length)
        if self.max_prompt_length is not None:
            positive("rollout.max_prompt_length", self.max_prompt_length)
        positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        positive("rollout.top_k", self.top_k, allow_zero=True)
        if not 0 <= self.min_p < 1:
            raise ConfigError(
                f"rollout.min_p: must be in [0, 1) (0 turns it off), got {self.min_p}"
            )
        positive("rollout.repetition_penalty", self.repetition_penalty)

    def _check_ahead(self, cfg: WholeConfig, world_size: int) -> None:
        """max_staleness and weight_sync_steps: their ranges, and what generating ahead runs with."""
        k, every = self.max_staleness, self.weight_sync_steps
        if not 0 <= k <= MAX_STALENESS:
            raise ConfigError(
                f"rollout.max_staleness: steps in [0, {MAX_STALENESS}] (0: synchronous), got {k}"
            )
        if not 1 <= every <= k + 1:
            raise ConfigError(
                f"rollout.weight_sync_steps: must be in [1, rollout.max_staleness + 1 = {k + 1}] (a push every "
                f"N steps keeps batches within max_staleness steps of training only when N <= max_staleness + 1), "
                f"got {every}; raise rollout.max_staleness or lower weight_sync_steps"
            )
        if k == 0:
            return
        ahead = f"rollout.max_staleness={k}"
        if self.engine != "server":
            raise ConfigError(
                f"{ahead}: generating ahead of training needs a generation server in another process, and "
                f"rollout.engine: {self.engine} generates in the trainer's; set rollout.engine: server and start "
                "`grpo serve` (or set rollout.max_staleness: 0)"
            )
        if self.tools or self.environment is not None:
            raise ConfigError(
                f"{ahead}: tools and environments run in the trainer's process and are not generated ahead "
                "yet; set rollout.max_staleness: 0 for a run with rollout.tools or rollout.environment"
            )
        if cfg.algorithm.dynamic_sampling:
            raise ConfigError(
                f"{ahead} with algorithm.dynamic_sampling: a step's extra rounds are drawn when the step "
                "finds too few groups with spread, which a schedule fixed ahead cannot hold; turn one of them off"
            )
        if world_size > 1:
            raise ConfigError(
                f"{ahead}: generating ahead runs in one training process yet ({world_size} here); run it "
                "without torchrun, or set rollout.max_staleness: 0"
            )

    def _check_tools(self) -> None:
        specs = (
            self.environment
            if isinstance(self.environment, dict)
            else {"": self.environment}
            if self.environment is not None
            else {}
        )
        for name, spec in specs.items():
            key = f"rollout.environment.{name}" if name else "rollout.environment"
            target, _, factory = spec.partition(":") if isinstance(spec, str) else ("", "", "")
            if not target or not factory or len(spec) > 500:
                raise ConfigError(
                    f"{key}: {safe_yaml.shown(spec)} is not a 'module:Factory' name; write e.g. envs:Counter or "
                    "envs.py:Counter (a class whose reset(**row) starts an episode)"
                )
        if len(self.tools) > MAX_TOOLS:
            raise ConfigError(f"rollout.tools: at most {MAX_TOOLS} tools, got {len(self.tools)}")
        for spec in self.tools:
            if spec == "python":  # the built-in tool: code run in grpo.sandbox (rewards.sandbox)
                continue
            module, _, name = spec.partition(":")
            if not module or not name or len(spec) > 500:
                raise ConfigError(
                    f"rollout.tools: {safe_yaml.shown(spec)} is not a 'module:function' name; write e.g. "
                    "mytools:calculator or tools.py:calculator (a function with type hints and a docstring)"
                )
        if not 1 <= self.max_tool_calls <= MAX_TOOL_CALLS:
            raise ConfigError(
                f"rollout.max_tool_calls: must be in [1, {MAX_TOOL_CALLS}], got {self.max_tool_calls}"
            )
        if not 0 <= self.min_new_tokens <= self.max_completion_length:
            raise ConfigError(
                f"rollout.min_new_tokens: must be in [0, rollout.max_completion_length={self.max_completion_length}], "
                f"got {self.min_new_tokens}"
            )
        if not 0 < self.tool_timeout <= 3600:
            raise ConfigError(
                f"rollout.tool_timeout: seconds in (0, 3600], got {self.tool_timeout}"
            )
        if not 1 <= self.tool_output_chars <= MAX_TOOL_OUTPUT_CHARS:
            raise ConfigError(
                f"rollout.tool_output_chars: must be in [1, {MAX_TOOL_OUTPUT_CHARS:,}], got {self.tool_output_chars}"
            )
        if not 0 <= self.tool_memory_mb <= MAX_MIB:
            raise ConfigError(
                f"rollout.tool_memory_mb: must be in [0, {MAX_MIB}] MiB (0 = no limit), got {self.tool_memory_mb}"
            )
        if self.tool_isolation not in ("process", "thread"):
            raise ConfigError(
                f"rollout.tool_isolation: process or thread, got {safe_yaml.shown(self.tool_isolation)}"
            )
        if self.malformed_tool_calls not in MALFORMED_TOOL_CALLS:
            raise ConfigError(
                f"rollout.malformed_tool_calls: {' or '.join(MALFORMED_TOOL_CALLS)}, got "
                f"{safe_yaml.shown(self.malformed_tool_calls)}"
            )


MAX_TOOLS = 64
MALFORMED_TOOL_CALLS = ("end", "answer")
MAX_TOOL_CALLS = 64
MAX_TOOL_OUTPUT_CHARS = 1_000_000


@dataclass
class SandboxConfig:
    """How model-written programs run (grpo.sandbox): the code rewards' settings."""

    isolation: str = "bwrap"
    """bwrap: namespaces, a read-only filesystem and no network (needs bubblewrap); process:
    resource limits and a separate uid only, with a loud warning (see docs/rewards.md, the threat model)."""
    python: str | None = None
    """The interpreter programs run with; None: the first of this one, /usr/bin/python3 and
    /usr/local/bin/python3 that runs inside the sandbox."""
    timeout: float = 10.0
    """Wall-clock seconds per program run (each stdin/stdout case is one run)."""
    memory_mb: int = 512
    """Memory per run: each process's address space, and all of them together (cgroup)."""
    processes: int = 32
    """Processes and threads a run may have at once."""
    output_kb: int = 1024
    """stdout and stderr kept per run; a program that writes more is stopped."""
    workers: int = 0
    """Programs run at once; 0 = one per CPU core."""

    def check(self) -> None:
        one_of("rewards.sandbox.isolation", self.isolation, ("bwrap", "process"))
        # each becomes an OS limit of the run (prlimit, a cgroup): bounded here, not there
        within("rewards.sandbox.timeout", self.timeout, MAX_SECONDS, "seconds")
        within("rewards.sandbox.memory_mb", self.memory_mb, MAX_MIB, "MiB")
        within("rewards.sandbox.processes", self.processes, MAX_PROCESSES, "processes")
        within("rewards.sandbox.output_kb", self.output_kb, MAX_MIB, "KiB")
        positive("rewards.sandbox.workers", self.workers, allow_zero=True)


DEFAULT_REWARDS = ["arithmetic_correct"]
TASK_REWARDS = {
    "gsm8k": ["math_answer"],
    "math": ["math_answer"],
    "code": ["humaneval_tests"],
    "humaneval": ["humaneval_tests"],
}
"""rewards.funcs for tasks whose reward is not the default one, when the config leaves rewards.funcs
unset (`apply_task_rewards`)."""


@dataclass
class RewardsConfig:
    funcs: list[str] = field(default_factory=lambda: list(DEFAULT_REWARDS))
    """Reward functions: built-in names (see `grpo.rewards.reward_set.BUILTIN`) or
    `module.path:function` / `path/to/file.py:function`, called TRL-style as
    fn(prompts, completions, **columns) -> list[float | None], or `reward_model:PATH`
    (a sequence-classification model, grpo.rewards.reward_model). Left unset, tasks gsm8k
    and math use `math_answer` instead, code and humaneval `humaneval_tests`."""
    weights: list[float] | None = None
    """reward_weights: one weight per function; None weighs each 1.0."""
    overlong_buffer: int | None = None
    """DAPO soft overlong penalty: the last `overlong_buffer` tokens before
    max_completion_length are penalised linearly (added as reward `overlong`)."""
    overlong_weight: float = 1.0
    """Weight of the overlong penalty."""
    math_forms: list[str] = field(default_factory=lambda: ["boxed", "gsm8k", "answer"])
    """Where `math_answer` reads a completion's final answer: the last \\boxed{...}, GSM8K's
    `#### N`, the seed's `Answer: N` (the last one in the text wins, whichever its form)."""
    math_timeout: float = 5.0
    """Seconds one `math_answer` comparison through math-verify may take; past that it scores 0."""
    timeout: float = 60.0
    """Seconds one call of a reward function may take (a chunk of the batch, for one in a
    worker process); past that its rewards for those completions are missing (NaN) and
    counted in rewards/<name>/timeouts (grpo.rewards.execution)."""
    workers: int = 0
    """Worker processes that run the user's reward functions, the batch split between
    them; 0 = one per CPU core, at most 8; at most 4 per core."""
    worker_memory_mb: int = 4096
    """Memory limit of each reward worker process, in MiB (RLIMIT_DATA: the memory it writes to,
    not the address space it reserves, which CUDA reserves by the terabyte): a reward that
    allocates past it fails that call (MemoryError) instead of taking the machine's memory;
    0 = no limit."""
    isolation: str = "process"
    """Where the user's reward functions run: `process` (worker processes: a hang, exit or
    crash costs a worker, not the run) or `thread` (threads of the trainer: no start-up,
    shared state, but a hang is only abandoned and an os._exit ends the run). Built-in
    rewards always run in threads of the trainer."""
    reward_model_device: str = "auto"
    """Device of `reward_model:PATH` rewards (its own, not the policy's): auto (cuda when
    available, else cpu), cpu, cuda or cuda:N."""
    reward_model_dtype: str = "float32"
    """Dtype of `reward_model:PATH` rewards: float32, bfloat16 or float16."""
    reward_model_batch_size: int = 8
    """Completions a reward model scores in one forward pass."""
    code_reward: str = "fraction"
    """`code_tests`: the fraction of test cases passed, or `all` (1 when every case passes, else 0)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where the code rewards run model-written programs."""

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        # an empty rewards.funcs is refused where the reward set is built (RewardSet.from_config):
        # an environment may score its own rollouts
        if self.weights is not None and len(self.weights) != len(self.funcs):
            raise ConfigError(
                f"rewards.weights: {len(self.weights)} weights for {len(self.funcs)} functions in rewards.funcs; give one weight per function"
            )
        if not self.math_forms:
            raise ConfigError("rewards.math_forms: empty; list some of boxed, gsm8k, answer")
        for form in self.math_forms:
            one_of("rewards.math_forms[]", form, ("boxed", "gsm8k", "answer"))
        within("rewards.math_timeout", self.math_timeout, MAX_SECONDS, "seconds")
        within("rewards.timeout", self.timeout, MAX_SECONDS, "seconds")
        if self.workers < 0:
            raise ConfigError(
                f"rewards.workers: must be >= 0 (0 = one per CPU core, at most 8), got {self.workers}"
            )
        most = MAX_WORKERS_PER_CORE * (os.cpu_count() or 1)
        if self.workers > most:
            raise ConfigError(
                f"rewards.workers: {self.workers} worker processes for {os.cpu_count() or 1} CPU cores; "
                f"use at most {most} ({MAX_WORKERS_PER_CORE} per core), or 0 for one per core"
            )
        if not 0 <= self.worker_memory_mb <= MAX_MIB:
            raise ConfigError(
                f"rewards.worker_memory_mb: must be in [0, {MAX_MIB}] MiB (0 = no limit), got {self.worker_memory_mb}"
            )
        one_of("rewards.isolation", self.isolation, ("process", "thread"))
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.reward_model_device):
            raise ConfigError(
                f"rewards.reward_model_device: {self.reward_model_device!r} is not one of auto, cpu, cuda, cuda:N"
            )
        one_of(
            "rewards.reward_model_dtype",
            self.reward_model_dtype,
            ("float32", "bfloat16", "float16"),
        )
        positive("rewards.reward_model_batch_size", self.reward_model_batch_size)
        one_of("rewards.code_reward", self.code_reward, ("fraction", "all"))
        self.sandbox.check()
        max_length = cfg.rollout.max_completion_length
        if self.overlong_buffer is not None and not 0 < self.overlong_buffer <= max_length:
            raise ConfigError(
                f"rewards.overlong_buffer: must be in (0, rollout.max_completion_length={max_length}], got {self.overlong_buffer}"
            )
