"""What a run costs after its last step, against the cost of writing its bytes once.

    python benchmarks/end_of_run.py                        # Gemma-3-270M (embedded), 1 step
    python benchmarks/end_of_run.py --model tiny --steps 2 # a quick try of the script

The run is `Trainer.from_config(cfg).train()` in a fresh interpreter (a child process), so that the
time to its exit is measured as a user sees it. In that child, at the end of the last step
(the callbacks' on_step_end), the same state the final checkpoint will hold (the policy's
weights as safetensors, `Trainer.state_dict()` with torch.save) is first written once to a
fresh directory and fsynced: the floor, timed in the same process on the same disk, then
deleted (twice, the faster kept). From there the clock runs: the final checkpoint, the evaluation after (when
asked), the report, closing the trackers and reward workers, the interpreter's exit.

Each phase after the last step is timed by wrapping the function that does it (whichever of
them the checked-out grpo has): the checkpoint's write, the separate sha256 pass over its
files, the fsyncs, the report (report.md and the plots, or the plots' detached renderer),
RunLog.close, the reward workers' close. The plots' own time is the time until the last
plots/*.png is written (which, when they are rendered apart, is after the run's exit).

Prints a table and writes the numbers as JSON (--out, default
benchmarks/results/end_of_run-<model>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def config_dict(
    model: str, steps: int, output_dir: Path, eval_after: int, save_steps: int = 0
) -> dict:
    tiny = model == "tiny"
    return {
        "output_dir": str(output_dir),
        "model": {
            "name": model,
            **({"tiny_hidden_size": 64, "tiny_num_layers": 2} if tiny else {}),
        },
        "data": {
            "task": "arithmetic",
            "chat_template": "never",
            "arithmetic": {"num_train": 64, "num_eval": max(eval_after, 4)},
        },
        "rollout": {"num_generations": 2, "max_completion_length": 8},
        "rewards": {"funcs": ["arithmetic_correct", "arithmetic_format"]},
        "training": {
            "max_steps": steps,
            "per_device_train_batch_size": 4,
            "save_steps": save_steps,
        },
        "eval": {"after": eval_after > 0, "temperatures": [0.0], "batch_size": 8},
        "logging": {"log_every": 1, "sample_every": 1},
    }


# ---------------------------------------------------------------- the child: one run


def _timed(owner, name: str, phase: str, phases: dict, clock) -> None:
    """Wraps owner.name (when it exists) so that its seconds add up in phases[phase]."""
    original = getattr(owner, name, None)
    if original is None:
        return

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if clock["last_step_end"] is not None:  # only what comes after the last step
                phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def write_once(trainer, directory: Path) -> dict:
    """The final checkpoint's bytes written once, plainly: safetensors of the weights, torch.save
    of the train state, each file fsynced; its seconds and bytes."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    start = time.perf_counter()
    weights, seen = {}, set()
    for name, tensor in trainer.model.state_dict().items():
        if tensor.data_ptr() not in seen:  # a tied weight once, as save_pretrained writes it
            seen.add(tensor.data_ptr())
            weights[name] = tensor.contiguous()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    torch.save(trainer.state_dict(), directory / "train_state.pt")
    written = time.perf_counter() - start
    size = 0
    for path in directory.iterdir():
        size += path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return {"write_s": written, "write_fsync_s": time.perf_counter() - start, "bytes": size}


def child(args) -> None:
    from grpo.config import loading
    from grpo.run import checkpoint, report, runlog
    from grpo.training import saving
    from grpo.training import trainer as trainer_module

    cfg = loading.from_dict(
        config_dict(args.model, args.steps, args.run_dir, args.eval_after, args.save_steps)
    )
    phases: dict[str, float] = {}
    clock: dict = {"last_step_end": None}
    for owner, name, phase in [
        (saving, "save", "final checkpoint (all)"),
        (checkpoint, "_sha256", "sha256 pass over the files"),  # before hashing as written
        (checkpoint, "_file_digest", "hash pass over the small files"),
        (checkpoint, "_fsync", "fsyncs"),
        (trainer_module.Trainer, "_evaluate_and_log", "evaluation after"),
        (runlog.RunLog, "report", "report (as the run waits for it)"),
        (report, "_render_plots", "plots (in the run's process)"),
        (runlog.RunLog, "close", "RunLog.close (trackers, bars)"),
    ]:
        _timed(owner, name, phase, phases, clock)

    trainer = trainer_module.Trainer.from_config(cfg)
    _timed(trainer.rewards, "close", "reward workers' close", phases, clock)
    floor: dict = {}

    class AtLastStep:
        def on_step_end(self, args_, state, control, **kwargs):
            if trainer.state.step == cfg.training.max_steps:
                # twice, the faster kept: a first write into fresh page cache can take several
                # times as long on a VM, and the checkpoint after it finds the cache warm
                for _ in range(2):
                    once = write_once(trainer, args.reference_dir)
                    shutil.rmtree(args.reference_dir)
                    if not floor or once["write_fsync_s"] < floor["write_fsync_s"]:
                        floor.update(once)
                clock["last_step_end"] = time.time()
                clock["last_step_end_perf"] = time.perf_counter()

    trainer.callbacks.add(AtLastStep())
    trainer.train()
    returned = time.perf_counter() - clock["last_step_end_perf"]
    args.result.write_text(
        json.dumps(
            {
                "last_step_end": clock["last_step_end"],
                "train_returned_s": returned,
                "phases": phases,
                "floor": floor,
            }
        )
    )


# ---------------------------------------------------------------- the parent: the measurement


def measure(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="end_of_run-", dir=args.dir))
    run_dir, result = work / "run", work / "result.json"
    command = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--eval-after",
        str(args.eval_after),
        "--save-steps",
        str(args.save_steps),
        "--run-dir",
        str(run_dir),
        "--reference-dir",
        str(work / "written-once"),
        "--result",
        str(result),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(args.src).resolve())}
    process = subprocess.run(command, env=env, capture_output=not args.verbose, text=True)
    exited = time.time()
    if process.returncode:
        sys.exit(f"the run failed ({process.returncode}):\n{process.stderr or ''}")
    data = json.loads(result.read_text())
    data["exit_s"] = exited - data["last_step_end"]
    # the plots: done when the last PNG is written (a detached renderer may still be at work)
    deadline = time.time() + 120
    while time.time() < deadline and (run_dir / "plots" / ".rendering").exists():
        time.sleep(0.1)
    pngs = list((run_dir / "plots").glob("*.png"))
    data["plots"] = len(pngs)
    data["plots_done_s"] = (
        max(p.stat().st_mtime for p in pngs) - data["last_step_end"] if pngs else None
    )
    final = run_dir / "final"
    data["checkpoint_bytes"] = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return data


def show(data: dict, args) -> None:
    floor = data["floor"]
    print(
        f"\nend of run: {args.model}, {args.steps} step(s); checkpoint {data['checkpoint_bytes'] / 1e9:.2f} GB"
    )
    print(f"{'phase after the last step':45} {'s':>7}")
    for name, seconds in data["phases"].items():
        print(f"  {name:43} {seconds:7.2f}")
    print(f"  {'train() returned':43} {data['train_returned_s']:7.2f}")
    print(f"  {'the process exited':43} {data['exit_s']:7.2f}")
    if data["plots_done_s"] is not None:
        print(
            f"  {'the last plot written (' + str(data['plots']) + ' plots)':43} {data['plots_done_s']:7.2f}"
        )
    print(
        f"the same state written once ({floor['bytes'] / 1e9:.2f} GB): {floor['write_s']:.2f} s, "
        f"with fsync {floor['write_fsync_s']:.2f} s"
    )
    print(f"end of run / write once with fsync: {data['exit_s'] / floor['write_fsync_s']:.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="gemma-3-270m", help="gemma-3-270m (default), tiny, or a model directory"
    )
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument(
        "--eval-after", type=int, default=0, help="held-out problems evaluated after (0: none)"
    )
    parser.add_argument(
        "--save-steps",
        type=int,
        default=0,
        help="training.save_steps (1: the last step writes checkpoint-N too, as most runs' last "
        "step does; 0: final/ only)",
    )
    parser.add_argument(
        "--dir", default=None, help="where the run directory goes (default: the system's temp)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="JSON results (default benchmarks/results/end_of_run-<model>.json)",
    )
    parser.add_argument(
        "--src",
        default=str(ROOT / "src"),
        help="the directory grpo is imported from (default: this checkout's src; another "
        "version's, e.g. from `git archive COMMIT src | tar -x -C /tmp/before`, to compare)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--verbose", action="store_true", help="show the run's own output")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reference-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    data = measure(args)
    show(data, args)
    out = Path(
        args.out or ROOT / "benchmarks" / "results" / f"end_of_run-{Path(args.model).name}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
