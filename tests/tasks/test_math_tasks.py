"""Tasks gsm8k and math: rows from jsonl and parquet, the gold answers extracted at load
time, the error for a row without one, MathScorer's counts, and `grpo eval`'s table."""

import json
from pathlib import Path

import pytest
import yaml

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.rewards.reward_set import RewardSet
from grpo.tasks import load_task
from grpo.tasks.math_tasks import gsm8k_gold, math_gold
from grpo.tasks.scorers import MathScorer

ROOT = Path(__file__).resolve().parents[2]

GSM8K_ROWS = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = 24 clips.\nIn all 48+24 = 72 clips.\n#### 72",
        "id": 1,
    },
    {
        "question": "A tank holds 1,200 litres and 2 tanks are full. How many litres?",
        "answer": "2 * 1,200 = 2,400\n#### 2,400",
        "id": 2,
    },
    {
        "question": "It was 3 degrees and fell by 8. What is it now?",
        "answer": "3 - 8 = -5\n#### -5",
        "id": 3,
    },
]
MATH_ROWS = [
    {
        "problem": "What is $\\frac{2}{4}$ in lowest terms?",
        "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
    },
    {
        "problem": "Simplify $\\sqrt{x^{2}}$ for $x>0$ and square it.",
        "solution": "First \\boxed{x} is wrong; squaring gives \\boxed{x^{2}}.",
        "level": "Level 2",
    },
    {"problem": "Solve $x+3=0$.", "solution": "So $x = \\boxed{-3}$", "level": "Level 1"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def task_config(task: str, train: Path, held_out: Path | None = None, *overrides: str):
    data = {"task": task, "train_file": str(train)}
    if held_out is not None:
        data["eval_file"] = str(held_out)
    return config.from_dict({"data": data}, list(overrides))


# --------------------------------------------------------------------------
# Gold answers
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("48/2 = 24\n#### 72", "72"),
        ("#### 1,000", "1000"),  # commas removed
        ("3 - 8\n#### -5", "-5"),
        ("#### 3/4\n", "3/4"),
        ("#### 2.5.", "2.5"),
        ("a #### 1 line, then\n#### 2", "2"),  # the last one
        ("no final line", None),
        ("####  \n", None),
        (None, None),
    ],
)
def test_gsm8k_gold(answer, expected):
    assert gsm8k_gold(answer) == expected


@pytest.mark.parametrize(
    "solution, expected",
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{\\frac{a}{b_{1}}}}", "\\sqrt{\\frac{a}{b_{1}}}"),  # nested braces
        ("first \\boxed{1} then \\boxed{-2}", "-2"),  # the last box
        ("\\boxed{1,000}", "1,000"),  # kept as written: math_answer reads 1,000 = 1000
        ("\\fbox{7}", "7"),
        ("\\boxed{}", None),
        ("unclosed \\boxed{3", None),
        ("no box: 5", None),
    ],
)
def test_math_gold(solution, expected):
    assert math_gold(solution) == expected


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def test_gsm8k_rows_from_jsonl_and_parquet(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    held_out = write_parquet(tmp_path / "test.parquet", GSM8K_ROWS[:2])
    cfg = task_config("gsm8k", train, held_out)
    task = load_task(cfg)
    assert task.name == "gsm8k" and isinstance(task.scorer, MathScorer)
    assert [r["answer"] for r in task.train_rows] == ["72", "2400", "-5"]
    assert [r["answer"] for r in task.eval_rows] == ["72", "2400"]
    row = task.train_rows[0]
    assert row["id"] == 1 and row["solution"] == GSM8K_ROWS[0]["answer"]  # other columns kept
    assert row["prompt"] == [
        {
            "role": "user",
            "content": cfg.data.instruction.replace("{question}", GSM8K_ROWS[0]["question"]),
        }
    ]
    assert "\\boxed{}" in row["prompt"][0]["content"]  # the default asks for a boxed answer


def test_math_rows_from_parquet_and_jsonl(tmp_path):
    train = write_parquet(tmp_path / "train.parquet", MATH_ROWS)
    held_out = write_jsonl(tmp_path / "test.jsonl", MATH_ROWS[2:])
    instruction = "Problem: {question}\nAnswer in \\boxed{}."
    task = load_task(
        config.from_dict(
            {
                "data": {
                    "task": "math",
                    "train_file": str(train),
                    "eval_file": str(held_out),
                    "instruction": instruction,
                }
            }
        )
    )
    assert [r["answer"] for r in task.train_rows] == ["\\frac{1}{2}", "x^{2}", "-3"]
    assert [r["answer"] for r in task.eval_rows] == ["-3"]
    assert (
        task.train_rows[1]["level"] == "Level 2"
        and task.train_rows[1]["solution"] == MATH_ROWS[1]["solution"]
    )
    assert (
        task.train_rows[2]["prompt"][0]["content"]
        == "Problem: Solve $x+3=0$.\nAnswer in \\boxed{}."
    )


def test_row_without_gold_answer_fails_at_load_time(tmp_path):
    rows = [GSM8K_ROWS[0], {"question": "How many?", "answer": "It is 4."}]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(
        ConfigError,
        match=r"data.train_file: .*train.jsonl, row 2: no final answer in 'answer'.*'#### <number>'",
    ):
        load_task(task_config("gsm8k", train))
    bad = write_parquet(
        tmp_path / "bad.parquet",
        [MATH_ROWS[0], MATH_ROWS[1], {"problem": "?", "solution": "It is 4.", "level": ""}],
    )
    with pytest.raises(ConfigError, match=r"data.eval_file: .*bad.parquet, row 3: .*\\boxed"):
        load_task(task_config("math", write_jsonl(tmp_path / "m.jsonl", MATH_ROWS), bad))
    with pytest.raises(ConfigError, match=r"row 1: no 'problem' text"):
        load_task(task_config("math", train))  # GSM8K rows given to the math task


def test_bad_sources_and_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.train_file: .*nope.jsonl does not exist"):
        load_task(task_config("gsm8k", tmp_path / "nope.jsonl"))
    (tmp_path / "rows.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match="not a .jsonl, .json or .parquet file"):
        load_task(task_config("gsm8k", tmp_path / "rows.csv"))
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match="data.train_file: cannot load"):
        load_task(task_config("gsm8k", tmp_path / "broken.jsonl"))
    with pytest.raises(ConfigError, match="data.train_file: task 'math' needs"):
        config.from_dict({"data": {"task": "math"}})
    with pytest.raises(ConfigError, match=r"data.instruction: must contain \{question\}"):
        config.from_dict(
            {"data": {"task": "gsm8k", "train_file": "x.jsonl", "instruction": "Solve it."}}
        )


def test_hub_dataset_names(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, subset=None, split=None, **kwargs):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = config.from_dict(
        {
            "data": {
                "task": "gsm8k",
                "train_file": "openai/gsm8k:main",
                "eval_file": "openai/gsm8k:main:test[:2]",
            }
        }
    )
    task = load_task(cfg)
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test[:2]")]
    assert len(task.train_rows) == 3


def test_math_answer_is_the_default_reward_of_these_tasks(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    cfg = task_config("gsm8k", train)
    assert cfg.rewards.funcs == ["math_answer"]
    assert task_config("math", train).rewards.funcs == ["math_answer"]
    assert task_config("gsm8k", train, None, "rewards.funcs=[think_format]").rewards.funcs == [
        "think_format"
    ]
    assert config.from_dict({}).rewards.funcs == ["arithmetic_correct"]  # the arithmetic task's own
    rows = load_task(cfg).train_rows
    rewards = RewardSet.from_config(cfg.rewards, 16, set(rows[0]) - {"prompt"})
    completions = [
        [{"role": "assistant", "content": t}] for t in ["so \\boxed{72}", "#### 2,400", "Answer: 5"]
    ]
    scores = rewards.score([r["prompt"] for r in rows], completions, [[1]] * 3, rows)
    assert scores[:, 0].tolist() == [1.0, 1.0, 0.0]


# --------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------


def test_math_scorer_counts():
    scorer = MathScorer(timeout=10.0)
    try:
        rows = [{"answer": a} for a in ["72", "\\frac{1}{2}", "1000", "5", "-3"]]
        texts = [
            "... #### 72",
            "so \\boxed{0.5}.",
            "Answer: 1,000",
            "I think it is five",
            "\\boxed{3}",
        ]
        scores = scorer.score(rows, texts)
        assert scores.counts == {"correct": (3, 5), "answered": (4, 5)}
        assert [d["predicted"] for d in scores.details] == ["72", "0.5", "1,000", None, "3"]
        assert [d["correct"] for d in scores.details] == [True, True, True, False, False]
        assert [(d["correct"]) for d in scores.details] == [
            s == 1.0 for s in scorer.reward(texts, [r["answer"] for r in rows])
        ]
        with pytest.raises(ConfigError, match="held-out row 1: no gold 'answer'"):
            scorer.check([{"answer": "1"}, {"question": "?"}])
    finally:
        scorer.close()


def test_grpo_eval_prints_the_math_counts(tmp_path, capsys):
    """The example config, on a small generated GSM8K file with the tiny model."""
    from grpo import cli

    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    run = tmp_path / "run"
    overrides = [
        f"output_dir={run}",
        f"data.train_file={train}",
        f"data.eval_file={train}",
        "model.name=tiny",
        "model.tiny_hidden_size=32",
        "model.tiny_num_layers=1",
        "data.chat_template=never",
        "rollout.max_completion_length=4",
        "eval.max_completion_length=4",
        "eval.temperatures=[0.0]",
        "eval.batch_size=2",
        "training.device=cpu",
        "training.bf16=false",
    ]
    assert cli.main(["eval", str(ROOT / "examples" / "gsm8k.yaml"), *overrides]) == 0
    out = capsys.readouterr().out
    assert "| decoding | correct (before) | answered (before) | mean reward (before) |" in out
    (result,) = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert result["n"] == 3 and set(result["counts"]) == {"correct", "answered"}
    assert set(result["rewards"]) == {"math_answer"}
    assert yaml.safe_load((ROOT / "examples" / "gsm8k.yaml").read_text())["data"]["task"] == "gsm8k"
