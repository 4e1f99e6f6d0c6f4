"""Reading a run directory's logs, for the report and `grpo doctor`: what a run wrote is read
back as untrusted input (a directory may come from anywhere), bounded, and refused with a
`RunFileError` naming the file and line.

    read_jsonl(path)         a .jsonl's rows (an unterminated last line, being written, skipped)
    read_metrics(run_dir)    metrics.jsonl, one row per step (a resumed run's repeat keeps its last)
    read_config(run_dir)     the run's config as a dict (config.resolved.yaml first; {} if unreadable)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_LOG_BYTES = 256 * 2**20
"""The largest log file read back: a step's metrics row is a few KB, so a quarter of a GiB is
a hundred thousand steps and more; a larger file is refused before it is read."""


class RunFileError(ValueError):
    """A run directory's file that cannot be read back; the message names it and what to do."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The object rows of a .jsonl. A last line without its newline (a running run's, being
    written) is skipped; any other line that is not JSON is a RunFileError naming it."""
    size = path.stat().st_size
    if size > MAX_LOG_BYTES:
        raise RunFileError(
            f"{path}: {size:,} bytes, more than the {MAX_LOG_BYTES:,} read back; it is not a log "
            "grpo wrote at this size (pass a run's own output_dir)"
        )
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1]:  # unterminated: still being written
        lines = lines[:-1]
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise RunFileError(f"{path}:{number}: not valid JSON ({why})") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per-step metrics sorted by step; a step logged twice (a resumed run) keeps its last record."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RunFileError(
            f"{path} does not exist: the run has logged no step yet (metrics.jsonl is what `grpo train` "
            "writes into its output_dir); pass the run directory (output_dir), not a checkpoint or config path"
        )
    rows = read_jsonl(path)
    if not rows:
        raise RunFileError(
            f"{path} is empty: no training step has been logged yet; run `grpo train` first"
        )
    by_step: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(rows):
        step = row.get("step", i + 1)
        if not _step(step):
            raise RunFileError(
                f"{path}: row {i + 1}'s step is {json.dumps(step)[:40]}, not a step number; "
                "it is not a metrics.jsonl grpo wrote"
            )
        by_step[step] = row
    return [dict(by_step[s], step=s) for s in sorted(by_step)]


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's config as written (config.resolved.yaml: the run's own, beside a config.yaml of
    the user's, grpo.run.runlog), through the bounded YAML reader; {} when absent or unreadable."""
    from grpo.config import safe_yaml
    from grpo.config.errors import ConfigError

    run_dir = Path(run_dir)
    path = run_dir / "config.resolved.yaml"
    if not path.is_file():
        path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        data = safe_yaml.read(path, "run config")
    except ConfigError:
        return {}
    return data if isinstance(data, dict) else {}
