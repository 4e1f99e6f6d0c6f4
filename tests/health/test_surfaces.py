"""The health section and the checks through each way in: the config (its refusals, `grpo config
show`, `grpo train --help`), `grpo train` stopped by health.fail_on, and TRL's GRPOTrainer,
whose users get the checks without changing their script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo.cli import main
from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.registry import HEALTH_CHECKS

ROOT = Path(__file__).resolve().parents[2]


def test_fail_on_is_checked_against_the_registered_checks():
    assert loading.from_dict(
        {}, ["health.fail_on=[no_learning_signal,kl_runaway]", "algorithm.beta=0.04"]
    ).health.fail_on == [
        "no_learning_signal",
        "kl_runaway",
    ]
    with pytest.raises(ConfigError) as error:
        loading.from_dict({}, ["health.fail_on=[no_learning_signal,no_signal]"])
    message = str(error.value)
    assert message.startswith(
        "health.fail_on[1]: 'no_signal' is not one of no_learning_signal, zero_loss"
    )
    assert "(did you mean 'no_learning_signal'?)" in message
    assert all(name in message for name in HEALTH_CHECKS.names())


@pytest.mark.parametrize(
    "override, key",
    [
        ("health.window=0", "health.window"),
        ("health.patience=100000", "health.patience"),
        ("health.zero_spread_share=1.5", "health.zero_spread_share"),
        ("health.grad_norm_spike_ratio=1", "health.grad_norm_spike_ratio"),
        ("health.kl_max=0", "health.kl_max"),
        ("health.weight_scale=.nan", "health.weight_scale"),
        ("health.fail_on=kl_runaway", "health.fail_on"),
        ("health.threshold=1", "health.threshold"),
    ],
)
def test_a_bad_health_value_is_refused_by_name(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        loading.from_dict({}, [override])


def test_config_show_and_help_document_the_section(capsys):
    assert main(["config", "show", "health.patience=3"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["health"]["patience"] == 3
    lines = out.splitlines()
    section = lines.index("health:")
    assert lines[section - 1].startswith("# health: health checks on every step")
    assert lines[lines.index("  patience: 3") - 1].startswith("  # Steps in a row a condition")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "e.g. health.fail_on=[no_learning_signal]" in capsys.readouterr().out


def test_grpo_train_stopped_by_fail_on_exits_5_with_its_checkpoint(tmp_path, monkeypatch, capsys):
    (tmp_path / "rewards.py").write_text(
        "def half(completions, **kwargs):\n    return [0.5] * len(completions)\n"
    )
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/tiny.yaml",
            f"output_dir={run}",
            f"rewards.funcs=[{tmp_path / 'rewards.py'}:half]",
            "rewards.isolation=thread",
            "training.max_steps=20",
            "training.per_device_train_batch_size=32",
            "logging.sample_every=0",
            "health.fail_on=[no_learning_signal]",
        ]
    )
    assert rc == 5
    err = capsys.readouterr().err
    assert "grpo: stopped by the health check no_learning_signal at step 5 (health.fail_on)" in err
    assert f"grpo doctor {run}" in err and "checkpoint-5" in err
    assert (run / "checkpoint-5").is_dir() and len(
        (run / "metrics.jsonl").read_text().splitlines()
    ) == 5
    assert main(["doctor", str(run)]) == 1


def test_trl_users_get_the_checks_without_changing_their_script(tmp_path, caplog):
    import logging

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.models.tiny import char_tokenizer, tiny_model

    def same_for_all(completions, **kwargs):
        return [1.0] * len(completions)

    tokenizer = char_tokenizer()
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=4,
        max_steps=6,
        learning_rate=1e-4,
        report_to="none",
        grpo_overrides=["rewards.isolation=thread"],
    )
    trainer = GRPOTrainer(
        model=tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0),
        processing_class=tokenizer,
        reward_funcs=same_for_all,
        args=args,
        train_dataset=[
            {"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)
        ],
    )
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if r.name == "grpo.health.monitor"]
    assert any("[warning] no_learning_signal at step 5" in line for line in said), said
    steps = [
        row
        for row in trainer.state.log_history
        if "health/no_learning_signal" in row
        and "train_runtime" not in row  # not the summary's mean
    ]
    assert [row["health/no_learning_signal"] for row in steps] == [0, 0, 0, 0, 1, 1]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["health/no_learning_signal"] == 1.0


def test_a_run_resumes_with_other_health_settings_and_from_before_the_section(scripted_run):
    from grpo.run.checkpoint import config_differences

    now = loading.from_dict({}, ["health.patience=3"]).to_dict()
    before = {
        k: v for k, v in now.items() if k != "health"
    }  # a checkpoint made before health: existed
    assert config_differences(before, now) == []
    trainer = scripted_run(["training.save_steps=2"], steps=2)
    resumed = scripted_run(
        ["training.save_steps=2", "health.fail_on=[no_learning_signal]"],
        steps=4,
        resume=trainer.log.dir / "checkpoint-2",
    )
    assert resumed.state.step == 4
