"""GRPOTrainer's arguments checked before anything is built (`check_arguments`), TRL's default
GRPOConfig (`default_args`), and the arguments passed on to grpo's Trainer as they are once
checked: `tools=` (`tool_functions`) and the policy's processing class (`policy_tokenizer`)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpo.trl.config import GRPOConfig


def check_arguments(unknown: dict, optimizers, reward_funcs, environment_factory) -> None:
    """What GRPOTrainer refuses before reading anything: an unknown argument, optimizers=,
    being run by a reward worker importing an unguarded script, and no reward source."""
    if "reward_processing_class" in unknown:
        raise TypeError(
            "GRPOTrainer: unknown argument reward_processing_class=; TRL's is reward_processing_classes= "
            "(plural), the tokenizers of reward models given by id; a reward function needs none"
        )
    if unknown:
        raise TypeError(f"GRPOTrainer: unknown argument(s) {', '.join(sorted(unknown))}")
    if optimizers != (None, None):
        raise NotImplementedError(
            "GRPOTrainer: optimizers= is not supported; grpo builds AdamW from learning_rate, weight_decay and adam_*"
        )
    if rerun_by_a_spawned_worker():
        raise RuntimeError(
            "GRPOTrainer: a reward worker process (rewards.isolation=process) imported the training script, "
            'which trains at its top level; train under `if __name__ == "__main__":` or use '
            "grpo_overrides=['rewards.isolation=thread']"
        )
    if (reward_funcs is None or reward_funcs == []) and environment_factory is None:
        raise ValueError(
            "GRPOTrainer: No reward source provided; pass reward_funcs (a callable, a grpo reward name, "
            "a reward model's id or path, or a list of them), or an environment_factory whose "
            "environment defines get_reward"
        )


def rerun_by_a_spawned_worker() -> bool:
    """Whether this call comes from the top level of a script that a spawned process is importing
    (as `__mp_main__`): an unguarded training script, re-run by a reward worker."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def default_args(model) -> GRPOConfig:
    """TRL's GRPOConfig when none is given: a directory named after the model."""
    name = (
        model if isinstance(model, (str, Path)) else getattr(model, "name_or_path", "") or "model"
    )
    return GRPOConfig(output_dir=f"{Path(str(name)).name}-GRPO")


def tool_functions(tools) -> list:
    """GRPOTrainer's tools=: functions (sync or async) with type hints and a docstring."""
    if tools is None:
        return []
    if callable(tools) or isinstance(tools, str):
        tools = [tools]
    tools = list(tools)
    for tool in tools:
        if not callable(tool):
            raise TypeError(
                f"GRPOTrainer: tools= takes functions (with type hints and a docstring), got {type(tool).__name__}"
            )
    return tools


def policy_tokenizer(model, processing_class):
    """The policy's processing class: the one passed, or else the tokenizer saved at an in-memory
    model's name_or_path (None for a model grpo loads by name), prepared as grpo's loader
    prepares its own (left padding, a pad token)."""
    if model is not None and processing_class is None:
        name = getattr(model, "name_or_path", "") or ""
        if not name:
            raise ValueError(
                "GRPOTrainer: processing_class is required for a model built in memory (pass its tokenizer)"
            )
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(name)
    if processing_class is not None:
        from grpo.models.loading import prepare_tokenizer

        prepare_tokenizer(processing_class)
    return processing_class
