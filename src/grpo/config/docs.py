"""A config as YAML with each key's documentation above it (`grpo config show`, `grpo init`).

The documentation of a key is the string written under its field in the config
dataclasses (grpo.config.schema's Config and its sections' modules), read from their source
with `ast`, so the file, the code and `grpo config show` never disagree. `SECTIONS` is the one-line summary of
each section that `grpo train --help` lists.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
from typing import Any

import yaml

from grpo.config.schema import Config

SECTIONS: dict[str, tuple[str, str]] = {
    # section: (what it holds, an example override)
    "model": (
        "the policy: a hub id, a local directory, a .gguf file, gemma-3-270m or tiny; dtype, LoRA (model.lora)",
        "model.name=Qwen/Qwen2.5-0.5B-Instruct",
    ),
    "data": (
        "the task and its rows: arithmetic, jsonl, hf, gsm8k, math, code; prompt column, chat template",
        "data.task=jsonl data.train_file=train.jsonl",
    ),
    "rollout": (
        "generation: the engine (hf, vllm), completions per prompt (G), max_completion_length, temperature, "
        "top_p, top_k, stop strings",
        "rollout.num_generations=8",
    ),
    "rewards": (
        "reward functions (built-in names, file.py:function, reward_model:PATH), weights, timeouts, sandbox",
        "rewards.funcs=[math_answer,think_format]",
    ),
    "algorithm": (
        "the objective: a paper's preset (grpo, dr_grpo, dapo, gspo), the advantage estimator (gae: PPO "
        "with a critic), policy loss, KL beta, clipping, loss_type, rollout correction",
        "algorithm.preset=dapo",
    ),
    "training": (
        "optimisation: max_steps, batch sizes, learning rate and schedule, bf16, checkpoints, device",
        "training.max_steps=50",
    ),
    "eval": (
        "held-out evaluation before, during and after training: decoding temperatures, problems, batch size",
        "eval.after=true",
    ),
    "logging": (
        "the console line, sample completions, trackers (tensorboard, wandb, trackio)",
        "logging.report_to=[wandb]",
    ),
    "health": (
        "health checks on every step (docs/health.md): their thresholds, and fail_on to stop a run when one fires",
        "health.fail_on=[no_learning_signal]",
    ),
}


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string written under it} of a dataclass, from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source at hand (e.g. a frozen build)
        return {}
    body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef)), [])
    docs = {}
    for here, after in zip(body, body[1:]):
        if (
            isinstance(here, ast.AnnAssign)
            and isinstance(here.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[here.target.id] = inspect.cleandoc(after.value.value)
    return docs


def doc_of(owner: type, name: str, value: Any) -> str | None:
    """A key's documentation: the string under its field, else (a section) its class's docstring."""
    doc = field_docs(owner).get(name)
    if doc is None and dataclasses.is_dataclass(value) and type(value).__doc__:
        own = type(value).__doc__
        if not own.startswith(
            f"{type(value).__name__}("
        ):  # dataclass's generated signature is no documentation
            doc = inspect.cleandoc(own)
    return doc


def _comment(text: str, pad: str) -> list[str]:
    return [f"{pad}# {line}".rstrip() for line in text.splitlines()]


def _scalar(name: str, value: Any, pad: str) -> list[str]:
    """`name: value` as YAML reads it back (leaf lists in flow style), each line indented by `pad`."""
    if (
        isinstance(value, str) and "\n" in value
    ):  # one line, escaped: JSON's string is YAML's double-quoted one
        return [f"{pad}{name}: {json.dumps(value, ensure_ascii=False)}"]
    if isinstance(value, (list, dict)):
        flow = yaml.safe_dump(
            value, default_flow_style=True, width=10**6, allow_unicode=True
        ).strip()
        return [f"{pad}{name}: {flow}"]
    text = yaml.safe_dump(
        {name: value}, default_flow_style=False, sort_keys=False, width=10**6, allow_unicode=True
    )
    return [pad + line for line in text.rstrip("\n").split("\n")]


def _lines(node: Any, depth: int) -> list[str]:
    pad, lines = "  " * depth, []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            if depth == 0:
                lines.append("")
                summary = SECTIONS.get(f.name)
                if summary:
                    lines += _comment(f"{f.name}: {summary[0]}", pad)
            doc = doc_of(type(node), f.name, value)
            if doc and depth > 0:
                lines += _comment(doc, pad)
            lines.append(f"{pad}{f.name}:")
            lines += _lines(value, depth + 1)
            continue
        doc = doc_of(type(node), f.name, value)
        if doc:
            lines += _comment(doc, pad)
        lines += _scalar(f.name, value, pad)
    return lines


def commented_yaml(cfg: Config, header: str = "") -> str:
    """Every key of `cfg` with its value, the documentation of each as a comment above it;
    `config.load` reads it back to the same config."""
    lines = _comment(header, "") if header else []
    return "\n".join(lines + _lines(cfg, 0)) + "\n"
