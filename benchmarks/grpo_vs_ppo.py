"""GRPO (no value model) against PPO with a critic: the same model, prompts and batch, in one run.

    python benchmarks/grpo_vs_ppo.py                        # Gemma-3-270M, bf16 autocast
    python benchmarks/grpo_vs_ppo.py --model tiny           # seconds, for a quick look
    python benchmarks/grpo_vs_ppo.py --beta 0.04            # both with a KL reference copy

The seeds say PPO needs a value model as large as the policy, trained beside
it, and that GRPO, which needs none, saves about 30-40% of the memory. Here
both run through grpo's one trainer: `grpo` is advantage_estimator grpo, `ppo`
is advantage_estimator gae (a value head on a copy of the policy's trunk, its
own AdamW, the clipped value loss). Everything else is the same: model,
prompts, 4 prompts x 4 completions of exactly max_completion_length tokens,
beta, precision, one optimizer step per batch.

Each side runs in its own child process (this script again, `--side`), so its
peak memory is its own; the sides alternate over `--repeats` pairs. Reported
per side: the parameters held in memory (policy, reference, critic; shared
tensors once), the optimizer state, the steady and peak resident memory of the
training steps, and the step time (median of the measured steps). The peak is
read from the kernel's high-water mark (VmHWM), reset after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import (  # noqa: E402  (the machine and model helpers both benchmarks share)
    BenchmarkError,
    _cpu_model,
    _gb_from_kb,
    _reset_peak_rss,
    _rows,
    _status_kb,
    prepare_model,
)

REPO = Path(__file__).resolve().parent.parent
SIDES = ("grpo", "ppo")
NUM_PROMPTS = 4
NUM_GENERATIONS = 4


def tensors_held(*modules) -> dict[int, int]:
    """data_ptr -> element count of every parameter and buffer of `modules` (a shared tensor once)."""
    held = {}
    for module in modules:
        if module is None:
            continue
        for t in list(module.parameters()) + list(module.buffers()):
            held[t.data_ptr()] = t.numel()
    return held


def optimizer_elements(optimizer) -> int:
    import torch

    return sum(
        v.numel()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def gradient_elements(*modules) -> int:
    seen = {}
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if p.grad is not None:
                seen[p.grad.data_ptr()] = p.grad.numel()
    return sum(seen.values())


def run_side(spec: dict, out_dir: Path) -> dict:
    import torch

    from grpo.config import loading as grpo_config
    from grpo.training.trainer import Trainer

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    W, S = spec["warmup"], spec["steps"]
    cfg = grpo_config.from_dict(
        {
            "output_dir": str(out_dir),
            "model": {"name": spec["model_dir"]},
            "data": {"chat_template": "never"},
            "rollout": {
                "num_generations": NUM_GENERATIONS,
                "max_completion_length": spec["max_completion_length"],
                "ignore_eos": True,
            },
            "rewards": {"funcs": ["arithmetic_correct"]},
            "algorithm": {
                "advantage_estimator": "gae" if spec["side"] == "ppo" else "grpo",
                "beta": spec["beta"],
                "loss_type": "dapo",
            },
            "training": {
                "max_steps": W + S,
                "per_device_train_batch_size": NUM_PROMPTS * NUM_GENERATIONS,
                "learning_rate": 1e-6,
                "bf16": spec["precision"] == "bf16",
                "device": "cpu",
                "microbatch_tokens": spec["microbatch_tokens"],
            },
            "logging": {"sample_every": 0},
        }
    )
    trainer = Trainer.from_config(cfg, train_rows=_rows({"data_seed": 0}))
    reference = trainer.reference.model if trainer.reference.enabled else None
    critic = trainer.critic.model if trainer.critic is not None else None
    times, memory = [], {}
    for index in range(W + S):
        t0 = time.perf_counter()
        batch = trainer.collect_batch()
        trainer.update(batch)
        trainer.state.step += 1
        if index >= W:
            times.append(time.perf_counter() - t0)
        if index == W - 1:
            memory["steady_rss_gb"] = _gb_from_kb(_status_kb("VmRSS"))
            memory["hwm_reset"] = _reset_peak_rss()
    memory["train_peak_rss_gb"] = _gb_from_kb(_status_kb("VmHWM"))
    optimizers = [trainer.state.optimizer] + (
        [trainer.critic.optimizer] if trainer.critic is not None else []
    )
    return {
        "side": spec["side"],
        "parameters_held": sum(tensors_held(trainer.model, reference, critic).values()),
        "policy_parameters": sum(tensors_held(trainer.model).values()),
        "optimizer_elements": sum(optimizer_elements(o) for o in optimizers),
        "gradient_elements": gradient_elements(trainer.model, critic),
        "step_s": times,
        **memory,
    }


def run_child(side: str, spec: dict, workdir: Path, label: str) -> dict:
    spec_path, result_path = workdir / f"spec-{label}.json", workdir / f"result-{label}.json"
    spec_path.write_text(json.dumps({**spec, "side": side}))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        str(spec_path),
        "--result",
        str(result_path),
    ]
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True)
    if proc.returncode != 0 or not result_path.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        raise BenchmarkError(f"the {side} side failed (exit code {proc.returncode}):\n{tail}")
    return json.loads(result_path.read_text())


def summarize(results: list[dict]) -> dict:
    steps = [s for r in results for s in r["step_s"]]
    return {
        "parameters_held_m": results[0]["parameters_held"] / 1e6,
        "optimizer_state_m": results[0]["optimizer_elements"] / 1e6,
        "gradients_m": results[0]["gradient_elements"] / 1e6,
        "steady_rss_gb": statistics.median(r["steady_rss_gb"] for r in results),
        "peak_rss_gb": statistics.median(r["train_peak_rss_gb"] for r in results),
        "step_s": statistics.median(steps),
    }


def print_table(summary: dict, args, command: str) -> None:
    g, p = summary["grpo"], summary["ppo"]
    rows = [
        ("parameters held (M)", "parameters_held_m", 1),
        ("optimizer state (M elements)", "optimizer_state_m", 1),
        ("gradients (M elements)", "gradients_m", 1),
        ("steady RSS between steps (GB)", "steady_rss_gb", 2),
        ("peak RSS in training (GB)", "peak_rss_gb", 2),
        ("step time (s, median)", "step_s", 2),
    ]
    print(f"\n{command}")
    print(
        f"CPU: {_cpu_model()}; model {args.model}, {args.precision}, beta {args.beta}, "
        f"{NUM_PROMPTS} prompts x {NUM_GENERATIONS} completions x {args.max_completion_length} tokens, "
        f"{args.repeats} process pair(s), {args.steps} measured step(s) each\n"
    )
    print("| | GRPO (no critic) | PPO (critic) | GRPO / PPO |")
    print("|---|---|---|---|")
    for name, key, digits in rows:
        ratio = g[key] / p[key] if p[key] else float("nan")
        print(f"| {name} | {g[key]:.{digits}f} | {p[key]:.{digits}f} | {ratio:.2f} |")
    saving = 1 - g["peak_rss_gb"] / p["peak_rss_gb"]
    print(f"\nGRPO's peak memory is {100 * saving:.0f}% below PPO's (the seeds: about 30-40%).")


def parent_main(args) -> int:
    import torch

    threads = args.threads or (1 if args.model == "tiny" else torch.get_num_threads())
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    with tempfile.TemporaryDirectory(prefix="grpo_vs_ppo-") as tmp:
        workdir = Path(tmp)
        model_dir, label = prepare_model(args.model, workdir)
        spec = {
            "model_dir": str(model_dir),
            "max_completion_length": args.max_completion_length,
            "beta": args.beta,
            "precision": args.precision,
            "warmup": args.warmup,
            "steps": args.steps,
            "threads": threads,
            "microbatch_tokens": args.microbatch_tokens,
        }
        results = {side: [] for side in SIDES}
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            for side in order:
                print(f"running {side} ({repeat + 1}/{args.repeats})...", flush=True)
                results[side].append(run_child(side, spec, workdir, f"{side}-{repeat}"))
    summary = {side: summarize(rs) for side, rs in results.items()}
    print_table(summary, args, command)
    out = (
        Path(args.out)
        if args.out
        else REPO / "benchmarks" / "results" / f"grpo_vs_ppo-{label}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"command": command, "cpu": _cpu_model(), "summary": summary, "raw": results}, indent=1
        )
        + "\n"
    )
    print(f"results: {out}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="gemma-3-270m",
        help="gemma-3-270m (embedded), tiny, or a save_pretrained directory",
    )
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument(
        "--beta",
        type=float,
        default=0.0,
        help="KL coefficient on both sides (> 0 adds a reference copy to each)",
    )
    ap.add_argument("--max-completion-length", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--microbatch-tokens", type=int, default=640)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        ap.error("--warmup, --steps and --repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.child:
            spec = json.loads(Path(args.child).read_text())
            with tempfile.TemporaryDirectory(prefix=f"grpo_vs_ppo-{spec['side']}-") as tmp:
                result = run_side(spec, Path(tmp))
            Path(args.result).write_text(json.dumps(result))
            return 0
        return parent_main(args)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
