"""benchmarks/gpu_check.sh's parts: the TRL-style script's grpo side trains a tiny Qwen2.5 shape
for two steps and records them (every completion at full length, a roofline multiple), and the
report prints a side cut at its time limit with what it measured. Timings are never compared."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check_report  # noqa: E402
import trl_style_script  # noqa: E402

TINY = [
    "--shape",
    "qwen-tiny",
    "--prompts",
    "2",
    "--generations",
    "2",
    "--completion-length",
    "4",
    "--batch-size",
    "2",
    "--grad-accum",
    "2",
    "--warmup",
    "1",
    "--steps",
    "1",
]


@pytest.mark.parametrize("lora", [0, 2])
def test_grpo_side_records_its_steps(tmp_path, monkeypatch, device, lora):
    pytest.importorskip("datasets")
    result_file = tmp_path / "result.json"
    argv = ["--trainer", "grpo", *TINY, "--lora", str(lora), "--device", device.type]
    argv += ["--bandwidth", "1e11", "--peak-flops", "1e12", "--limits-label", "test figures"]
    argv += ["--result", str(result_file), "--output-dir", str(tmp_path / "run")]
    # run as a script (__main__), as gpu_check.sh runs it: its reward function then runs in the
    # trainer's threads, where it counts the completion tokens
    monkeypatch.setattr(sys, "argv", [trl_style_script.__file__, *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(trl_style_script.__file__, run_name="__main__")
    assert exit_.value.code == 0
    result = json.loads(result_file.read_text())
    assert len(result["step_s"]) == 2 and result["median_steady_s"] == result["step_s"][1]
    assert result["completion_tokens_per_step"] == result["expected_completion_tokens_per_step"]
    assert result["completion_tokens_per_step"] == 2 * 2 * 4
    assert result["roofline"]["limit_s"] > 0 and result["roofline_multiple"] > 0
    assert (result["adapter_params"] > 0) == bool(lora)
    assert result["peak_gib"] > 0


def test_the_batch_must_be_the_completions_per_step():
    with pytest.raises(SystemExit):
        trl_style_script.parse_args(["--trainer", "grpo", "--prompts", "3", "--generations", "8"])


def test_report_shows_a_cut_side_with_its_steps_and_the_tests(tmp_path):
    (tmp_path / "work-full.txt").write_text("tiny full\n")
    trl = {"step_s": [3.0, 1.0, 2.0], "warmup": 1, "median_steady_s": 1.5, "peak_gib": 1.0}
    grpo = {"step_s": [4.0, 1.0], "warmup": 1, "median_steady_s": 1.0, "peak_gib": 2.0}
    (tmp_path / "full-trl.json").write_text(json.dumps(trl))
    (tmp_path / "full-trl.status").write_text("ok\n")
    (tmp_path / "full-grpo.json").write_text(json.dumps(grpo))
    (tmp_path / "full-grpo.status").write_text("cut at its 90 s limit\n")
    (tmp_path / "tests.tsv").write_text("passed\ta\npassed\tb\nfailed\tc\nerror\td (setup)\n")
    (tmp_path / "tests.txt").write_text("what=suite\nstatus=pytest rc 1\nseconds=12\n")
    text = gpu_check_report.table(tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| tiny full"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "**1.50** [3.00; 1.00, 2.00]"
    assert cells[2] == "**1.00** [4.00; 1.00] (cut at its 90 s limit)"
    assert cells[3] == "0.67" and cells[6:] == ["n/a", "n/a"]
    assert "suite: 2 passed, 1 failed, 1 error; pytest rc 1, 12 s" in text
    assert "  failed c" in text and "  error d (setup)" in text
