"""Generation ahead of training against the synchronous step, on a server pinned to one core and
the trainer to another.

    python benchmarks/async_overlap.py                        # examples/tiny.yaml's shapes
    python benchmarks/async_overlap.py --steps 20 --set rollout.max_completion_length=8
    python benchmarks/async_overlap.py --config examples/demo.yaml --steps 8 --warmup 2 --rounds 1

`grpo serve examples/tiny.yaml --engine hf` runs under `taskset -c 0` for the whole measurement;
`grpo train examples/tiny.yaml rollout.engine=server` under `taskset -c 1`, one thread each,
synchronously (rollout.max_staleness 0) and for each k (1 and 2), each a fresh process of the
same steps, `--rounds` times in alternating order (0 1 2, 2 1 0, ...: a machine whose speed
drifts moves every variant alike). From the synchronous runs: generation (time/generate) and
the update (the rest of its step: rewards, reference, advantages, update, the push); from every
run its steps (the medians over the measured steps of all its rounds, the first `--warmup` of
each run left out). The table gives the step against the sum of generation and update (what a
synchronous step costs) and against the larger of them (the least an overlapped step can cost),
and each variant's own time/update (the optimizer's phase alone: where completions' lengths
depend on the weights that sampled them, as the demo's do, it differs between the variants).
The runs give the same metrics each time (tests/training/test_ahead.py); only the time is
measured here.
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
from serving import pinned, served  # noqa: E402  (the benchmarks' grpo serve)

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRPO_SERVE_API_KEY": KEY}


def _train(out: Path, args, k: int, url: str) -> list[dict]:
    command = [*pinned(1), sys.executable, "-m", "grpo", "train", str(args.config)]
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="an override for both sides")
    args = parser.parse_args()
    runs: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    env = {**os.environ, **ONE_THREAD}
    with served(args.config, [*args.set, "--engine", "hf"], env, core=0) as url:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(args.rounds):
                for k in (0, 1, 2) if round_ % 2 == 0 else (2, 1, 0):
                    runs[k] += _train(Path(tmp) / f"k{k}-{round_}", args, k, url)
    generate = _median(runs[0], "time/generate")
    update = _median(runs[0], "time/step") - generate
    print(
        f"{args.config.name} {' '.join(args.set)}: {args.rounds} round(s) of {args.steps} steps a "
        f"run, the first {args.warmup} left out; server on core 0, trainer on core 1, one thread each"
    )
    print(f"generation {generate:.4f} s, update {update:.4f} s (the synchronous run's)")
    print(
        "| run | step (s) | / (generation + update) | / max(generation, update) | waited (s) "
        "| time/update (s) |"
    )
    print("|---|--:|--:|--:|--:|--:|")
    for k, rows in runs.items():
        step = _median(rows, "time/step")
        waited = _median(rows, "time/wait_for_rollout") if k else generate
        name = "synchronous" if k == 0 else f"max_staleness {k}"
        print(
            f"| {name} | {step:.4f} | {step / (generate + update):.2f} | "
            f"{step / max(generate, update):.2f} | {waited:.4f} | {_median(rows, 'time/update'):.4f} |"
        )


if __name__ == "__main__":
    main()
