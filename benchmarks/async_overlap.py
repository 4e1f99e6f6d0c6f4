"""Generation ahead of training against the synchronous step, on a server pinned to one core and
the trainer to another.

    python benchmarks/async_overlap.py                        # examples/tiny.yaml's shapes
    python benchmarks/async_overlap.py --steps 20 --set rollout.max_completion_length=8

`grpo serve examples/tiny.yaml --engine hf` runs under `taskset -c 0` for the whole measurement;
`grpo train examples/tiny.yaml rollout.engine=server` under `taskset -c 1`, one thread each, once
synchronously (rollout.max_staleness 0) and once for each k (1 and 2), each a fresh process of
the same steps. From the synchronous run: generation (time/generate) and the update (the rest
of its step: rewards, reference, advantages, update, the push); from each run its step (the
median of time/step over the measured steps, the first `--warmup` left out). The table gives the
step against the sum of generation and update (what a synchronous step costs) and against the
larger of them (the least an overlapped step can cost). The runs give the same metrics each
time (tests/training/test_ahead.py); only the time is measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny.yaml"
KEY = "benchmark-secret"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRPO_SERVE_API_KEY": KEY}


def _pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


def _train(out: Path, args, k: int, url: str) -> list[dict]:
    command = [*_pinned(1), sys.executable, "-m", "grpo", "train", str(args.config)]
    command += [f"output_dir={out}", f"training.max_steps={args.steps}", "logging.sample_every=0"]
    command += ["eval.before=false", "eval.after=false", "rollout.engine=server"]
    command += [f"rollout.server.url={url}", f"rollout.max_staleness={k}", *args.set]
    done = subprocess.run(
        command, env={**os.environ, **ONE_THREAD}, cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"grpo train failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r][args.warmup :]


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key) or 0.0 for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="an override for both sides")
    args = parser.parse_args()
    server = subprocess.Popen(
        [*_pinned(0), sys.executable, "-m", "grpo", "serve", str(args.config), *args.set]
        + ["--engine", "hf", "--port", "0"],
        env={**os.environ, **ONE_THREAD},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    found = re.search(r"at (http://127\.0\.0\.1:\d+);", server.stdout.readline())
    if not found:
        server.kill()
        raise SystemExit("grpo serve did not start")
    runs: dict[int, list[dict]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in (0, 1, 2):
                runs[k] = _train(Path(tmp) / f"k{k}", args, k, found.group(1))
    finally:
        server.terminate()
        server.wait()
    generate = _median(runs[0], "time/generate")
    update = _median(runs[0], "time/step") - generate
    print(
        f"{args.config.name} {' '.join(args.set)}: {args.steps} steps a run, the first "
        f"{args.warmup} left out; server on core 0, trainer on core 1, one thread each"
    )
    print(f"generation {generate:.4f} s, update {update:.4f} s (the synchronous run's)")
    print("| run | step (s) | / (generation + update) | / max(generation, update) | waited (s) |")
    print("|---|--:|--:|--:|--:|")
    for k, rows in runs.items():
        step = _median(rows, "time/step")
        waited = _median(rows, "time/wait_for_rollout") if k else generate
        name = "synchronous" if k == 0 else f"max_staleness {k}"
        print(
            f"| {name} | {step:.4f} | {step / (generate + update):.2f} | "
            f"{step / max(generate, update):.2f} | {waited:.4f} |"
        )


if __name__ == "__main__":
    main()
