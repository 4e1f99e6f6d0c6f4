"""benchmarks/vs_trl.py runs end to end on the tiny model (both sides, both precisions).

Only that it runs and reports sane numbers is checked; timings are never
compared in tests (they live in benchmarks/, as ratios).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_vs_trl_tiny(tmp_path):
    out = tmp_path / "vs_trl.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "vs_trl.py"),
        "--model",
        "tiny",
        "--precision",
        "both",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "grpo/TRL" in proc.stdout
    assert "roofline generate s" in proc.stdout and "memory bandwidth" in proc.stdout

    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"fp32", "bf16"}
    for precision, run in result["runs"].items():
        assert run["peak_flops"] > 0 and run["bandwidth"] > 0
        assert run["same_tokens_per_step"], precision  # both sides did the same work
        for side in ("trl", "grpo"):
            s = run["summary"][side]
            assert s["measured_steps"] == 1
            for key in ("step_s", "generate_s", "update_s", "gflops", "peak_gb"):
                assert s[key] > 0, (precision, side, key, s[key])
            # every completion is exactly max_completion_length tokens (EOS ignored on both sides)
            assert s["completion_lengths"] == [run["settings"]["max_completion_length"]]
            expected = "bfloat16" if precision == "bf16" else "float32"
            assert s["compute_dtypes"]["generate"] == [expected]
            assert s["compute_dtypes"]["update"] == [expected]
            # the times at the machine's limits, and the measured times as multiples
            roof = s["roofline"]
            assert roof["generation_dtype"] == expected
            for key in (
                "generate_s",
                "update_s",
                "step_s",
                "generate_multiple",
                "update_multiple",
                "step_multiple",
                "decode_weight_bytes",
                "last_decode_kv_bytes",
            ):
                assert roof[key] > 0, (precision, side, key, roof[key])
            assert roof["step_s"] == pytest.approx(roof["generate_s"] + roof["update_s"])
