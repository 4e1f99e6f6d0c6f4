"""The served `hf` engine's step time against the in-process one, on examples/tiny.yaml.

    python benchmarks/served_step.py                  # 2 pairs of 10-step runs
    python benchmarks/served_step.py --steps 20 --pairs 3

`grpo serve examples/tiny.yaml --engine hf` runs in its own process for the whole measurement;
`grpo train examples/tiny.yaml` runs with the in-process engine and with `rollout.engine: server`
in alternation (ABBA ...), each a fresh process. The table gives, per side, the median over the
measured steps (all but each run's first) of time/step, time/generate and time/sync (the push is
in time/sync: time/weight_sync), and the served/in-process ratio. Both sides give the same
metrics (tests/test_serve.py): only the time differs.
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

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny.yaml"
KEY = "benchmark-secret"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import served  # noqa: E402  (the benchmarks' grpo serve)

PHASES = ("time/step", "time/generate", "time/sync", "time/weight_sync")


def _train(out: Path, steps: int, extra: list[str]) -> list[dict]:
    env = {**os.environ, "GRPO_SERVE_API_KEY": KEY}
    command = [sys.executable, "-m", "grpo", "train", str(CONFIG), f"output_dir={out}"]
    command += [f"training.max_steps={steps}", "logging.sample_every=0", "eval.after=false"]
    done = subprocess.run([*command, *extra], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"grpo train failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r][1:]  # the first step warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    env = {**os.environ, "GRPO_SERVE_API_KEY": KEY}
    rows: dict[str, list[dict]] = {"in-process": [], "served": []}
    with served(CONFIG, [], env) as url, tempfile.TemporaryDirectory() as tmp:
        extra = ["rollout.engine=server", f"rollout.server.url={url}"]
        order = ["in-process", "served", "served", "in-process"] * args.pairs
        for i, side in enumerate(order[: 2 * args.pairs]):
            rows[side] += _train(Path(tmp) / f"{i}", args.steps, extra if side == "served" else [])
    medians = {
        side: {p: statistics.median(r.get(p, 0.0) for r in got) for p in PHASES}
        for side, got in rows.items()
    }
    print(
        f"examples/tiny.yaml, {args.pairs} runs of {args.steps} steps a side (first step left out)"
    )
    print("| | " + " | ".join(PHASES) + " |\n|---|" + "--:|" * len(PHASES))
    for side, m in medians.items():
        print(f"| {side} | " + " | ".join(f"{m[p]:.4f}" for p in PHASES) + " |")
    ratio = medians["served"]["time/step"] / medians["in-process"]["time/step"]
    print(f"served / in-process (time/step): {ratio:.2f}")


if __name__ == "__main__":
    main()
