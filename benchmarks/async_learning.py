"""Does learning hold when generation runs ahead? examples/tiny.yaml trained against one
`grpo serve --engine hf`, synchronously and with rollout.max_staleness 1, 2 and 4 (corrected:
algorithm.rollout_correction auto), and 4 without the correction (and, with --only, 4 with the
correction masking the tokens past its cap), each with several seeds.

    python benchmarks/async_learning.py                  # the runs docs/async.md reports
    python benchmarks/async_learning.py --steps 100 --seeds 0 1 --only synchronous "max_staleness 2"

For each run, the health checks that fired (`grpo doctor`'s replay of its metrics), and the
mean training reward over the `--tail` steps before each of `--at` (default:
examples/tiny.yaml's own end, step 300, and twice as far, 600; one run gives both: the learning
rate is constant and nothing before a step depends on where the run ends). Per variant and
point: the mean over the seeds, its difference from the synchronous mean, and twice the standard
error of that difference (what the seeds alone move it by, at about 95%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny.yaml"
KEY = "benchmark-secret"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import served  # noqa: E402  (the benchmarks' grpo serve)

VARIANTS = {
    "synchronous": ["rollout.max_staleness=0"],
    "max_staleness 1": ["rollout.max_staleness=1"],
    "max_staleness 2": ["rollout.max_staleness=2"],
    "max_staleness 4": ["rollout.max_staleness=4"],
    "max_staleness 4, no correction": [
        "rollout.max_staleness=4",
        "algorithm.rollout_correction=none",
    ],
    # tokens whose ratio passed the cap dropped rather than weighted by the cap
    "max_staleness 4, token_mask": [
        "rollout.max_staleness=4",
        "algorithm.rollout_correction=token_mask",
    ],
}
DEFAULT_VARIANTS = [name for name in VARIANTS if name != "max_staleness 4, token_mask"]


def _train(out: Path, url: str, steps: int, seed: int, overrides: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "grpo", "train", str(CONFIG), f"output_dir={out}"]
    command += [f"training.max_steps={steps}", f"training.seed={seed}", "logging.sample_every=0"]
    command += ["eval.after=false", "rollout.engine=server", f"rollout.server.url={url}"]
    env = {**os.environ, "GRPO_SERVE_API_KEY": KEY}
    done = subprocess.run([*command, *overrides], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"grpo train failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _fired(out: Path, rows: list[dict]) -> str:
    """The health checks that fired over the run (as `grpo doctor` replays them), or none."""
    from grpo.health.diagnosis import diagnose

    config = yaml.safe_load((out / "config.yaml").read_text())
    fired = sorted({e.check for e in diagnose(rows, config=config).problems})
    return f"health checks fired: {', '.join(fired) or 'none'}"


def _spread(values: list[float]) -> float:
    """The standard error of the mean of `values` (0 for one value)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", type=int, nargs="+", default=[300, 600])
    parser.add_argument("--steps", type=int, default=None, help="default: the last of --at")
    parser.add_argument("--tail", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    args = parser.parse_args()
    steps = args.steps or max(args.at)
    points = [a for a in args.at if a <= steps]
    variants = {name: VARIANTS[name] for name in args.only}
    if "synchronous" not in variants:
        raise SystemExit("--only: the synchronous run is what the others are compared with")
    final: dict[tuple[str, int, int], float] = {}
    env = {**os.environ, "GRPO_SERVE_API_KEY": KEY}
    # report.md's plots are drawn by a process of their own, which may outlive its run
    with (
        served(CONFIG, ["--engine", "hf"], env) as url,
        tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp,
    ):
        for seed in args.seeds:
            for name, overrides in variants.items():
                out = Path(tmp) / f"{len(final)}"
                rows = _train(out, url, steps, seed, overrides)
                reward = {r["step"]: r["reward"] for r in rows if r.get("reward") is not None}
                for at in points:
                    tail = [reward[s] for s in range(at - args.tail + 1, at + 1) if s in reward]
                    final[name, seed, at] = statistics.mean(tail)
                shown = ", ".join(f"{final[name, seed, at]:.3f} at {at}" for at in points)
                print(f"seed {seed}, {name}: {shown}; {_fired(out, rows)}", flush=True)
    print(f"\n{CONFIG.name}; mean training reward over the {args.tail} steps before each point")
    for at in points:
        sync = [final["synchronous", s, at] for s in args.seeds]
        print(f"\nstep {at}, seeds {' '.join(map(str, args.seeds))}")
        print("| run | per seed | mean | - synchronous | 2 x its standard error |")
        print("|---|---|--:|--:|--:|")
        for name in variants:
            values = [final[name, s, at] for s in args.seeds]
            gap = statistics.mean(values) - statistics.mean(sync)
            bound = 2 * (_spread(values) ** 2 + _spread(sync) ** 2) ** 0.5
            shown = " ".join(f"{v:.3f}" for v in values)
            print(
                f"| {name} | {shown} | {statistics.mean(values):.3f} | {gap:+.3f} | {bound:.3f} |"
            )


if __name__ == "__main__":
    main()
