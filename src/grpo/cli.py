"""`grpo train | eval | report`."""

from __future__ import annotations

import argparse
import sys

from grpo.config import ConfigError


def _quiet_transformers() -> None:
    """Our own progress line is the one to read; drop transformers' per-shard bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _train(args: argparse.Namespace) -> int:
    from grpo import config

    cfg = config.load(args.config, args.overrides)
    _quiet_transformers()
    from grpo.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.train()
    print(f"run directory: {cfg.output_dir}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from grpo import config
    from grpo.backends import create_backend
    from grpo.evaluate import Evaluator, append_results, format_table
    from grpo.models import load_model_and_tokenizer
    from grpo.progress import bar
    from grpo.rewards import RewardSet
    from grpo.rollout import create_engine
    from grpo.tasks import load_task

    cfg = config.load(args.config, args.overrides)
    _quiet_transformers()
    checkpoint = Path(args.checkpoint).expanduser() if args.checkpoint else None
    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        raise ConfigError(
            f"--checkpoint {checkpoint}: not a checkpoint directory (no config.json); pass a directory written "
            f"by the trainer, e.g. {Path(cfg.output_dir) / 'final'}"
        )
    task = load_task(cfg, training=False)  # a benchmark task (humaneval) is evaluated, never trained on
    rows = task.eval_rows
    reward_set = (
        RewardSet.from_config(cfg.rewards, cfg.rollout.max_completion_length, set(rows[0]) - {"prompt"}) if rows else None
    )
    backend = create_backend(cfg)
    out = Path(cfg.output_dir)

    def run(model_cfg, label: str, step: int):
        model, tokenizer = load_model_and_tokenizer(model_cfg, backend.device)
        engine = create_engine(cfg.rollout.engine, backend.prepare_model(model), tokenizer, cfg)
        evaluator = Evaluator(cfg, engine, tokenizer, rows, task.scorer, reward_set)
        print(f"evaluating {model_cfg.name} (step {step}) on {len(evaluator.rows)} held-out problems", flush=True)
        with bar(evaluator.num_batches, f"eval {label}", "batch") as progress:
            results = evaluator(label, step, progress)
        append_results(out / "eval.jsonl", results)
        return results

    before = run(cfg.model, "before", 0)
    after = None
    if checkpoint is not None:
        state = checkpoint / "trainer_state.json"
        step = json.loads(state.read_text()).get("step", 0) if state.is_file() else 0
        after = run(dataclasses.replace(cfg.model, name=str(checkpoint)), "after", step)
    table = format_table(before, after)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_table.md").write_text(table + "\n")
    print(f"wrote {out / 'eval.jsonl'} and {out / 'eval_table.md'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from grpo.report import ReportError, build_report

    try:
        path = build_report(args.run_dir)
    except (ReportError, ImportError) as e:
        print(f"grpo: report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO training from verifiable rewards")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model with GRPO")
    train.add_argument("config", help="YAML config file (see examples/)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.max_steps=50")
    train.set_defaults(run=_train)
    ev = sub.add_parser("eval", help="evaluate a model (and a trained checkpoint) on the held-out problems")
    ev.add_argument("config", help="YAML config file (the run's config.yaml or one from examples/)")
    ev.add_argument("overrides", nargs="*", help="section.key=value, e.g. eval.num_problems=50")
    ev.add_argument("--checkpoint", metavar="DIR", help="a checkpoint directory written by the trainer, evaluated as 'after'")
    ev.set_defaults(run=_eval)
    report = sub.add_parser("report", help="plots and a markdown report of a run directory")
    report.add_argument("run_dir", help="the run's output_dir (holds metrics.jsonl)")
    report.set_defaults(run=_report)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"grpo: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
