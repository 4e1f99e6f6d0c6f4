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
    from grpo.data import load_rows
    from grpo.evaluate import Evaluator, format_table
    from grpo.rewards import RewardSet
    from grpo.models import generation_token_ids, load_model_and_tokenizer, resolve_device

    cfg = config.load(args.config, args.overrides)
    _quiet_transformers()
    checkpoint = Path(args.checkpoint).expanduser() if args.checkpoint else None
    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        raise ConfigError(
            f"--checkpoint {checkpoint}: not a checkpoint directory (no config.json); pass a directory written "
            f"by the trainer, e.g. {Path(cfg.output_dir) / 'final'}"
        )
    _, rows = load_rows(cfg.data)
    reward_set = (
        RewardSet.from_config(cfg.rewards, cfg.rollout.max_completion_length, set(rows[0]) - {"prompt"}) if rows else None
    )
    device = resolve_device(cfg.training.device)
    model, tokenizer = load_model_and_tokenizer(cfg.model, device)
    eos, pad = generation_token_ids(model, tokenizer)
    evaluator = Evaluator(cfg, tokenizer, eos, pad, rows, reward_set)
    print(f"evaluating {cfg.model.name} on {len(evaluator.rows)} held-out problems", flush=True)
    before = evaluator(model, "before", 0)
    after = None
    if checkpoint is not None:
        del model
        state = checkpoint / "trainer_state.json"
        step = json.loads(state.read_text()).get("step", 0) if state.is_file() else 0
        trained, _ = load_model_and_tokenizer(dataclasses.replace(cfg.model, name=str(checkpoint)), device)
        print(f"evaluating {checkpoint} (step {step})", flush=True)
        after = evaluator(trained, "after", step)
    table = format_table(before, after)
    print(table)
    out = Path(cfg.output_dir)
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
