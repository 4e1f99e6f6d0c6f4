"""Does a change keep training's numbers? The tiny example, in variants that reach each part of
the algorithm, run with this checkout's src and with a reference commit's, on this machine;
every metric but the timings compared step for step, exactly.

    python scripts/same_as_before.py            # against HEAD (uncommitted changes)
    python scripts/same_as_before.py --ref main~3 --only gae,lora

Exact equality is the right test here: both sides run the same operations on the same CPU, so a
refactor that keeps behaviour keeps every bit; a difference names the variant, the step and the
metric. (It says nothing across machines: a CPU with other vector units rounds differently.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> overrides of examples/tiny.yaml; each reaches a part a refactor may move
VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    "dr_grpo_bnpo": ["algorithm.advantage_estimator=dr_grpo", "algorithm.loss_type=bnpo"],
    "rloo_dapo": [
        "algorithm.advantage_estimator=rloo",
        "algorithm.loss_type=dapo",
        "algorithm.mask_truncated_completions=true",
    ],
    "reinforce_pp_batch": [
        "algorithm.advantage_estimator=reinforce_pp",
        "algorithm.scale_rewards=batch",
    ],
    "gae": ["algorithm.advantage_estimator=gae"],
    "gdpo": [
        "algorithm.multi_objective_aggregation=normalize_then_sum",
        "rewards.funcs=[examples/toy_rewards.py:first_char_correct,arithmetic_format]",
    ],
    "kl_iterations_cispo": [
        "algorithm.beta=0.04",
        "algorithm.num_iterations=2",
        "algorithm.policy_loss=cispo",
        "algorithm.loss_type=dr_grpo",
    ],
    "sapo_entropy": ["algorithm.policy_loss=sapo", "algorithm.entropy_coef=0.01"],
    "gspo_ref_sync": [
        "algorithm.importance_sampling_level=sequence",
        "algorithm.beta=0.02",
        "algorithm.ref_sync_steps=3",
    ],
    "dynamic_sampling": ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"],
    "lora": ["model.lora.r=4", "training.learning_rate=0.01"],
    "top_entropy": ["algorithm.top_entropy_quantile=0.5", "algorithm.loss_type=luspo"],
}
COMMON = [
    "training.max_steps=8",
    "training.per_device_train_batch_size=64",
    "logging.sample_every=0",
    "eval.before=false",
    "eval.after=false",
]


def _run(src: Path, name: str, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "grpo", "train", str(ROOT / "examples" / "tiny.yaml")]
    cmd += [*COMMON, *VARIANTS[name], f"output_dir={out}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"{name} with {src} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _differences(before: list[dict], after: list[dict]) -> list[str]:
    if len(before) != len(after):
        return [f"{len(before)} steps before, {len(after)} after"]
    found = []
    for b, a in zip(before, after):
        for key in sorted(set(b) | set(a)):
            # timings differ run to run; the health checks read the metrics and change nothing
            if key.startswith(("time/", "health/")) or key == "tokens_per_second":
                continue
            x, y = b.get(key), a.get(key)
            same = x == y or (
                isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
            )
            if not same:
                found.append(f"step {b.get('step')}: {key}: {x!r} before, {y!r} after")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="HEAD", help="the commit to compare with (default HEAD)")
    parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        ref_tree = Path(tmp) / "ref"
        ref_tree.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.ref, "src"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(ref_tree)], input=archive, check=True)
        for name in names:
            before = _run(ref_tree / "src", name, Path(tmp) / f"{name}-before")
            after = _run(ROOT / "src", name, Path(tmp) / f"{name}-after")
            found = _differences(before, after)
            failed += bool(found)
            print(f"{name}: {'same' if not found else 'DIFFERENT'} ({len(after)} steps)")
            for line in found[:10]:
                print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
