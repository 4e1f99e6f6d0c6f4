"""What the health tests share: synthetic metric histories for the checks, and scripted tiny runs
(the toy task of tests/conftest.py, 128 completions a step) whose findings are read back."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from grpo.config import loading
from grpo.config.health import HealthConfig
from grpo.health.checks import RunFacts, View
from grpo.models.tiny import tiny_model


@pytest.fixture
def history():
    """history(n, **columns): n step rows (steps 1..n); a column is a number (every step) or a
    function of the step. The healthy defaults: rewards spread in every group, a gradient, a
    mid entropy, no clipping, no skipped update."""

    def build(n: int, **columns):
        base = {
            "reward": 0.5,
            "reward_std": 0.3,
            "frac_reward_zero_std": 0.0,
            "completions/mean_length": 20.0,
            "completions/clipped_ratio": 0.0,
            "rewards/correct/mean": 0.5,
            "rewards/correct/std": 0.4,
            "rewards/correct/failures": 0,
            "rewards/correct/errors": 0,
            "rewards/correct/timeouts": 0,
            "loss": 0.05,
            "grad_norm": 1.0,
            "entropy": 1.0,
            "clip_ratio/region_mean": 0.0,
            "train/skipped_updates": 0,
            "train/skipped_updates_total": 0,
            "learning_rate": 1e-6,
        }
        base.update(columns)
        return [
            {"step": s, **{k: (v(s) if callable(v) else v) for k, v in base.items()}}
            for s in range(1, n + 1)
        ]

    return build


@pytest.fixture
def view_of():
    """view_of(rows, evaluations=(), firing=(), **facts): the View a check reads at the last of
    `rows` (the default thresholds; `limits=` for others), the run's facts from keyword arguments."""

    def build(rows, evaluations=(), firing=(), limits=None, check="", **facts):
        limits = limits or HealthConfig()
        rewards = [(r["step"], r["reward"]) for r in rows if isinstance(r.get("reward"), float)]
        return View(
            rows=rows[-(max(limits.window, limits.patience, limits.clear_after) + 1) :],
            early=rows[: limits.window],
            run=RunFacts(**facts),
            limits=limits,
            rewards=rewards,
            evaluations=list(evaluations),
            check=check,
            firing=frozenset(firing),
        )

    return build


@pytest.fixture
def scripted_run(toy_config, tokenizer, tmp_path, first_char_correct, caplog):
    """scripted_run(overrides=(), reward_funcs=None, prepare=None, steps=30, **trainer_kwargs):
    the toy task on a tiny model (2 layers of 64, seed 0) trained for `steps`, rewarded by
    first_char_correct unless reward_funcs is given; `prepare(model)` changes the model before
    training. Returns the trainer after training; its `console` is the health lines it printed."""

    def run(overrides=(), reward_funcs=None, prepare=None, steps=30, **kwargs):
        from grpo.training.trainer import Trainer

        cfg = loading.from_dict(
            {**copy.deepcopy(toy_config), "output_dir": str(tmp_path / "run")},
            [f"training.max_steps={steps}", *overrides],
        )
        model = tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
        if prepare is not None:
            with torch.no_grad():
                prepare(model)
        trainer = Trainer.from_config(
            cfg,
            model=model,
            tokenizer=tokenizer,
            reward_funcs=reward_funcs or {"correct": first_char_correct},
            **kwargs,
        )
        with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
            trainer.train()
        trainer.console = [
            r.getMessage() for r in caplog.records if r.name == "grpo.health.monitor"
        ]
        return trainer

    return run


@pytest.fixture
def fired():
    """fired(trainer_or_monitor) -> ({check: first step fired} of the warnings and errors,
    {check} of the notes)."""

    def read(source):
        monitor = getattr(source, "health", source)
        problems, notes = {}, set()
        for e in monitor.episodes:
            if e.severity == "note":
                notes.add(e.check)
            else:
                problems.setdefault(e.check, e.fired_at)
        return problems, notes

    return read
