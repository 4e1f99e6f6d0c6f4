"""benchmarks/cuda_decoding.py's dry run on the CPU: both ways decode the same number of tokens
and the graphs' side (here the fixed-shape loop run eagerly) equals its eager twin. Timings are
recorded, never compared."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_dry_run_records_both_ways(tmp_path):
    out = tmp_path / "decoding.json"
    args = ["--device", "cpu", "--shape", "qwen-tiny", "--prompts", "2", "--generations", "2"]
    args += ["--prompt-length", "8", "--completion-length", "6", "--repeats", "1"]
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "cuda_decoding.py"),
            *args,
            "--result",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["graphs_equal_their_eager_twin"] and result["fallback"] is None
    assert not result["graphs_captured"]  # no CUDA graph on the CPU
    for way in ("eager", "graphs"):
        assert result[way]["median_s"] > 0 and result[way]["tokens_per_s"] > 0
    assert 0 <= result["share_of_eager_tokens_before_first_difference"] <= 1
