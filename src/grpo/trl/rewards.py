"""TRL's reward arguments as grpo's: `reward_funcs` (callables, grpo reward names, reward
models by id, path or object) named as TRL names them, each resolved by
grpo.rewards.reward_set.reward_function; `reward_processing_classes` read as TRL reads them;
and reward functions defined in the training script itself kept out of worker processes."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from grpo.config.schema import Config


def reward_specs(funcs) -> list[str]:
    """What rewards.funcs records of the reward functions passed (one entry each, so that
    reward_weights is checked against their number): a name or path as given, a callable's name."""
    funcs = funcs if isinstance(funcs, list) else [funcs]
    return [
        str(fn)
        if isinstance(fn, (str, Path))
        else getattr(fn, "__name__", None)
        or getattr(getattr(fn, "config", None), "name_or_path", None)
        or type(fn).__name__
        for fn in funcs
    ]


def processing_classes(classes, count: int) -> list:
    """TRL's reading: None is None for each reward function; one tokenizer is a list of one."""
    if classes is None:
        return [None] * count
    return list(classes) if isinstance(classes, list) else [classes]


def reward_functions(funcs, classes, cfg: Config) -> dict[str, Callable]:
    """Named reward functions, as TRL names them (the function's __name__, a model by its path;
    a second function of a name gets `_2`), each with its processing class from `classes`."""
    from grpo.rewards.reward_set import is_named_reward, reward_function

    funcs = funcs if isinstance(funcs, list) else [funcs]
    tokenizers = processing_classes(classes, len(funcs))
    if len(tokenizers) != len(funcs):
        raise ValueError(
            f"GRPOTrainer: the number of reward_processing_classes ({len(tokenizers)}) must match the number "
            f"of reward_funcs ({len(funcs)}); give a list with one per reward function (None for a "
            "function, or for a reward model's own tokenizer)"
        )
    named: dict[str, Callable] = {}
    for fn, tokenizer in zip(funcs, tokenizers):
        if isinstance(fn, (str, Path)):
            if tokenizer is not None and is_named_reward(str(fn)):
                raise ValueError(
                    f"GRPOTrainer: reward_processing_classes for {fn}: only a reward model takes a tokenizer; "
                    "pass None for it"
                )
        elif not callable(fn):
            raise TypeError(
                f"GRPOTrainer: reward_funcs: {fn!r} is neither a callable nor a model id/path"
            )
        name, fn = reward_function(fn, cfg.rewards, tokenizer)
        base, k = name, 1
        while name in named:  # two functions of one name each keep their own column
            k += 1
            name = f"{base}_{k}"
        named[name] = fn
    return named


def script_rewards_in_threads(
    funcs: dict[str, Callable], cfg: Config, overrides: list[str]
) -> None:
    """Reward functions defined in the script itself run in threads of the trainer, unless
    rewards.isolation is set: a worker process loads them by importing the script again, and a
    TRL script trains at its top level (no `if __name__ == "__main__":`), so every worker
    would run the whole training."""
    in_script = [
        name for name, fn in funcs.items() if getattr(fn, "__module__", None) == "__main__"
    ]
    if (
        in_script
        and cfg.rewards.isolation == "process"
        and not any(o.startswith("rewards.isolation=") for o in overrides)
    ):
        cfg.rewards.isolation = "thread"
        warnings.warn(
            f"GRPOTrainer: reward functions defined in the script ({', '.join(in_script)}) run in threads of the "
            "trainer; to run them in worker processes (a hang or crash costs a worker, not the run), train under "
            "`if __name__ == \"__main__\":` and pass grpo_overrides=['rewards.isolation=process']",
            stacklevel=3,  # GRPOTrainer's caller
        )
