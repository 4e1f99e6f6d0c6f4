"""benchmarks/gpu_check.sh's record and table.

As a pytest plugin (`-p gpu_check_report`, with benchmarks/ on PYTHONPATH), it appends each test's
outcome to the file GPU_CHECK_OUTCOMES as it comes (in the controlling process only, under
pytest-xdist), so that a suite cut at its time limit still says how far it got and what failed.

As a script, `python benchmarks/gpu_check_report.py WORKDIR` prints the check's table from what
gpu_check.sh left in WORKDIR: `<work>-<side>.json` (trl_style_script.py's --result, written after
every step), `<work>-<side>.status` (`ok`, `failed rc N`, `timed out after N s`, `skipped: why`),
`work-<work>.txt` (the work's description), `tests.tsv` (this plugin's outcomes) and `tests.txt`
(the command, its status and its seconds).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# ------------------------------------------------------------------ the pytest plugin

_OUT = None


def pytest_configure(config):
    global _OUT
    path = os.environ.get("GPU_CHECK_OUTCOMES")
    if path and not hasattr(config, "workerinput"):  # not in an xdist worker: the controller
        _OUT = open(path, "a", buffering=1)


def _write(outcome: str, nodeid: str) -> None:
    if _OUT is not None:
        _OUT.write(f"{outcome}\t{nodeid}\n")


def pytest_runtest_logreport(report):
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            _write("xfailed" if report.skipped else "xpassed", report.nodeid)
        else:
            _write(report.outcome, report.nodeid)
    elif report.failed:  # setup or teardown
        _write("error", f"{report.nodeid} ({report.when})")
    elif report.when == "setup" and report.skipped:
        _write("xfailed" if xfail else "skipped", report.nodeid)


def pytest_collectreport(report):
    if report.failed:
        _write("error", f"{report.nodeid} (collection)")


# ------------------------------------------------------------------ the table

SIDES = ("trl", "grpo")
WORKS = ("full", "lora")
ORDER = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def _side(work_dir: Path, work: str, side: str) -> tuple[dict | None, str]:
    return (
        _read_json(work_dir / f"{work}-{side}.json"),
        _read(work_dir / f"{work}-{side}.status", "not run"),
    )


def _steps_cell(result: dict | None, status: str) -> str:
    if result is None or not result.get("step_s"):
        return status if status != "ok" else "no steps"
    steps = result["step_s"]
    warm = result.get("warmup", 1)
    median = result.get("median_steady_s")
    listed = "; ".join(
        [", ".join(f"{s:.2f}" for s in steps[:warm]), ", ".join(f"{s:.2f}" for s in steps[warm:])]
    )
    cell = f"**{median:.2f}** [{listed}]" if median is not None else f"[{listed}] no steady step"
    return cell if status == "ok" else f"{cell} ({status})"


def _median(result: dict | None) -> float | None:
    return None if result is None else result.get("median_steady_s")


def _peak(result: dict | None) -> str:
    return "" if result is None or result.get("peak_gib") is None else f"{result['peak_gib']:.1f}"


def _multiple(result: dict | None) -> str:
    if result is None or result.get("roofline_multiple") is None:
        return "n/a"
    return f"{result['roofline_multiple']:.1f} (limit {result['roofline']['limit_s']:.2f} s)"


def _tests_line(work_dir: Path) -> tuple[str, list[str]]:
    meta = dict(
        line.split("=", 1) for line in _read(work_dir / "tests.txt").splitlines() if "=" in line
    )
    counts: dict[str, int] = {}
    failed: list[str] = []
    for line in _read(work_dir / "tests.tsv").splitlines():
        outcome, _, nodeid = line.partition("\t")
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome in ("failed", "error", "xpassed"):
            failed.append(f"{outcome} {nodeid}")
    summary = ", ".join(f"{counts[k]} {k}" for k in ORDER if counts.get(k)) or "no test ran"
    status = meta.get("status", "not run")
    seconds = meta.get("seconds", "?")
    line = f"{meta.get('what', 'test-gpu')}: {summary}; {status}, {seconds} s"
    return line, failed


def table(work_dir: Path) -> str:
    lines = []
    header = [
        "work",
        "TRL 1.16 s/step",
        "grpo s/step",
        "grpo / TRL",
        "TRL peak GiB",
        "grpo peak GiB",
        "TRL roofline x",
        "grpo roofline x",
    ]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    kinds = set()
    limits = set()
    for work in WORKS:
        description = _read(work_dir / f"work-{work}.txt")
        if not description:
            continue
        (trl, trl_status), (grpo, grpo_status) = (_side(work_dir, work, s) for s in SIDES)
        ratio = "n/a"
        if _median(trl) and _median(grpo):
            ratio = f"{_median(grpo) / _median(trl):.2f}"
        for r in (trl, grpo):
            if r:
                kinds.add(r.get("peak_kind"))
                if r.get("limits_label"):
                    limits.add(r["limits_label"])
        row = [
            description,
            _steps_cell(trl, trl_status),
            _steps_cell(grpo, grpo_status),
            ratio,
            _peak(trl),
            _peak(grpo),
            _multiple(trl),
            _multiple(grpo),
        ]
        lines.append("| " + " | ".join(row) + " |")
    tests, failed = _tests_line(work_dir)
    lines.append("")
    lines.append(tests)
    lines.append("")
    lines.append(
        "s/step: **median of the steady steps** [warm-up step; steady steps], each between "
        "consecutive step ends (CUDA synchronized)"
    )
    lines.append(f"peak: {', '.join(sorted(k for k in kinds if k)) or 'n/a'} over the process")
    lines.append(
        "roofline x: median step / (decode: bf16 weights + KV cache read once per token step at "
        "the bandwidth, or its FLOPs at the peak if slower; update: 6 x matmul params x positions "
        "(LoRA: 4 x, + 6 x adapter params x positions) at the bf16 peak); "
        + (f"limits: {'; '.join(sorted(limits))}" if limits else "n/a: no limits for this device")
    )
    if failed:
        lines.append("")
        lines.append(f"Not passed ({len(failed)}):")
        lines.extend(f"  {f}" for f in failed)
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_check_report.py WORKDIR", file=sys.stderr)
        return 2
    print(table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
