"""Rows of any dataset the `datasets` library reads (task `hf`).

data.train_file / data.eval_file may each be

    a local file      .json / .jsonl / .parquet / .csv (one split: all of it)
    a directory       written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`
                      (read with `load_from_disk`), or holding data files (`load_dataset(dir)`)
    a hub dataset     `name[:subset[:split]]`, e.g. `openai/gsm8k:main` (needs the network,
                      or the dataset in the local cache when HF_HUB_OFFLINE is set)

A source with splits gives data.train_split (data.eval_split for eval_file), unless
the name carries its own. Columns are renamed by data.columns (`old=new`), then the
prompt is read from data.prompt_column, a string or a list of chat messages, as for
task jsonl. Every other column is kept: reward functions get each as a keyword
argument. The held-out rows are eval_file's, or none; they are scored like jsonl's
(by their integer `answer` when every row has one, else by the reward functions).
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo.config import safe_yaml
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.tasks import Row, Task
from grpo.tasks.data import _check_prompt, check_columns, check_text_file
from grpo.tasks.scorers import AnswerScorer, RewardScorer, has_integer_answers

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""Files `save_to_disk` writes: a DatasetDict's index, a Dataset's state."""


def hf_task(cfg: Config) -> Task:
    d = cfg.data
    train = read_rows(d.train_file, "data.train_file", d.train_split, d.prompt_column, d.columns)
    held_out = (
        read_rows(d.eval_file, "data.eval_file", d.eval_split, d.prompt_column, d.columns)
        if d.eval_file
        else []
    )
    scorer = AnswerScorer() if has_integer_answers(held_out) else RewardScorer()
    return Task("hf", train, held_out, scorer)


def read_rows(
    source: str, key: str, split: str, prompt_column: str, renames: list[str] = ()
) -> list[Row]:
    """Every row of `source` as a dict with its prompt under `prompt` (checked), the other
    columns kept; a ConfigError naming `key` for anything that cannot be read."""
    dataset, where = load(source, key, split)
    dataset = _renamed(dataset, renames, key, where)
    if prompt_column not in dataset.column_names:
        raise ConfigError(
            f"{key}: {where} has no {prompt_column!r} column (columns: {sorted(dataset.column_names)}); set "
            f"data.prompt_column to the one holding the prompt, or rename one with data.columns=[name={prompt_column}]"
        )
    rows = dataset.to_list()
    if not rows:
        raise ConfigError(f"{key}: {where} has no rows")
    for number, row in enumerate(rows):
        _check_prompt(row[prompt_column], f"{key}: {where}, row {number}", prompt_column)
        if prompt_column != "prompt":
            row["prompt"] = row.pop(prompt_column)
    check_columns(rows, f"{key}: {where}")
    return rows


def load(source: str, key: str, split: str):
    """(a datasets.Dataset, how to name it in errors) for a file, a directory or a hub name."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"data.task 'hf' reads rows through the `datasets` package ({e}); pip install datasets"
        ) from None
    path = Path(source).expanduser()
    progress_was_on = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # a "Generating train split" bar per file is noise here
    try:
        if path.is_file():
            if path.suffix not in FILE_BUILDERS:
                raise ConfigError(
                    f"{key}: {path} is not a {', '.join(FILE_BUILDERS)} file; convert it, or save it with save_to_disk"
                )
            where = str(path)
            if path.suffix != ".parquet":
                check_text_file(path)  # pyarrow's JSON reader crashes the process on deep nesting
            return datasets.load_dataset(
                FILE_BUILDERS[path.suffix], data_files=str(path), split="train"
            ), where
        if path.is_dir():
            if any((path / marker).is_file() for marker in SAVED_MARKERS):
                loaded = datasets.load_from_disk(str(path))
            else:
                loaded = datasets.load_dataset(str(path))
            return _split(loaded, split, key, str(path)), f"{path} ({split})" if hasattr(
                loaded, "keys"
            ) else str(path)
        if (
            path.suffix in FILE_BUILDERS
            or source.startswith(("/", "./", "../", "~"))
            or os.path.lexists(path)
        ):
            raise ConfigError(
                f"{key}: {path} {safe_yaml.not_a_file(path)}; give the path of a {', '.join(FILE_BUILDERS)} file, a save_to_disk "
                "directory, or a hub dataset as name[:subset[:split]]"
            )
        name, _, rest = source.partition(":")
        subset, _, named_split = rest.partition(":")
        split = named_split or split
        where = f"{name} ({subset or 'default'}, {split})"
        try:
            return datasets.load_dataset(name, subset or None, split=split), where
        except Exception as e:  # unknown dataset or split, no network, ...
            offline = _offline()
            why = (
                f"{offline} is set and it is not in the local cache"
                if offline
                else "is the name right, and the network reachable?"
            )
            raise ConfigError(
                f"{key}: cannot load the hub dataset {where}: {why} ({type(e).__name__}: {str(e)[:200]}); give a "
                "local file or save_to_disk directory instead, or run once online to cache it"
            ) from None
    except ConfigError:
        raise
    except Exception as e:  # a malformed file or directory
        raise ConfigError(
            f"{key}: cannot read {source!r} ({type(e).__name__}: {str(e)[:300]})"
        ) from None
    finally:
        if progress_was_on:
            datasets.utils.enable_progress_bars()


def _split(loaded, split: str, key: str, where: str):
    """A Dataset as it is; a DatasetDict's `split`, or an error listing the splits it has."""
    if not hasattr(loaded, "keys"):
        return loaded
    if split not in loaded:
        which = "train_split" if key.endswith("train_file") else "eval_split"
        raise ConfigError(
            f"{key}: {where} has no split {split!r} (splits: {sorted(loaded)}); set data.{which}"
        )
    return loaded[split]


def _renamed(dataset, renames: list[str], key: str, where: str):
    mapping = {}
    for rename in renames:
        source, _, target = rename.partition("=")
        mapping[source.strip()] = target.strip()
    missing = [name for name in mapping if name not in dataset.column_names]
    if missing:
        raise ConfigError(
            f"data.columns: {where} ({key}) has no column {missing[0]!r} to rename (columns: {sorted(dataset.column_names)})"
        )
    return dataset.rename_columns(mapping) if mapping else dataset


def _offline() -> str | None:
    """The environment variable that keeps `datasets` off the network, if one is set."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None
