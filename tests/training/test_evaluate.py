"""Held-out evaluation: exact counts on scripted completions, determinism on the tiny model, the table."""

from __future__ import annotations

import json

import pytest
import torch

from grpo.config.errors import ConfigError
from grpo.config.model_data import ModelConfig
from grpo.config.rollout_rewards import RewardsConfig
from grpo.config.schema import Config
from grpo.rewards.reward_set import RewardSet
from grpo.rollout import Rollout, TransformersEngine
from grpo.run import eval_results
from grpo.run.eval_results import EvalResult, format_table
from grpo.tasks.scorers import AnswerScorer, RewardScorer
from grpo.training.evaluate import Evaluator, evaluate


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run far faster on one thread when the cores are shared (no spinning workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(answers):
    return [{"prompt": f"Q{i}=", "answer": a} for i, a in enumerate(answers)]


# --------------------------------------------------------------------------
# Pure scoring
# --------------------------------------------------------------------------


def test_answer_scorer_counts_exactly():
    rows = _rows([127, -5, 1000, 3, 42, 7, 12, 8])
    texts = [
        "28 * 3 = 84\n84 + 43 = 127\nAnswer: 127",  # correct
        "Answer: 2\nno wait\nAnswer: -5",  # several lines: the last wins -> correct
        "Answer: 1,000",  # commas removed -> correct
        "the answer is 3",  # no Answer: line -> unformatted, wrong
        "Answer: 41",  # formatted, wrong
        "Answer: 7\nAnswer: 8",  # last wins -> formatted, wrong
        "Answer:12 apples",  # no space -> correct
        "",  # nothing
    ]
    scores = AnswerScorer().score(rows, texts)
    assert scores.counts == {
        "correct": (4, 8),
        "formatted": (6, 8),
        "correct among formatted": (4, 6),
    }
    assert [d["predicted"] for d in scores.details] == [127, -5, 1000, None, 41, 8, 12, None]


def test_answer_scorer_answer_column_forms():
    rows = [
        {"prompt": "a", "answer": "127"},
        {"prompt": "b", "answer": "-3"},
        {"prompt": "c", "answer": 5.0},
    ]
    scores = AnswerScorer().score(rows, ["Answer: 127", "Answer: -3", "Answer: 6"])
    assert (scores.counts["correct"][0], scores.counts["formatted"][0]) == (2, 3)
    # chat-style completions are read as their text
    chat = [[{"role": "assistant", "content": "Answer: 127"}], "x", "Answer: 5"]
    assert AnswerScorer().score(rows, chat).counts["correct"] == (2, 3)


def test_missing_or_bad_answer_column_is_a_clear_error():
    with pytest.raises(ConfigError, match="no 'answer' column"):
        AnswerScorer().score([{"prompt": "p", "solution": 1}], ["Answer: 1"])
    with pytest.raises(ConfigError, match="'answer' must be an integer"):
        AnswerScorer().check([{"prompt": "p", "answer": "one"}])
    with pytest.raises(ValueError, match="2 completions for 1 rows"):
        AnswerScorer().score(_rows([1]), ["a", "b"])


# --------------------------------------------------------------------------
# evaluate(): a scripted engine (exact wiring) and the tiny model (determinism)
# --------------------------------------------------------------------------


def _kwargs(**over):
    kw = dict(
        scorer=AnswerScorer(),
        temperatures=[0.0, 1.0],
        max_new_tokens=6,
        batch_size=3,
        seed=7,
        use_chat_template=False,
        few_shot=None,
        max_prompt_length=None,
    )
    kw.update(over)
    return kw


def _engine(model, tokenizer):
    # no decoding steps handed in (no backend's CPU layer): transformers' modules
    return TransformersEngine(model, tokenizer, Config(), decoding=None)


class ScriptedEngine:
    """Answers each prompt with a fixed text, as a RolloutEngine."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, 0
        self.eos_token_ids, self.pad_token_id = [tokenizer.eos_token_id], tokenizer.pad_token_id

    def generate(self, prompts, G, params, seeds=None):
        assert G == 1
        self.calls += 1
        texts = [self.script[self.tokenizer.decode(p, skip_special_tokens=True)] for p in prompts]
        ids = [self.tokenizer(t)["input_ids"] + [self.eos_token_ids[0]] for t in texts]
        width = max(len(i) for i in ids)
        comp = torch.full((len(ids), width), self.pad_token_id)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, i in enumerate(ids):
            comp[r, : len(i)] = torch.tensor(i)
            mask[r, : len(i)] = 1
        n = len(prompts)
        return Rollout(
            torch.zeros(n, 1, dtype=torch.long),
            torch.ones(n, 1, dtype=torch.long),
            comp,
            mask,
            torch.zeros(n, dtype=torch.bool),
        )


class Counter:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def test_evaluate_scores_scripted_completions(tokenizer):
    """The engine replaced by a script: the counts, mean reward and samples follow from the texts."""
    rows = _rows([127, -5, 1000, 3, 42])
    script = {
        "Q0=": "Answer: 127",
        "Q1=": "Answer: 1\nAnswer: -5",
        "Q2=": "Answer: 1,000",
        "Q3=": "three",
        "Q4=": "Answer: 41",
    }
    engine, progress = ScriptedEngine(tokenizer, script), Counter()
    results = evaluate(
        engine,
        tokenizer,
        rows,
        label="before",
        step=0,
        progress=progress,
        **_kwargs(temperatures=[0.0]),
    )
    (r,) = results
    assert (r.label, r.step, r.temperature, r.n) == ("before", 0, 0.0, 5)
    assert (r.correct, r.formatted, r.counts["correct among formatted"]) == (3, 4, [3, 4])
    assert r.mean_reward == pytest.approx(3 / 5)
    assert r.clipped_ratio == 0.0
    assert r.samples[0] == {
        "prompt": "Q0=",
        "completion": "Answer: 127",
        "answer": 127,
        "predicted": 127,
        "correct": True,
    }
    assert progress.n == engine.calls == 2  # batches of 3: the progress bar hears of each

    # with a reward set, mean_reward is the weighted total of the configured rewards, and each has its mean
    rewards = RewardSet.from_config(
        RewardsConfig(funcs=["arithmetic_correct", "arithmetic_format"], weights=[1.0, 0.5]),
        16,
        {"answer"},
    )
    (r,) = evaluate(engine, tokenizer, rows, reward_set=rewards, **_kwargs(temperatures=[0.0]))
    assert r.mean_reward == pytest.approx((3 * 1.0 + 4 * 0.5) / 5)
    assert r.rewards == {
        "arithmetic_correct": pytest.approx(0.6),
        "arithmetic_format": pytest.approx(0.8),
    }
    again = EvalResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again == r and again.correct == 3


def test_rows_without_answers_are_scored_by_their_rewards(tokenizer):
    rows = [{"prompt": "Q0=", "topic": "a"}, {"prompt": "Q1=", "topic": "b"}]
    engine = ScriptedEngine(tokenizer, {"Q0=": "short", "Q1=": "a longer answer"})

    def brevity(completions, **kw):
        return [1.0 if len(c) < 10 else 0.0 for c in completions]

    rewards = RewardSet.from_config(RewardsConfig(funcs=[]), 16, {"topic"}, {"brevity": brevity})
    (r,) = evaluate(
        engine,
        tokenizer,
        rows,
        reward_set=rewards,
        **_kwargs(scorer=RewardScorer(), temperatures=[0.0]),
    )
    assert r.counts == {} and r.mean_reward == 0.5 and r.rewards == {"brevity": 0.5}
    assert r.accuracy == 0.5  # the mean reward stands in for accuracy
    table = format_table([r])
    assert _row_cells(table, "greedy")[1:] == ["0.500", "0.500"]
    assert "reward brevity (eval)" in table


def test_evaluate_tiny_model_is_deterministic(model, tokenizer):
    rows = _rows([1, 2, 3, 4, 5])
    model.train()
    engine = _engine(model, tokenizer)
    first = evaluate(engine, tokenizer, rows, **_kwargs())
    second = evaluate(engine, tokenizer, rows, **_kwargs())
    assert model.training  # mode restored
    assert [r.temperature for r in first] == [0.0, 1.0]
    for a, b in zip(first, second):
        assert a.n == len(rows)
        assert a.to_dict() == b.to_dict()
        assert 0 <= a.correct <= a.formatted <= a.n
        assert 0 < a.mean_length <= 6
    # sampled completions are drawn, not greedy: with a random model they differ from greedy somewhere
    greedy = [s["completion"] for s in first[0].samples]
    sampled = [s["completion"] for s in first[1].samples]
    assert greedy != sampled


def test_evaluate_rejects_rows_without_answer_before_generating(tokenizer):
    engine = ScriptedEngine(tokenizer, {})
    with pytest.raises(ConfigError, match="no 'answer' column"):
        evaluate(engine, tokenizer, [{"prompt": "1+1="}], **_kwargs())
    assert engine.calls == 0


def test_evaluator_uses_config(model, tokenizer, tmp_path):
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.eval.num_problems = 3
    cfg.eval.temperatures = [0.0]
    cfg.eval.max_completion_length = 4
    cfg.data.chat_template = "never"
    evaluator = Evaluator(
        cfg, _engine(model, tokenizer), tokenizer, _rows([1, 2, 3, 4, 5]), AnswerScorer()
    )
    assert evaluator.max_new_tokens == 4 and len(evaluator.rows) == 3 and evaluator.num_batches == 1
    before = evaluator("before", 0)
    after = evaluator("after", 10)
    eval_results.append_results(tmp_path / "run" / "eval.jsonl", before + after)
    lines = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(x["label"], x["step"], x["n"]) for x in lines] == [("before", 0, 3), ("after", 10, 3)]
    assert before[0].correct == lines[0]["counts"]["correct"][0] and after[0].n == 3
    assert (
        eval_results.latest(eval_results.read_results(tmp_path / "run" / "eval.jsonl"), "after")[
            0
        ].step
        == 10
    )


def test_eval_jsonl_of_earlier_versions_still_reads():
    old = {
        "label": "before",
        "step": 0,
        "temperature": 0.0,
        "n": 200,
        "correct": 84,
        "formatted": 200,
        "correct_among_formatted": 84,
        "mean_reward": 0.42,
    }
    r = EvalResult.from_dict(old)
    assert r.counts == {
        "correct": [84, 200],
        "formatted": [200, 200],
        "correct among formatted": [84, 200],
    }
    assert r.accuracy == 0.42


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------


def _result(label, step, temperature, correct, formatted, n=200, reward=None):
    counts = {
        "correct": [correct, n],
        "formatted": [formatted, n],
        "correct among formatted": [correct, formatted],
    }
    return EvalResult(
        label, step, temperature, n, counts, correct / n if reward is None else reward
    )


def _row_cells(table: str, decoding: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == decoding:
            return cells
    raise AssertionError(f"no row {decoding!r} in\n{table}")


def test_format_table_before_after_like_the_seed():
    before = [_result("before", 0, 0.0, 8, 8), _result("before", 0, 1.0, 91, 106)]
    after = [_result("after", 300, 0.0, 194, 200), _result("after", 300, 1.0, 191, 199)]
    table = format_table(before, after)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header == [
        "decoding",
        "correct (before)",
        "correct (after)",
        "formatted (before)",
        "formatted (after)",
        "correct among formatted (before)",
        "correct among formatted (after)",
        "mean reward (before)",
        "mean reward (after)",
    ]
    greedy = _row_cells(table, "greedy")
    assert greedy[1].startswith("8/200") and greedy[2].startswith("194/200")
    assert greedy[3].startswith("8/200") and greedy[4].startswith("200/200")
    sampled = _row_cells(table, "temperature 1")
    assert sampled[1:3] == ["91/200 (45.5%)", "191/200 (95.5%)"]
    assert sampled[5].startswith("91/106") and sampled[6].startswith("191/199")
    assert sampled[7:9] == ["0.455", "0.955"]


def test_format_table_before_only():
    table = format_table([_result("before", 0, 0.0, 8, 8), _result("before", 0, 0.7, 0, 0)])
    assert "after" not in table
    assert _row_cells(table, "greedy")[1:] == [
        "8/200 (4.0%)",
        "8/200 (4.0%)",
        "8/8 (100.0%)",
        "0.040",
    ]
    assert _row_cells(table, "temperature 0.7")[3] == "0/0"


# --------------------------------------------------------------------------
# grpo eval / grpo report
# --------------------------------------------------------------------------


def test_cli_eval_before_and_after_checkpoint(tmp_path, capsys):
    import yaml

    from grpo import cli
    from grpo.models.loading import load_model_and_tokenizer
    from grpo.run.checkpoint import save_checkpoint

    run = tmp_path / "run"
    config = {
        "output_dir": str(run),
        "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
        "data": {
            "chat_template": "never",
            "arithmetic": {
                "operands": [[1, 9], [1, 9]],
                "operators": ["+"],
                "instruction": "{expression}=",
                "num_train": 10,
                "num_eval": 4,
            },
        },
        "rollout": {"num_generations": 2, "max_completion_length": 3},
        "training": {"per_device_train_batch_size": 2},
        "eval": {"temperatures": [0.0, 1.0]},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    model, tok = load_model_and_tokenizer(
        ModelConfig(name="tiny", tiny_hidden_size=32, tiny_num_layers=1)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))  # a different model than the base
    save_checkpoint(tmp_path / "ckpt", model, tok, state={"step": 17})

    assert (
        cli.main(["eval", str(path), "eval.num_problems=3", "--checkpoint", str(tmp_path / "ckpt")])
        == 0
    )
    out = capsys.readouterr().out
    assert "| decoding | correct (before) | correct (after) |" in out
    lines = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [(x["label"], x["step"], x["temperature"], x["n"]) for x in lines] == [
        ("before", 0, 0.0, 3),
        ("before", 0, 1.0, 3),
        ("after", 17, 0.0, 3),
        ("after", 17, 1.0, 3),
    ]
    assert (run / "eval_table.md").read_text().startswith("| decoding |")

    assert cli.main(["eval", str(path), "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


def test_cli_report_errors_clearly(tmp_path, capsys):
    from grpo import cli

    assert cli.main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Other wordings (eval.instructions), counted as the seed counts
# --------------------------------------------------------------------------


def _seed_counts(rows, texts):
    """The seed's own definitions: a completion is formatted when it has an `Answer: N` line
    (commas removed), correct when the last N equals the answer."""
    import re

    found = [re.findall(r"Answer:\s*(-?\d+)", t.replace(",", "")) for t in texts]
    formatted = sum(bool(f) for f in found)
    correct = sum(bool(f) and int(f[-1]) == row["answer"] for f, row in zip(found, rows))
    return {
        "correct": [correct, len(rows)],
        "formatted": [formatted, len(rows)],
        "correct among formatted": [correct, formatted],
    }


class Recorder:
    """An engine that hands the prompts to another and keeps what it generated, as texts by prompt."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer, self.texts = engine, tokenizer, []
        self.device, self.eos_token_ids, self.pad_token_id = (
            engine.device,
            engine.eos_token_ids,
            engine.pad_token_id,
        )

    def generate(self, prompts, G, params, seeds=None):
        rollout = self.engine.generate(prompts, G, params, seeds)
        for c, m in zip(rollout.completion_ids, rollout.completion_mask):
            self.texts.append(self.tokenizer.decode(c[m.bool()].tolist(), skip_special_tokens=True))
        return rollout


def _arithmetic_rows(cfg):
    from grpo.tasks.data import arithmetic_splits

    return arithmetic_splits(cfg.data.arithmetic, cfg.data.seed)[1]


def _wording_cfg(tmp_path):
    from grpo.config import loading as config

    return config.from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name": "tiny"},
            "data": {
                "chat_template": "never",
                "arithmetic": {
                    "operands": [[1, 9], [1, 9]],
                    "operators": ["+"],
                    "instruction": "Calculate {expression}.",
                    "num_eval": 6,
                },
            },
            "eval": {
                "temperatures": [0.0, 1.0],
                "max_completion_length": 6,
                "batch_size": 4,
                "instructions": ["What is {expression}? End with Answer: N."],
            },
        }
    )


def test_each_wording_of_the_tiny_models_evaluation_is_counted_as_the_seed_counts(
    model, tokenizer, tmp_path
):
    cfg = _wording_cfg(tmp_path)
    rows = _arithmetic_rows(cfg)
    recorder = Recorder(_engine(model, tokenizer), tokenizer)
    evaluator = Evaluator(cfg, recorder, tokenizer, rows, AnswerScorer())
    assert evaluator.num_batches == 2 * 2 * 2  # wordings x temperatures x batches of 4 of 6 rows
    results = evaluator("before", 0)
    assert [(r.wording, r.temperature) for r in results] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
    assert [r.decoding for r in results] == [
        "greedy",
        "temperature 1",
        "greedy, wording 2",
        "temperature 1, wording 2",
    ]
    assert results[2].samples[0]["prompt"].startswith("What is ") and results[0].samples[0][
        "prompt"
    ].startswith("Calculate")
    for k, r in enumerate(results):
        assert r.counts == _seed_counts(rows, recorder.texts[6 * k : 6 * (k + 1)])
    table = format_table(results)
    for r in results:
        assert _row_cells(table, r.decoding)[1].startswith(f"{r.correct}/6")


def test_a_wording_gain_is_reported_beside_the_trained_one(tokenizer, tmp_path):
    """Scripted answers that differ by wording (formatted when asked one way only): the table's rows
    carry each wording's own counts, before and after."""
    cfg = _wording_cfg(tmp_path)
    rows = _arithmetic_rows(cfg)
    asked = {}
    for row in rows:
        # messages are rendered as plain text (data.chat_template: never), each content and a newline
        asked[f"Calculate {row['expression']}.\n"] = (
            f"{row['expression']} = {row['answer']}\nAnswer: {row['answer']:,}"
        )
        asked[f"What is {row['expression']}? End with Answer: N.\n"] = f"It is {row['answer']}."
    before = Evaluator(cfg, ScriptedEngine(tokenizer, asked), tokenizer, rows, AnswerScorer())(
        "before", 0
    )
    asked = {k: v.replace("It is", "Answer:") for k, v in asked.items()}
    after = Evaluator(cfg, ScriptedEngine(tokenizer, asked), tokenizer, rows, AnswerScorer())(
        "after", 10
    )
    table = format_table(before, after)
    assert _row_cells(table, "greedy")[1:5] == [
        "6/6 (100.0%)",
        "6/6 (100.0%)",
        "6/6 (100.0%)",
        "6/6 (100.0%)",
    ]
    assert _row_cells(table, "greedy, wording 2")[1:5] == [
        "0/6 (0.0%)",
        "6/6 (100.0%)",
        "0/6 (0.0%)",
        "6/6 (100.0%)",
    ]
    assert [r.setting for r in eval_results.latest(before + after, "after")] == [
        (1, 0.0),
        (1, 1.0),
        (2, 0.0),
        (2, 1.0),
    ]


def test_instructions_are_for_task_arithmetic_and_need_the_expression(tmp_path):
    from grpo.config import loading as config

    with pytest.raises(ConfigError, match=r"eval.instructions\[0\]: must contain \{expression\}"):
        config.from_dict({"eval": {"instructions": ["What is it?"]}})
    with pytest.raises(
        ConfigError, match=r"eval.instructions: rewords task arithmetic's prompts only"
    ):
        config.from_dict(
            {
                "data": {"task": "jsonl", "train_file": "x.jsonl"},
                "eval": {"instructions": ["{expression}"]},
            }
        )
