"""GRPOTrainer's datasets are checked row by row by the check the CLI's JSONL task makes of its
lines (grpo.tasks.data.checked_prompt_row): a dataset without a `prompt` column, or a prompt that
is neither text nor chat messages, is a ConfigError whose message is one line naming the row and
the fix, never a KeyError or a TypeError from deep inside; `grpo train` refuses the same rows in a
JSONL file with the same words, as one `grpo:` line and exit 2."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, IterableDataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.cli import main
from grpo.config.errors import ConfigError
from grpo.trl.rows import config_and_train_rows

TINY = ["model.tiny_hidden_size=32", "model.tiny_num_layers=1", "rewards.isolation=thread"]


def zero(completions, **kwargs):
    return [0.0] * len(completions)


def _args(tmp_path, *overrides):
    return GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=2,
        max_steps=1,
        grpo_overrides=[*TINY, *overrides],
    )


def _refusal(tmp_path, **datasets) -> str:
    """GRPOTrainer's ConfigError for `datasets` (train_dataset=, eval_dataset=): one line."""
    with pytest.raises(ConfigError) as error:
        GRPOTrainer("tiny", zero, args=_args(tmp_path), **datasets)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def _cli_refusal(tmp_path, capsys, rows) -> str:
    """`grpo train` of the jsonl task on `rows`: exit 2 and one `grpo:` line on stderr."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'cli'}\nmodel: {{name: tiny}}\n"
        f"data: {{task: jsonl, train_file: {path}}}\nrewards: {{funcs: [arithmetic_correct]}}\n"
    )
    rc = main(["train", str(config), *TINY])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("grpo: ") and "\n" not in err, (rc, err)
    return err


def test_a_dataset_without_a_prompt_column_is_refused_naming_the_row_and_the_fix(tmp_path, capsys):
    rows = [{"question": "1+1=", "answer": 2}, {"question": "2+2=", "answer": 4}]
    for dataset in (rows, Dataset.from_list(rows)):
        message = _refusal(tmp_path, train_dataset=dataset)
        assert message.startswith(
            "GRPOTrainer: train_dataset, row 0 (counting from 0): no 'prompt' column "
            "(has ['answer', 'question']); "
        ), message
        assert "rename_column(NAME, 'prompt')" in message
    stream = IterableDataset.from_generator(lambda: iter(rows))
    assert _refusal(tmp_path, train_dataset=stream).startswith(
        "GRPOTrainer: train_dataset, row 0 (counting from 0): no 'prompt' column"
    )
    good = [{"prompt": "1+1=", "answer": 2}] * 2
    assert _refusal(tmp_path, train_dataset=good, eval_dataset=rows).startswith(
        "GRPOTrainer: eval_dataset, row 0 (counting from 0): no 'prompt' column"
    )
    cli = _cli_refusal(tmp_path, capsys, rows)
    assert "rows.jsonl:1: no 'prompt' column (has ['answer', 'question'])" in cli, cli


@pytest.mark.parametrize(
    "prompt, said",
    [
        (3, "got int 3"),
        (None, "got null"),
        (
            [{"role": "user", "content": {"text": "1+1="}}],
            "got a list whose message 0 has a content of dict {'text': '1+1='}, not text",
        ),
    ],
)
def test_a_prompt_that_is_neither_text_nor_messages_is_refused_naming_the_row(
    tmp_path, capsys, prompt, said
):
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": prompt, "answer": 2}]
    check = (
        "column 'prompt' must be a string or a list of messages like "
        '[{"role": "user", "content": "..."}], ' + said
    )
    # a datasets.Dataset holds a null among texts, not a number or an object among them
    for dataset in [rows] + ([Dataset.from_list(rows)] if prompt is None else []):
        message = _refusal(tmp_path, train_dataset=dataset)
        assert message == f"GRPOTrainer: train_dataset, row 1 (counting from 0): {check}"
    # the CLI's JSONL task refuses the same row in the same words (the same check)
    assert _cli_refusal(tmp_path, capsys, rows).endswith(f"rows.jsonl:2: {check}")


def test_rows_an_environment_sets_the_task_of_get_trls_default_prompt(tmp_path):
    # with environment_factory, a row may leave the prompt to the environment's reset()
    _, rows = config_and_train_rows(
        _args(tmp_path), [{"level": 1}, {"level": 2, "prompt": "go"}], {}, default_prompt=True
    )
    assert [row["prompt"] for row in rows] == [[{"role": "user", "content": ""}], "go"]
    with pytest.raises(ConfigError, match="row 0 .*: no 'prompt' column"):
        config_and_train_rows(_args(tmp_path), [{"level": 1}], {})
