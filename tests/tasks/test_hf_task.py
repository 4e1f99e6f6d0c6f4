"""Task `hf`: rows through `datasets` from each local form, and the errors that name the fix."""

from __future__ import annotations

import json

import pytest

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.tasks import load_task
from grpo.tasks.scorers import AnswerScorer, RewardScorer

ROWS = [{"question": f"{a}+{a}=", "answer": 2 * a, "topic": "add"} for a in range(5)]
CHAT = [{"prompt": [{"role": "user", "content": f"{a}*2?"}], "answer": 2 * a} for a in range(3)]


def _cfg(**data):
    return config.from_dict({"data": {"task": "hf", **data}})


def _write(tmp_path, fmt: str, rows=ROWS):
    import datasets

    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_each_file_format_gives_the_rows_with_every_column(tmp_path, fmt):
    path = _write(tmp_path, fmt)
    task = load_task(_cfg(train_file=str(path), prompt_column="question", eval_file=str(path)))
    assert task.name == "hf"
    assert task.train_rows == [
        {"prompt": f"{a}+{a}=", "answer": 2 * a, "topic": "add"} for a in range(5)
    ]
    # every held-out row has an integer answer, as jsonl
    assert isinstance(task.scorer, AnswerScorer)


def test_save_to_disk_directory_and_its_splits(tmp_path):
    import datasets

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS),
            "validation": datasets.Dataset.from_list(ROWS[:2]),
        }
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    datasets.Dataset.from_list(ROWS[:3]).save_to_disk(str(tmp_path / "one"))
    cfg = _cfg(
        train_file=str(tmp_path / "dict"),
        eval_file=str(tmp_path / "dict"),
        eval_split="validation",
        columns=["question=prompt", "topic=kind"],
    )
    task = load_task(cfg)
    assert [r["prompt"] for r in task.train_rows] == [f"{a}+{a}=" for a in range(5)]
    assert [r["answer"] for r in task.eval_rows] == [0, 2]
    assert set(task.train_rows[0]) == {"prompt", "answer", "kind"}  # renamed, nothing dropped
    task = load_task(_cfg(train_file=str(tmp_path / "one"), prompt_column="question"))
    assert (
        len(task.train_rows) == 3 and task.eval_rows == [] and isinstance(task.scorer, RewardScorer)
    )
    with pytest.raises(
        ConfigError,
        match=r"no split 'test' \(splits: \['train', 'validation'\]\); set data.eval_split",
    ):
        load_task(
            _cfg(
                train_file=str(tmp_path / "dict"),
                eval_file=str(tmp_path / "dict"),
                prompt_column="question",
            )
        )


def test_conversational_prompts_are_kept_as_messages(tmp_path):
    task = load_task(_cfg(train_file=str(_write(tmp_path, "parquet", CHAT))))
    assert task.train_rows[1] == {"prompt": [{"role": "user", "content": "1*2?"}], "answer": 2}


def test_missing_prompt_column_names_the_columns_that_exist(tmp_path):
    path = _write(tmp_path, "parquet")
    with pytest.raises(
        ConfigError,
        match=r"data.train_file: .*rows.parquet has no 'prompt' column "
        r"\(columns: \['answer', 'question', 'topic'\]\); set data.prompt_column",
    ):
        load_task(_cfg(train_file=str(path)))
    with pytest.raises(ConfigError, match=r"data.columns: .* no column 'problem' to rename"):
        load_task(_cfg(train_file=str(path), columns=["problem=prompt"]))


def test_a_prompt_that_is_not_text_or_messages_is_refused(tmp_path):
    # a message without a role: arrow fills the missing field with null
    path = _write(
        tmp_path,
        "jsonl",
        [{"prompt": [{"role": "user", "content": "ok"}]}, {"prompt": [{"content": "x"}]}],
    )
    with pytest.raises(
        ConfigError, match=r"row 1: column 'prompt' must be a string or a list of messages"
    ):
        load_task(_cfg(train_file=str(path)))


def test_wrong_paths(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train_file: .*missing.parquet does not exist"):
        load_task(_cfg(train_file=str(tmp_path / "missing.parquet")))
    with pytest.raises(ConfigError, match=r"data.eval_file: .*nowhere does not exist"):
        load_task(
            _cfg(
                train_file=str(_write(tmp_path, "csv")),
                prompt_column="question",
                eval_file=str(tmp_path / "nowhere"),
            )
        )
    (tmp_path / "rows.txt").write_text("a\n")
    with pytest.raises(ConfigError, match=r"rows.txt is not a .jsonl, .json, .parquet, .csv file"):
        load_task(_cfg(train_file=str(tmp_path / "rows.txt")))


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # huggingface_hub and datasets read the variables when imported: an earlier test may have
    # imported them, and they would then try the network (tens of seconds to time out here)
    import datasets
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ConfigError,
        match=r"data.train_file: cannot load the hub dataset no-such-owner/no-such-set "
        r"\(main, train\): HF_HUB_OFFLINE is set and it is not in the local cache",
    ):
        load_task(_cfg(train_file="no-such-owner/no-such-set:main"))


def test_config_checks_name_the_field():
    with pytest.raises(ConfigError, match=r"data.train_file: task 'hf' needs its rows"):
        _cfg()
    with pytest.raises(
        ConfigError, match=r"data.columns\[1\]: 'answer' is not `dataset_column=row_key`"
    ):
        _cfg(train_file="x.jsonl", columns=["question=prompt", "answer"])
    with pytest.raises(ConfigError, match=r"data.columns\[1\]: two columns renamed to 'prompt'"):
        _cfg(train_file="x.jsonl", columns=["question=prompt", "problem=prompt"])
    with pytest.raises(ConfigError, match=r"data.eval_split: empty"):
        _cfg(train_file="x.jsonl", eval_split=" ")
    with pytest.raises(
        ConfigError, match=r"data.columns: renames columns for task 'hf' only, not 'jsonl'"
    ):
        config.from_dict({"data": {"task": "jsonl", "train_file": "x.jsonl", "columns": ["a=b"]}})


def test_a_run_trains_on_hf_rows_with_their_columns(tmp_path, tokenizer):
    from grpo.models.tiny import tiny_model
    from grpo.training.trainer import Trainer

    path = _write(
        tmp_path, "parquet", [{"question": f"{a}+{a}=", "target": str(2 * a)} for a in range(4)]
    )
    seen = []

    def target_reward(completions, target, **kwargs):
        seen.extend(target)
        return [float(t in c) for c, t in zip(completions, target)]

    cfg = config.from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "data": {
                "task": "hf",
                "train_file": str(path),
                "columns": ["question=prompt"],
                "chat_template": "never",
            },
            "rollout": {"num_generations": 2, "max_completion_length": 2},
            "training": {"max_steps": 2, "per_device_train_batch_size": 4},
            "rewards": {"isolation": "thread"},
            "logging": {"sample_every": 0},
        }
    )
    history = Trainer.from_config(
        cfg,
        model=tiny_model(tokenizer, hidden_size=32, num_layers=1),
        tokenizer=tokenizer,
        reward_funcs={"target": target_reward},
    ).train()
    assert [row["step"] for row in history] == [1, 2]
    # the dataset's column, per completion
    assert len(seen) == 8 and set(seen) <= {
        "0",
        "2",
        "4",
        "6",
    }
