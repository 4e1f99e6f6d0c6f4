import json
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.config import loading as config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name",
    [
        "tiny.yaml",
        "demo.yaml",
        "arithmetic_few_shot.yaml",
        "seed_arithmetic.yaml",
        "code_tiny.yaml",
        "humaneval_eval.yaml",
        "gsm8k.yaml",
    ],
)
def test_examples_are_valid_configs(name):
    config.load(ROOT / "examples" / name)


def test_tiny_example_runs_and_writes_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the example names its reward file relative to the repository
    run = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/tiny.yaml",
            "training.max_steps=3",
            f"output_dir={run}",
            "logging.sample_every=2",
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for key in [
        "reward",
        "reward_std",
        "rewards/first_char_correct/mean",
        "frac_reward_zero_std",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "time/step",
        "tokens_per_second",
    ]:
        assert key in lines[-1], key
    assert (run / "config.yaml").exists() and (run / "final" / "config.json").exists()
    assert [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()][
        ::4
    ] == [1, 2]
    out = capsys.readouterr().out
    assert "3/3" in out and "ETA" in out
    # the trained model, exported as a plain model directory
    assert main(["export", str(run / "final"), "--out", str(tmp_path / "exported")]) == 0
    assert f"wrote {tmp_path / 'exported'}" in capsys.readouterr().out
    assert (tmp_path / "exported" / "config.json").is_file()


def test_report_command(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "reward": s / 10,
                    "reward_std": 0.1,
                    "entropy": 1.0,
                    "completions/mean_length": 5.0,
                    "completions/clipped_ratio": 0.0,
                    "frac_reward_zero_std": 0.5,
                    "clip_ratio/low_mean": 0.0,
                    "clip_ratio/high_mean": 0.0,
                    "clip_ratio/region_mean": 0.0,
                    "time/step": 1.0,
                }
            )
            + "\n"
            for s in range(1, 6)
        )
    )
    assert main(["report", str(run)]) == 0
    assert (run / "report.md").exists() and (run / "plots" / "reward.png").exists()
    assert main(["report", str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------- help, config show, init, export


def test_train_help_lists_every_section_with_an_example(capsys):
    from grpo.config.docs import SECTIONS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in ("model", "data", "rollout", "rewards", "algorithm", "training", "eval", "logging"):
        assert f"\n  {name} " in out, name
        assert f"e.g. {SECTIONS[name][1]}" in out
    assert "grpo config show" in out


def test_config_show_is_the_resolved_config_with_each_fields_doc(tmp_path, capsys):
    import yaml

    (tmp_path / "run.yaml").write_text(
        "data: {task: gsm8k, train_file: g.jsonl}\nalgorithm: {beta: 0.04}\n"
    )
    assert main(["config", "show", str(tmp_path / "run.yaml"), "training.max_steps=7"]) == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out)
    cfg = config.load(tmp_path / "run.yaml", ["training.max_steps=7"])
    assert shown == cfg.to_dict()
    assert shown["rewards"]["funcs"] == ["math_answer"]  # resolved: the task's own reward
    lines = out.splitlines()
    beta = lines.index("  beta: 0.04")
    assert lines[beta - 1].startswith(
        "  # KL coefficient."
    )  # the field's docstring, right above it
    sandbox = lines.index("  sandbox:")  # nested sections are shown, with their own fields' docs
    assert lines[sandbox + 1].startswith("    # bwrap: namespaces") and lines[
        sandbox + 3
    ].startswith("    isolation: bwrap")


def test_config_show_fails_like_train(tmp_path, capsys):
    assert main(["config", "show", "algorithm.bta=1"]) == 2
    assert (
        "unknown config key 'algorithm.bta'; did you mean 'algorithm.beta'?"
        in capsys.readouterr().err
    )
    assert main(["config", "show", "rollout.num_generations=1"]) == 2
    assert "rollout.num_generations: must be >= 2" in capsys.readouterr().err


def test_init_writes_a_config_that_loads_as_the_defaults(tmp_path, capsys):
    path = tmp_path / "sub" / "grpo.yaml"
    assert main(["init", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    assert config.load(path).to_dict() == config.from_dict({}).to_dict()
    text = path.read_text()
    assert "# Most tokens generated per completion.\n  max_completion_length: 512\n" in text
    before = text
    assert main(["init", str(path)]) == 2  # never over an existing file, unless asked
    assert "already exists" in capsys.readouterr().err and path.read_text() == before
    path.write_text("x")
    assert main(["init", str(path), "--force"]) == 0 and path.read_text() == before


def test_export_parses_its_arguments_and_fails_cleanly(tmp_path, capsys, monkeypatch):
    import sys
    import types

    with pytest.raises(SystemExit):
        main(["export", str(tmp_path)])  # --out is required
    assert "--out" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # the real export refuses a directory that is no checkpoint
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a checkpoint directory" in capsys.readouterr().err
    calls = []
    fake = types.ModuleType("grpo.run.export")
    fake.export_checkpoint = lambda checkpoint, out, merge: (
        calls.append((checkpoint, out, merge)) or out
    )
    monkeypatch.setitem(sys.modules, "grpo.run.export", fake)
    (tmp_path / "final").mkdir()
    assert (
        main(["export", str(tmp_path / "final"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    )
    assert calls == [(tmp_path / "final", tmp_path / "merged", True)]
    assert f"wrote {tmp_path / 'merged'}" in capsys.readouterr().out


def test_warnings_reach_the_console_escaped(tmp_path):
    """A reward function's error, with a terminal's clear-screen sequence in its message, is
    logged as a warning: on the console (Python's last-resort handler, as `grpo train` has no
    other) it shows escaped, never run."""
    import subprocess
    import sys

    (tmp_path / "rewards.py").write_text(
        "def boom(completions, **kwargs):\n    raise ValueError('\\x1b[2J\\u202e cleared')\n"
    )
    cfg = config.from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
            "data": {"chat_template": "never", "arithmetic": {"num_train": 16, "num_eval": 2}},
            "rollout": {"num_generations": 2, "max_completion_length": 2},
            "rewards": {"funcs": [f"{tmp_path / 'rewards.py'}:boom"], "isolation": "thread"},
            "training": {"max_steps": 1, "per_device_train_batch_size": 4},
            "logging": {"sample_every": 0},
        }
    )
    config.save(cfg, tmp_path / "run.yaml")
    done = subprocess.run(
        [sys.executable, "-m", "grpo", "train", str(tmp_path / "run.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "ValueError" in done.stderr, done.stderr[-2000:]  # the warning is there...
    assert "\x1b[2J" not in done.stderr and "\u202e" not in done.stderr  # ...and escaped
    assert "\\x1b[2J\\u202e cleared" in done.stderr
