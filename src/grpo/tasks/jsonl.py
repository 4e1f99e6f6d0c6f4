"""Rows from JSONL files (data.train_file, data.eval_file)."""

from __future__ import annotations

from grpo.config.schema import Config
from grpo.tasks import Task
from grpo.tasks.data import read_jsonl
from grpo.tasks.scorers import AnswerScorer, RewardScorer, has_integer_answers


def jsonl_task(cfg: Config) -> Task:
    d = cfg.data
    train = read_jsonl(d.train_file, d.prompt_column)
    held_out = read_jsonl(d.eval_file, d.prompt_column) if d.eval_file else []
    scorer = AnswerScorer() if has_integer_answers(held_out) else RewardScorer()
    return Task("jsonl", train, held_out, scorer)
