"""TRL's dataset arguments as grpo's rows: a datasets.Dataset, a list of row dicts or a .jsonl
path read whole; an IterableDataset read up front, as far as one run goes; a dict of named
held-out datasets recognised; and the rows of an environment that sets each task itself."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.config.errors import ConfigError
from grpo.config.schema import Config

if TYPE_CHECKING:
    from grpo.trl.config import GRPOConfig


def is_dataset_dict(dataset) -> bool:
    """A dict of named datasets: a dict, a datasets.DatasetDict or IterableDatasetDict."""
    return isinstance(dataset, dict)  # DatasetDict and IterableDatasetDict are dicts


PROMPT_FIX = (
    "a TRL dataset holds each prompt in a 'prompt' column (text, or chat messages): add one, or "
    "rename the column that holds them (dataset.rename_column(NAME, 'prompt'))"
)


def checked(rows: list[dict], what: str, default_prompt: bool = False) -> list[dict]:
    """`rows` with each prompt checked by the check the CLI's JSONL task makes of its lines
    (grpo.tasks.data.checked_prompt_row): a row without a `prompt`, or whose prompt is neither
    text nor a list of chat messages, is a ConfigError naming `what` and the row. With
    `default_prompt` (an environment sets each task) a row without one gets TRL's default first."""
    from grpo.tasks.data import checked_prompt_row

    if default_prompt:
        rows = with_default_prompt(rows)
    return [
        checked_prompt_row(
            row, f"GRPOTrainer: {what}, row {i} (counting from 0)", "prompt", PROMPT_FIX
        )
        for i, row in enumerate(rows)
    ]


def rows_of(dataset, what: str, default_prompt: bool = False) -> list[dict]:
    """Every row of a datasets.Dataset, a list of dicts or a .jsonl path (`what`: the argument's
    name, for the error), checked (`checked`)."""
    if isinstance(dataset, (str, Path)):
        from grpo.tasks.data import read_jsonl

        return read_jsonl(dataset, "prompt")  # each line checked as it is read
    if hasattr(dataset, "to_list"):  # datasets.Dataset
        return checked(dataset.to_list(), what, default_prompt)
    if isinstance(dataset, list) and all(isinstance(row, dict) for row in dataset):
        return checked([dict(row) for row in dataset], what, default_prompt)
    raise TypeError(
        f"GRPOTrainer: {what} must be a datasets.Dataset or IterableDataset, a list of dicts or a .jsonl path, got {type(dataset).__name__}"
    )


EVAL_STREAM_LIMIT = 10_000
"""The most held-out rows read from an IterableDataset without eval.num_problems: one that
goes on past it may be endless, and is refused."""


def is_iterable_dataset(dataset) -> bool:
    datasets = sys.modules.get("datasets")  # not imported: then it cannot be one
    return datasets is not None and isinstance(dataset, datasets.IterableDataset)


def take_rows(dataset, what: str, count: int, default_prompt: bool = False) -> list[dict]:
    """The first `count` rows of an IterableDataset (fewer when it ends sooner), checked (`checked`)."""
    import itertools

    rows = [dict(row) for row in itertools.islice(iter(dataset), count)]
    if not rows:
        raise ValueError(f"GRPOTrainer: {what} (an IterableDataset) yielded no rows")
    return checked(rows, what, default_prompt)


def eval_rows_of(dataset, cfg: Config) -> list[dict] | None:
    """The held-out rows of `dataset` (None: none given); an IterableDataset is read to
    eval.num_problems rows, or whole up to EVAL_STREAM_LIMIT."""
    if dataset is None:
        return None
    if not is_iterable_dataset(dataset):
        return rows_of(dataset, "eval_dataset")
    wanted = cfg.eval.num_problems
    rows = take_rows(dataset, "eval_dataset", wanted or EVAL_STREAM_LIMIT + 1)
    if wanted is None and len(rows) > EVAL_STREAM_LIMIT:
        raise ValueError(
            f"GRPOTrainer: eval_dataset is an IterableDataset of more than {EVAL_STREAM_LIMIT} rows (maybe endless); "
            "say how many to hold out with GRPOConfig(grpo_overrides=['eval.num_problems=N'])"
        )
    return rows


def environment_owned_rows(environment_factory, args: GRPOConfig) -> list[dict]:
    """TRL's rows when no train_dataset is given: an environment whose reset sets each task owns
    the data; one generation batch of empty prompts, gone through max_steps times."""
    if environment_factory is None:
        raise ValueError(
            "GRPOTrainer: `train_dataset` is required unless an `environment_factory` is provided (a "
            "datasets.Dataset, a list of dicts or a .jsonl path)"
        )
    if isinstance(environment_factory, dict):
        raise ValueError(
            "GRPOTrainer: a dict environment_factory (several environments) requires a `train_dataset` with an "
            "`environment` column naming each row's environment; give one, or a single factory"
        )
    if args.max_steps <= 0:
        raise ValueError(
            "GRPOTrainer: without a train_dataset (the environment's reset() sets each task), max_steps sets the "
            "length of training; set GRPOConfig(max_steps=...)"
        )
    prompts = max(
        1,
        args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations,
    )
    return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(prompts)]


def with_default_prompt(rows: list[dict]) -> list[dict]:
    """TRL's default prompt (an empty user message) under rows an environment sets the task
    of; a row's own prompt wins."""
    return [{"prompt": [{"role": "user", "content": ""}], **row} for row in rows]


def config_and_train_rows(
    args: GRPOConfig, train_dataset, keys: dict, default_prompt: bool = False
) -> tuple[Config, list[dict]]:
    """grpo's Config of `args` (with `keys`, the grpo keys of GRPOTrainer's other arguments) and
    the training rows, checked: a dataset's every row (its size counts the epochs), or an
    IterableDataset's first max_steps x prompts-per-step rows (max_steps is then required, as in
    TRL). `default_prompt`: an environment sets each task (TRL's default prompt where a row has none)."""
    if not is_iterable_dataset(train_dataset):
        rows = rows_of(train_dataset, "train_dataset", default_prompt)
        return args.to_config(len(rows), keys), rows
    if args.max_steps <= 0:
        raise ValueError(
            "GRPOTrainer: train_dataset is an IterableDataset, which has no length to count epochs in; "
            "set GRPOConfig.max_steps"
        )
    c = args.to_config(None, keys)
    count = c.training.max_steps * (c.generation_batch_size() // c.rollout.num_generations)
    return c, take_rows(train_dataset, "train_dataset", count, default_prompt)


def held_out_rows(eval_dataset, cfg: Config) -> list[dict] | None:
    """The rows evaluated during training: None for a dict of named datasets (each evaluated
    by itself, after training; refused when the config evaluates during training)."""
    if not is_dataset_dict(eval_dataset):
        return eval_rows_of(eval_dataset, cfg)
    if cfg.eval.before or cfg.eval.every:
        raise ConfigError(
            "GRPOTrainer: eval_dataset is a dict of datasets, and grpo evaluates one held-out set during "
            "training (eval_strategy, eval_on_start); pass one dataset, or evaluate each after training "
            "with trainer.evaluate()"
        )
    return None
