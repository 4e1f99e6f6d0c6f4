"""`grpo train | eval | report | doctor | export | config show | init | serve`."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from pathlib import Path

from grpo.config.errors import ConfigError
from grpo.config.safe_yaml import escaped

USER_FILE_ERRORS = {
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.ENAMETOOLONG,
    errno.ELOOP,
}
"""An OSError with one of these numbers is about a path the user chose or its disk: one line, exit 2."""

LATEST = "latest"
"""`--resume` with no path: output_dir's latest checkpoint."""


class _EscapedRecords(logging.Filter):
    """The console's log lines (warnings) escaped as `say` escapes: a reward's error message, a
    tool's name, a column a dataset named are in them."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = escaped(record.getMessage()), None
        return True


def _escape_log_lines() -> None:
    """On the handler Python prints warnings with when none is configured (the command line's
    case), once per process."""
    handler = logging.lastResort
    if handler is not None and not any(isinstance(f, _EscapedRecords) for f in handler.filters):
        handler.addFilter(_EscapedRecords())


def say(*parts, file=None, **kwargs) -> None:
    """print() for everything the command line writes: each part escaped (names, paths and values
    a user wrote are in its messages, and a terminal would run their control sequences)."""
    print(*(escaped(str(part)) for part in parts), file=file or sys.stdout, **kwargs)


def _before_torch(cfg) -> None:
    """What must happen before torch allocates: huge pages for the CPU layer's tensors."""
    from grpo.backends.device_layer import before_torch_allocates

    before_torch_allocates(cfg)


def _quiet_transformers() -> None:
    """Our own progress line is the one to read; drop transformers' per-shard bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _resume_from(value: str, cfg) -> "Path | None":
    """The checkpoint `--resume [PATH]` names: output_dir's latest (or PATH's, a run directory),
    or PATH itself; None when output_dir has none yet (the run starts from step 0)."""
    from pathlib import Path

    from grpo.run import checkpoint

    if value == LATEST:
        found = checkpoint.latest_checkpoint(Path(cfg.output_dir))
        if found is None:
            say(
                f"grpo: --resume: no checkpoint in {cfg.output_dir} yet; starting from step 0",
                file=sys.stderr,
            )
        return found
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(
            f"--resume {path}: does not exist; pass a checkpoint directory (e.g. "
            f"{Path(cfg.output_dir) / 'checkpoint-100'}) or give --resume alone for output_dir's latest"
        )
    return checkpoint.latest_checkpoint(path) if checkpoint.checkpoints(path) else path


def _train(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    from grpo.config import loading as config

    if args.resume is not None and "=" in args.resume and not Path(args.resume).exists():
        # `--resume key=value`: an override, not the path to resume from
        args.overrides.append(args.resume)
        args.resume = LATEST
    cfg = config.load(args.config, args.overrides)
    _before_torch(cfg)
    _quiet_transformers()
    from grpo.rollout.server_http import ServerError
    from grpo.run.checkpoint import SaveFailed
    from grpo.run.stop_signals import Interrupted
    from grpo.training.trainer import Trainer
    from grpo.training.update import TrainingDiverged

    resume = _resume_from(args.resume, cfg) if args.resume is not None else None
    again = " ".join([_launcher(), str(args.config), *args.overrides, "--resume"])
    try:
        trainer = Trainer.from_config(cfg, resume=resume)
        trainer.train()
    except SaveFailed as e:  # the disk refused a write; earlier checkpoints are intact
        say(f"grpo: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:  # non-finite updates or weights: a clean stop, with the reason
        say(f"grpo: training stopped: {e}\nrun directory: {cfg.output_dir}", file=sys.stderr)
        return 3
    except ServerError as e:  # the generation server is gone or stalled (rollout.engine: server)
        say(
            f"grpo: training stopped: {e}; the latest checkpoint in {cfg.output_dir} (if any) is intact; "
            f"continue with: {again}",
            file=sys.stderr,
        )
        return 6
    except Interrupted as stop:
        say(
            f"grpo: stopped at once by a second {signal.Signals(stop.signum).name}; the latest checkpoint "
            f"in {cfg.output_dir} (if any) is intact; continue with: {again}",
            file=sys.stderr,
        )
        return 128 + stop.signum
    except KeyboardInterrupt:  # Ctrl-C during set-up, before training began
        say("grpo: interrupted before training began", file=sys.stderr)
        return 128 + signal.SIGINT
    from grpo.backends import leave_process_group

    leave_process_group()  # under torchrun: the run is over on every rank
    if trainer.stopped_by is not None and not trainer.backend.is_main:
        return 128 + trainer.stopped_by  # rank 0 says what happened
    if trainer.stopped_by is not None:
        saved = (
            f"saved in {trainer.saved}" if trainer.saved else "no step trained, nothing new saved"
        )
        say(
            f"grpo: stopped by {signal.Signals(trainer.stopped_by).name} at step {trainer.state.step}, {saved}; "
            f"continue with: {again}",
            file=sys.stderr,
        )
        return 128 + trainer.stopped_by
    # a check of health.fail_on fired: the loop stopped after that step, saved
    stopped = trainer.health.stopped
    if stopped is not None:
        if trainer.backend.is_main:
            say(
                f"grpo: stopped by the health check {stopped.check} at step {stopped.step} (health.fail_on): "
                f"{stopped.message}; checkpoint-{stopped.step}/ and final/ are saved in {cfg.output_dir}; the "
                f"diagnosis: grpo doctor {cfg.output_dir}",
                file=sys.stderr,
            )
        return 5
    if trainer.trained_steps and not trainer.rewarded_steps:
        say(
            f"grpo: no reward was computed in any step (every reward call failed or returned None), so nothing "
            f"was learned; see rewards/<name>/errors in {cfg.output_dir}/metrics.jsonl and the first failure's "
            "traceback above",
            file=sys.stderr,
        )
        return 4
    if trainer.backend.is_main:
        say(f"run directory: {cfg.output_dir}")
    return 0


def _launcher() -> str:
    """The command that started this run: `grpo train`, or torchrun's for its processes."""
    import os

    world = os.environ.get("WORLD_SIZE", "1")
    if world == "1":
        return "grpo train"
    local = os.environ.get("LOCAL_WORLD_SIZE", world)
    if local == world:
        return f"torchrun --nproc_per_node {world} -m grpo train"
    return f"torchrun <the same flags on every node, {world} processes in all> -m grpo train"


def _eval(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from grpo.backends import create_backend
    from grpo.config import loading as config
    from grpo.models.loading import context_length, load_model_and_tokenizer
    from grpo.rewards.reward_set import RewardSet
    from grpo.rollout import create_engine
    from grpo.run import run_writes
    from grpo.run.eval_results import append_results, format_table
    from grpo.run.progress import bar
    from grpo.tasks import load_task
    from grpo.tasks.data import PromptEncoder, check_columns
    from grpo.training.evaluate import Evaluator

    cfg = config.load(args.config, args.overrides)
    _before_torch(cfg)
    _quiet_transformers()
    checkpoint = Path(args.checkpoint).expanduser() if args.checkpoint else None
    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        raise ConfigError(
            f"--checkpoint {checkpoint}: not a checkpoint directory (no config.json); pass a directory written "
            f"by the trainer, e.g. {Path(cfg.output_dir) / 'final'}"
        )
    # a benchmark task (humaneval) is evaluated, never trained on
    task = load_task(cfg, training=False)
    rows = task.eval_rows
    reward_set = (
        RewardSet.from_config(
            cfg.rewards,
            cfg.rollout.max_completion_length,
            check_columns(rows, "held-out rows") - {"prompt"},
        )
        if rows
        else None
    )
    backend = create_backend(cfg)
    out = Path(cfg.output_dir)

    def run(model_cfg, label: str, step: int):
        model, tokenizer = load_model_and_tokenizer(model_cfg, backend.device)
        prompts = PromptEncoder(
            tokenizer,
            cfg.data.chat_template == "auto",
            cfg.data.few_shot,
            cfg.rollout.max_prompt_length,
            cfg.data.chat_template_kwargs,
        )
        length = cfg.eval.max_completion_length or cfg.rollout.max_completion_length
        # before any generation
        prompts.check_fits(rows, length, context_length(model), "held-out rows")
        engine = create_engine(
            cfg.rollout.engine, backend.prepare_model(model), tokenizer, cfg, backend.decoding
        )
        evaluator = Evaluator(cfg, engine, tokenizer, rows, task.scorer, reward_set)
        say(
            f"evaluating {model_cfg.name} (step {step}) on {len(evaluator.rows)} held-out problems",
            flush=True,
        )
        with bar(evaluator.num_batches, f"eval {label}", "batch") as progress:
            results = evaluator(label, step, progress)
        append_results(out / "eval.jsonl", results)
        return results

    before = run(cfg.model, "before", 0)
    after = None
    if checkpoint is not None:
        from grpo.run.checkpoint import manifest_step

        step = manifest_step(checkpoint) or 0
        after = run(dataclasses.replace(cfg.model, name=str(checkpoint)), "after", step)
    table = format_table(before, after)
    say(table)
    out.mkdir(parents=True, exist_ok=True)
    run_writes.replace_file(out, run_writes.EVAL_TABLE, table + "\n")  # never through a link
    say(f"wrote {out / 'eval.jsonl'} and {out / 'eval_table.md'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from grpo.run.report import ReportError, build_report

    try:
        path = build_report(args.run_dir)
    except (ReportError, ImportError) as e:
        say(f"grpo: report: {e}", file=sys.stderr)
        return 2
    say(path)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """The health checks over a run directory (finished or running): what fired, when, the fix.
    Exit 0: no warning or error; 1: one fired; 2: not a run directory."""
    from grpo.run.doctor import diagnose_run
    from grpo.run.run_files import RunFileError, exists
    from grpo.run.run_lock import is_a_run

    path = Path(args.run_dir).expanduser()
    fix = "pass the output_dir of a `grpo train` run (it holds metrics.jsonl)"
    if not path.is_dir():
        say(f"grpo: doctor: {path} is not a directory; {fix}", file=sys.stderr)
        return 2
    if not (is_a_run(path) or exists(path / "metrics.jsonl")):  # one that is a link: read, refused
        say(
            f"grpo: doctor: {path} is not a run directory (no metrics.jsonl, run lock or checkpoint); {fix}",
            file=sys.stderr,
        )
        return 2
    for override in args.overrides:
        if not override.startswith("health."):
            raise ConfigError(
                f"grpo doctor: {override!r}: only the health section's thresholds may be changed here "
                "(health.KEY=VALUE, e.g. health.patience=3)"
            )
    try:
        diagnosis = diagnose_run(path, args.overrides)
    except RunFileError as e:
        say(f"grpo: doctor: {e}", file=sys.stderr)
        return 2
    say(diagnosis.text())
    return 1 if diagnosis.problems else 0


def _config_show(args: argparse.Namespace) -> int:
    from grpo.config import loading as config
    from grpo.config.docs import commented_yaml

    path, overrides = _config_and_overrides(args.words)
    cfg = config.load(path, overrides)  # validated as `grpo train` would: the same errors
    source = f"{path}" if path else "the defaults"
    header = f"grpo config, resolved from {source}" + (
        f" with {' '.join(overrides)}" if overrides else ""
    )
    say(commented_yaml(cfg, header), end="")
    return 0


def _config_and_overrides(words: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first word is the config file unless it is an override."""
    if words and "=" not in words[0]:
        return words[0], list(words[1:])
    return None, list(words)


def _init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grpo.config import loading as config
    from grpo.config.docs import commented_yaml

    path = Path(args.path)
    if path.exists() and not args.force:
        raise ConfigError(
            f"grpo init: {path} already exists; choose another path, or pass --force to overwrite it"
        )
    header = (
        "A grpo run: every key at its default, its meaning above it. Change what you need (delete\n"
        f"the rest if you like: a missing key takes its default), then run `grpo train {path}`;\n"
        "`grpo config show " + str(path) + " key=value ...` prints the resolved result."
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commented_yaml(config.from_dict({}), header))
    say(f"wrote {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    checkpoint = Path(args.checkpoint).expanduser()
    if not checkpoint.is_dir():
        raise ConfigError(
            f"grpo export: {checkpoint} is not a directory; pass a checkpoint directory written by "
            "the trainer (e.g. runs/grpo/final)"
        )
    try:
        from grpo.run.export import export_checkpoint
    except ImportError as error:
        say(f"grpo: export: not available in this installation ({error})", file=sys.stderr)
        return 2
    written = export_checkpoint(checkpoint, Path(args.out).expanduser(), args.merge)
    say(f"wrote {written if written is not None else args.out}")
    return 0


def _train_help() -> str:
    from grpo.config.docs import SECTIONS

    width = max(map(len, SECTIONS))
    lines = ["config sections (set any key as section.key=value after CONFIG):"]
    for name, (what, example) in SECTIONS.items():
        lines.append(f"  {name:<{width}}  {what}")
        lines.append(f"  {'':<{width}}    e.g. {example}")
    lines += [
        "",
        "`grpo config show CONFIG [overrides]` prints every key with its meaning and resolved value;",
        "`grpo init PATH` writes a starter config with every key at its default.",
    ]
    return "\n".join(lines)


def _serve(args: argparse.Namespace) -> int:
    from grpo.serve import command

    key = command.api_key(args.api_key)
    cfg = command.config_of(args.model, args.overrides)
    _before_torch(cfg)
    _quiet_transformers()
    options = {name: getattr(args, name) for name in command.VLLM_OPTIONS}
    return command.run(
        cfg, args.engine, args.host, args.port, key, say, options, args.vllm_arguments
    )


def main(argv: list[str] | None = None) -> int:
    _escape_log_lines()
    parser = argparse.ArgumentParser(
        prog="grpo", description="GRPO training from verifiable rewards"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a model with GRPO",
        epilog=_train_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", help="YAML config file (see examples/)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.max_steps=50")
    train.add_argument(
        "--resume",
        nargs="?",
        const=LATEST,
        metavar="PATH",
        help="continue a run exactly: from output_dir's latest checkpoint, or from PATH (a checkpoint "
        "or run directory). Exit codes: 0 done, 2 config error, 3 diverged, 4 no reward computed, 5 stopped "
        "by health.fail_on, 6 the generation server stopped (rollout.engine: server), 130 SIGINT, 143 SIGTERM",
    )
    train.set_defaults(run=_train)
    ev = sub.add_parser(
        "eval", help="evaluate a model (and a trained checkpoint) on the held-out problems"
    )
    ev.add_argument("config", help="YAML config file (the run's config.yaml or one from examples/)")
    ev.add_argument("overrides", nargs="*", help="section.key=value, e.g. eval.num_problems=50")
    ev.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a checkpoint directory written by the trainer, evaluated as 'after'",
    )
    ev.set_defaults(run=_eval)
    report = sub.add_parser("report", help="plots and a markdown report of a run directory")
    report.add_argument("run_dir", help="the run's output_dir (holds metrics.jsonl)")
    report.set_defaults(run=_report)
    doctor = sub.add_parser(
        "doctor",
        help="why a run is (not) learning: the health checks over a run directory (docs/health.md)",
        description="The health checks replayed over a finished or running run's metrics.jsonl, "
        "eval.jsonl and config: each check that fired, its steps, evidence and fix. Exit 0: no "
        "warning or error; 1: one fired; 2: not a run directory.",
    )
    doctor.add_argument("run_dir", help="the run's output_dir (holds metrics.jsonl)")
    doctor.add_argument(
        "overrides",
        nargs="*",
        help="health.KEY=VALUE thresholds to judge with, e.g. health.patience=3",
    )
    doctor.set_defaults(run=_doctor)
    export = sub.add_parser(
        "export", help="a checkpoint as a model directory: the merged model or the LoRA adapter"
    )
    export.add_argument(
        "checkpoint", help="a checkpoint directory written by the trainer (e.g. runs/grpo/final)"
    )
    export.add_argument(
        "--out", required=True, metavar="DIR", help="where to write the exported model"
    )
    export.add_argument(
        "--merge", action="store_true", help="merge a LoRA adapter into the base model's weights"
    )
    export.set_defaults(run=_export)
    conf = sub.add_parser("config", help="show the resolved config, each key with its meaning")
    conf_sub = conf.add_subparsers(dest="config_command", required=True)
    show = conf_sub.add_parser(
        "show", help="print the resolved config (validated as train does) as commented YAML"
    )
    show.add_argument(
        "words",
        nargs="*",
        metavar="[CONFIG] [section.key=value ...]",
        help="a YAML config file (none: the defaults), then overrides",
    )
    show.set_defaults(run=_config_show)
    init = sub.add_parser(
        "init", help="write a starter config: every key at its default, its meaning above it"
    )
    init.add_argument(
        "path", nargs="?", default="grpo.yaml", help="the file to write (default: grpo.yaml)"
    )
    init.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    init.set_defaults(run=_init)
    serve = sub.add_parser(
        "serve",
        help="a generation server for rollout.engine: server (docs/scaling.md)",
        description="Serves a model for trainers with rollout.engine: server: prompts in, completions "
        "out, weights streamed in after each step. Every endpoint but /health and /version takes the "
        "shared secret "
        "(GRPO_SERVE_API_KEY, or --api-key).",
    )
    serve.add_argument(
        "model", help="a grpo config file (its model section is served) or what model.name takes"
    )
    serve.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.bf16=false")
    serve.add_argument(
        "--engine",
        default="hf",
        help="hf: grpo's own engine (CPUs, any model grpo loads); vllm: vLLM's own server, weight "
        "transfer on (NCCL on CUDA, gloo on CPUs); options after -- go to vLLM's server",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port", type=int, default=8000, help="the port (default 8000; 0: a free one)"
    )
    serve.add_argument(
        "--api-key", help="the shared secret (better: the environment variable GRPO_SERVE_API_KEY)"
    )
    vllm_help = "(--engine vllm) vLLM's option of the same name"
    serve.add_argument("--tensor-parallel-size", type=int, help=vllm_help)
    serve.add_argument("--data-parallel-size", type=int, help=vllm_help)
    serve.add_argument("--gpu-memory-utilization", type=float, help=vllm_help)
    serve.add_argument("--max-model-len", type=int, help=vllm_help)
    serve.add_argument("--dtype", help=vllm_help)
    serve.set_defaults(run=_serve, vllm_arguments=[])
    # `grpo serve ... -- OPTIONS`: what follows -- is vLLM's server's, passed on as it is
    argv = list(sys.argv[1:] if argv is None else argv)
    passed_on: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:
        cut = argv.index("--")
        argv, passed_on = argv[:cut], argv[cut + 1 :]
    # overrides may come after an option too (`grpo eval CFG --checkpoint DIR key=val`): argparse's
    # intermixed parsing does not work with subcommands, so the key=value words it leaves are taken here
    args, extra = parser.parse_known_args(argv)
    if passed_on:
        args.vllm_arguments = passed_on
    if extra:
        if args.command not in ("train", "eval", "serve") or any(
            x.startswith("-") or "=" not in x for x in extra
        ):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.run(args)
    except ConfigError as e:
        say(f"grpo: config error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in USER_FILE_ERRORS:
            raise  # not about a path the user chose: a bug, shown whole
        where = f"{e.filename}: " if e.filename else ""
        say(
            f"grpo: {where}{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}); check the paths in the "
            "config and the command line, the directory's permissions and the free space",
            file=sys.stderr,
        )
        return 2
    finally:
        if "torch.distributed" in sys.modules:  # under torchrun: leave the process group cleanly
            from grpo.backends.distributed import close

            close()


if __name__ == "__main__":
    sys.exit(main())
