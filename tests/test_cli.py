import json
from pathlib import Path

import pytest

from grpo import config
from grpo.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny.yaml", "demo.yaml", "seed_arithmetic.yaml", "code_tiny.yaml", "humaneval_eval.yaml", "gsm8k.yaml"])
def test_examples_are_valid_configs(name):
    config.load(ROOT / "examples" / name)


def test_tiny_example_runs_and_writes_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the example names its reward file relative to the repository
    run = tmp_path / "run"
    rc = main(["train", "examples/tiny.yaml", "training.max_steps=3", f"output_dir={run}", "logging.sample_every=2"])
    assert rc == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for key in ["reward", "reward_std", "rewards/first_char_correct/mean", "frac_reward_zero_std", "entropy",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/mean_length", "completions/clipped_ratio",
                "time/step", "tokens_per_second"]:
        assert key in lines[-1], key
    assert (run / "config.yaml").exists() and (run / "final" / "config.json").exists()
    assert [json.loads(l)["step"] for l in (run / "samples.jsonl").read_text().splitlines()][::4] == [1, 2]
    out = capsys.readouterr().out
    assert "3/3" in out and "ETA" in out


def test_report_command(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward": s / 10, "reward_std": 0.1, "entropy": 1.0, "completions/mean_length": 5.0,
                    "completions/clipped_ratio": 0.0, "frac_reward_zero_std": 0.5, "clip_ratio/low_mean": 0.0,
                    "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0, "time/step": 1.0}) + "\n"
        for s in range(1, 6)))
    assert main(["report", str(run)]) == 0
    assert (run / "report.md").exists() and (run / "plots" / "reward.png").exists()
    assert main(["report", str(tmp_path / "missing")]) == 2
