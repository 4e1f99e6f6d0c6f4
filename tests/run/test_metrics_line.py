"""metrics.jsonl stays JSON: a step's NaN or inf (a reward no completion got, a ratio that
overflowed) is written as null, a missing number, never as the bare NaN or Infinity that JSON
does not have; health/update_to_weight is left out where the learning rate over
health.weight_scale overflows."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from grpo.config import loading
from grpo.health.monitor import HealthMonitor
from grpo.run import runlog


def _strict(line: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_nan_and_inf_are_written_as_null(tmp_path, monkeypatch):
    monkeypatch.setattr(runlog.RunLog, "report", lambda self: None)
    cfg = loading.from_dict({"output_dir": str(tmp_path / "run")})
    log = runlog.RunLog(cfg)
    log.start()
    # the console line: not what is read here
    log.progress = SimpleNamespace(update=lambda step, metrics: None, close=lambda: None)
    log.step(
        {"step": 1, "reward": math.nan, "reward_std": 0.0, "health/update_to_weight": math.inf}
    )
    log.step({"step": 2, "reward": 1.0, "reward_std": 0.5, "kl": -math.inf})
    log.close()
    rows = [_strict(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "reward": None, "reward_std": 0.0, "health/update_to_weight": None},
        {"step": 2, "reward": 1.0, "reward_std": 0.5, "kl": None},
    ]


def test_a_learning_rate_whose_ratio_overflows_logs_no_ratio():
    monitor = HealthMonitor(loading.from_dict({}, ["health.weight_scale=1e-6"]))
    assert (
        monitor.observe({"step": 1, "learning_rate": 1e-4})["health/update_to_weight"]
        == 1e-4 / 1e-6
    )
    assert "health/update_to_weight" not in monitor.observe({"step": 2, "learning_rate": 1e303})
