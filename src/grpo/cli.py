"""`grpo train | eval | report`."""

from __future__ import annotations

import argparse
import sys

from grpo.config import ConfigError


def _train(args: argparse.Namespace) -> int:
    from grpo import config

    cfg = config.load(args.config, args.overrides)
    from grpo.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.train()
    print(f"run directory: {cfg.output_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO training from verifiable rewards")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model with GRPO")
    train.add_argument("config", help="YAML config file (see examples/)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.max_steps=50")
    train.set_defaults(run=_train)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"grpo: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
