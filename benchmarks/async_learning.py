"""Does learning hold when generation runs ahead? examples/tiny.yaml trained to its end against
one `grpo serve --engine hf`, synchronously and with rollout.max_staleness 1, 2 and 4 (corrected:
algorithm.rollout_correction auto), and 4 without the correction.

    python benchmarks/async_learning.py                  # the runs docs/async.md reports
    python benchmarks/async_learning.py --steps 100 --seeds 0
    python benchmarks/async_learning.py --seeds 2 3 --only synchronous "max_staleness 4"

For each run: the mean training reward over its last `--tail` steps, and its difference from the
synchronous run of the same seed. The synchronous run is repeated with each of `--seeds`, so the
spread between seeds (what a different seed alone changes) is printed beside the differences.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny.yaml"
KEY = "benchmark-secret"
VARIANTS = {
    "synchronous": ["rollout.max_staleness=0"],
    "max_staleness 1": ["rollout.max_staleness=1"],
    "max_staleness 2": ["rollout.max_staleness=2"],
    "max_staleness 4": ["rollout.max_staleness=4"],
    "max_staleness 4, no correction": [
        "rollout.max_staleness=4",
        "algorithm.rollout_correction=none",
    ],
}


def _train(out: Path, url: str, steps: int, seed: int, overrides: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "grpo", "train", str(CONFIG), f"output_dir={out}"]
    command += [f"training.max_steps={steps}", f"training.seed={seed}", "logging.sample_every=0"]
    command += ["eval.after=false", "rollout.engine=server", f"rollout.server.url={url}"]
    env = {**os.environ, "GRPO_SERVE_API_KEY": KEY}
    done = subprocess.run([*command, *overrides], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"grpo train failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tail", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in args.only}
    if "synchronous" not in variants:
        raise SystemExit("--only: the synchronous run is what the others are compared with")
    server = subprocess.Popen(
        [sys.executable, "-m", "grpo", "serve", str(CONFIG), "--engine", "hf", "--port", "0"],
        env={**os.environ, "GRPO_SERVE_API_KEY": KEY},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    found = re.search(r"at (http://127\.0\.0\.1:\d+);", server.stdout.readline())
    if not found:
        server.kill()
        raise SystemExit("grpo serve did not start")
    final: dict[tuple[str, int], float] = {}
    try:
        # report.md's plots are drawn by a process of their own, which may outlive its run
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            for seed in args.seeds:
                for name, overrides in variants.items():
                    out = Path(tmp) / f"{len(final)}"
                    rows = _train(out, found.group(1), args.steps, seed, overrides)
                    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
                    final[name, seed] = statistics.mean(rewards[-args.tail :])
                    print(f"seed {seed}, {name}: {final[name, seed]:.3f}", flush=True)
    finally:
        server.terminate()
        server.wait()
    sync = [final["synchronous", s] for s in args.seeds]
    print(
        f"\n{CONFIG.name}, {args.steps} steps; mean training reward over the last {args.tail} steps"
    )
    print("| run | " + " | ".join(f"seed {s}" for s in args.seeds) + " | - synchronous |")
    print("|---|" + "--:|" * (len(args.seeds) + 1))
    for name in variants:
        values = [final[name, s] for s in args.seeds]
        diffs = [v - final["synchronous", s] for v, s in zip(values, args.seeds)]
        shown = " | ".join(f"{v:.3f}" for v in values)
        print(f"| {name} | {shown} | {', '.join(f'{d:+.3f}' for d in diffs)} |")
    if len(sync) > 1:
        print(f"spread of the synchronous run between seeds: {max(sync) - min(sync):.3f}")


if __name__ == "__main__":
    main()
