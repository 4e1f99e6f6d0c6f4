"""The CPU speed layer is one seam (grpo.cpu.layer): the core trains without it, never importing
grpo.cpu, and with it gives the same metrics to float tolerance; its settings live under cpu:. A
CPU run never loads the CUDA layer (grpo.cuda).

The two runs are examples/tiny.yaml for 20 steps through the CLI, each in a fresh process (the
layer-off one unable to import grpo.cpu at all), started side by side to keep the file fast."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"
STEPS = 20

CORE = [
    "grpo.training.trainer",
    "grpo.training.update",
    "grpo.models.logprobs",
    "grpo.rollout.hf",
    "grpo.backends",
    "grpo.backends.single",
]

RUN = r"""
import importlib, importlib.abc, json, sys

block = sys.argv[1] == "block"
attempts = []


class NoCPULayer(importlib.abc.MetaPathFinder):
    # every import of grpo.cpu or a submodule fails, and is recorded (so that one caught by an
    # `except ImportError` is still seen)
    def find_spec(self, name, path=None, target=None):
        if name == "grpo.cpu" or name.startswith("grpo.cpu."):
            attempts.append(name)
            raise ImportError(f"{name}: the CPU layer is blocked in this process")
        return None


if block:
    sys.meta_path.insert(0, NoCPULayer())
    try:
        import grpo.cpu.layer
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker let grpo.cpu.layer through")
    attempts.clear()
    for name in json.loads(sys.argv[2]):
        importlib.import_module(name)

import torch

torch.set_num_threads(1)  # the same threads in both runs (and the 2 cores are shared)
from grpo.cli import main

code = main(["train", *sys.argv[3:]])
cpu = sorted(m for m in sys.modules if m == "grpo.cpu" or m.startswith("grpo.cpu."))
cuda = sorted(m for m in sys.modules if m == "grpo.cuda" or m.startswith("grpo.cuda."))
print("RESULT " + json.dumps({"code": code, "attempts": attempts, "cpu_modules": cpu, "cuda_modules": cuda}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"off": ..., "on": ...}: each run's exit code, its attempted and loaded grpo.cpu modules, and
    its metrics.jsonl rows; the layer-off run with grpo.cpu blocked, the layer-on one as a user runs."""
    out = tmp_path_factory.mktemp("cpu_layer")
    procs = {}
    for name, block, overrides in (("off", "block", ["cpu.enabled=false"]), ("on", "allow", [])):
        args = [str(TINY), f"output_dir={out / name}", f"training.max_steps={STEPS}", *overrides]
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", RUN, block, json.dumps(CORE), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, (
            f"the {name} run failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
        )
        result = json.loads(lines[-1][len("RESULT ") :])
        metrics = out / name / "metrics.jsonl"
        result["metrics"] = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.exists()
            else []
        )
        result["stderr"] = stderr
        results[name] = result
    return results


def test_the_core_trains_without_ever_importing_grpo_cpu(runs):
    off = runs["off"]
    assert off["code"] == 0, off["stderr"][-3000:]
    assert off["attempts"] == []  # not even an import that failed and was caught
    assert off["cpu_modules"] == []
    assert [row["step"] for row in off["metrics"]] == list(range(1, STEPS + 1))
    # and the layer-on run did go through the layer (else the comparison below would be vacuous)
    assert runs["on"]["code"] == 0, runs["on"]["stderr"][-3000:]
    assert "grpo.cpu.layer" in runs["on"]["cpu_modules"]
    # the CUDA layer is chosen on CUDA alone: a CPU run never loads it, with or without the CPU's
    assert off["cuda_modules"] == [] and runs["on"]["cuda_modules"] == []


# Different but equivalent kernels: with the layer, oneDNN products (where grpo.cpu.kernels picks
# them) instead of MKL's, cache-sized output-layer tiles (another summation order), the fused
# decoding steps and grouped attention instead of transformers' modules. Each differs from the
# other in the last bits of float32, and so do the metrics: relative 1e-4, absolute 1e-6 (the
# rollout/logprob_diff_* fields measure rounding itself, ~1e-7). Measured on a 2-core Intel Xeon
# with AMX: the first 127 steps of tiny.yaml agree to 1e-4 relative; then one sampled token flips
# (its uniform draw lies within rounding of a step of the CDF) and the runs part. 20 steps stay
# well inside that. Timings are not results.
RTOL, ATOL = 1e-4, 1e-6


def _is_timing(key: str) -> bool:
    return key.startswith("time/") or key == "tokens_per_second"


def test_the_layer_changes_no_metric_beyond_float_tolerance(runs):
    off, on = runs["off"]["metrics"], runs["on"]["metrics"]
    assert len(off) == len(on) == STEPS
    for a, b in zip(off, on):
        assert a.keys() == b.keys(), f"step {a['step']}: {sorted(a.keys() ^ b.keys())}"
        for key, value in a.items():
            if _is_timing(key):
                continue
            other = b[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert math.isclose(value, other, rel_tol=RTOL, abs_tol=ATOL), (
                    f"step {a['step']} {key}: {value} without the CPU layer, {other} with it"
                )
            else:
                assert value == other, f"step {a['step']} {key}: {value!r} vs {other!r}"
    assert any(not _is_timing(key) and isinstance(value, float) for key, value in off[-1].items())


def test_a_moved_key_is_refused_on_one_line_naming_its_new_key(tmp_path, capsys):
    from grpo.cli import main

    run = tmp_path / "run"
    assert main(["train", str(TINY), f"output_dir={run}", "training.kernels=eager"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo:"), lines
    assert "training.kernels is now cpu.compile" in lines[0]
    assert not run.exists()  # refused before anything ran
