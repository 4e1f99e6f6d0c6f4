"""The built-in arithmetic task (the seed's experiment)."""

from __future__ import annotations

from grpo.config.schema import Config
from grpo.tasks import Task
from grpo.tasks.data import arithmetic_splits
from grpo.tasks.scorers import AnswerScorer


def arithmetic_task(cfg: Config) -> Task:
    train, held_out = arithmetic_splits(cfg.data.arithmetic, cfg.data.seed)
    return Task("arithmetic", train, held_out, AnswerScorer())
