"""`grpo doctor RUN_DIR`: the health checks replayed over a run directory, finished or running.

    diagnosis = diagnose_run("runs/grpo")     # metrics.jsonl, eval.jsonl, the run's config
    print(diagnosis.text())

The files are read by grpo.run.run_files' one bounded reader (regular files only, opened
without blocking, read in time, streamed, numbers range-checked; anything it refuses is a
RunFileError naming the file) and grpo.run.eval_results; the checks are grpo.health's, as the
training loop runs them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

from grpo.health.checks import EvalPoint
from grpo.health.diagnosis import Diagnosis, diagnose
from grpo.health.monitor import one_decoding
from grpo.run.eval_results import EvalResult, read_results
from grpo.run.run_files import exists, read_config, read_metrics


def eval_points(results: Iterable[EvalResult]) -> list[EvalPoint]:
    """The held-out scores the checks read: each result's accuracy (EvalResult.accuracy) under one
    decoding (greedy on the wording trained on, else the first logged; monitor.one_decoding)."""
    found: dict[str, list[EvalPoint]] = {}
    for r in results:
        if not math.isfinite(r.accuracy):  # a task scored by rewards that gave none
            continue
        found.setdefault(r.decoding, []).append(EvalPoint(r.step, float(r.accuracy), r.decoding))
    return one_decoding(found)


def diagnose_run(run_dir: str | Path, overrides: Sequence[str] = ()) -> Diagnosis:
    """The health checks over a run directory's logs (RunFileError when it has logged no step, or
    a file is not one grpo writes). What is held: each step's numbers (read_metrics) and each
    evaluation (read_results); the replay holds none of the rows it consumes."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    evaluations = run_dir / "eval.jsonl"
    points = eval_points(read_results(evaluations)) if exists(evaluations) else []
    return diagnose(metrics, points, read_config(run_dir), overrides, str(run_dir))
