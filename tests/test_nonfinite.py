"""Non-finite values never reach the weights, the disk or the sampler's index (issue #13)."""

import math
from pathlib import Path

import pytest
import torch

from grpo import algorithm
from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.models.tiny import tiny_model
from grpo.rewards.arithmetic import completion_text
from grpo.rewards.worker import as_rewards
from grpo.rollout import SamplingParams
from grpo.rollout.hf import NonFiniteProbabilities, sample_next_token
from grpo.training.trainer import Trainer
from grpo.training.update import TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]

FAST = {
    "output_dir": "UNSET",
    "model": {"name": "tiny"},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "instruction": "{expression}=",
            "num_train": 64,
            "num_eval": 4,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 2},
    "training": {
        "max_steps": 2,
        "per_device_train_batch_size": 16,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
    },
    "logging": {"log_every": 1000, "sample_every": 0},
    "rewards": {"isolation": "thread"},
}


def parity_reward(completions, **kwargs):
    # about half of a random model's completions score 1: every group has spread, so updates move weights
    return [float(ord((completion_text(c) or "a")[0]) % 2) for c in completions]


def infinite_for_some(completions, **kwargs):
    return [math.inf if i % 3 == 0 else 1.0 * (i % 2) for i in range(len(completions))]


def make(tokenizer, tmp_path, overrides=(), funcs=None):
    cfg = config.from_dict({**FAST, "output_dir": str(tmp_path / "run")}, list(overrides))
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
    return Trainer.from_config(
        cfg, model=model, tokenizer=tokenizer, reward_funcs=funcs or {"parity": parity_reward}
    )


def saved_weights_are_finite(run: Path) -> int:
    """Asserts that every weight file under `run` is finite; returns how many there were."""
    from safetensors.torch import load_file

    files = list(run.rglob("*.safetensors"))
    for f in files:
        for name, tensor in load_file(f).items():
            assert torch.isfinite(tensor).all(), f"{f}: {name}"
    return len(files)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override, key",
    [
        ("training.learning_rate=nan", "training.learning_rate"),
        ("algorithm.beta=.nan", "algorithm.beta"),
        ("rewards.weights=[.nan]", "rewards.weights[0]"),
        ("rollout.temperature=inf", "rollout.temperature"),
        ("eval.temperatures=[0, -.inf]", "eval.temperatures[1]"),
        ("rewards.sandbox.timeout=.inf", "rewards.sandbox.timeout"),
    ],
)
def test_config_rejects_nan_and_inf_by_name(override, key):
    with pytest.raises(ConfigError) as e:
        config.from_dict({}, [override])
    assert str(e.value).startswith(f"{key}: must be a finite number")


def test_max_consecutive_skips_is_checked():
    assert config.from_dict({}).training.max_consecutive_skips == 3
    with pytest.raises(ConfigError, match="training.max_consecutive_skips"):
        config.from_dict({}, ["training.max_consecutive_skips=0"])


# ---------------------------------------------------------------- rewards


def test_inf_and_overflowing_rewards_are_failures_nan_is_missing():
    assert math.isnan(as_rewards([float("nan")], 1)[0]) and math.isnan(as_rewards([None], 1)[0])
    for bad in (math.inf, -math.inf, 1e39):  # 1e39 would become inf as float32
        with pytest.raises(ValueError, match="not a finite float32"):
            as_rewards([1.0, bad], 2)


def test_advantages_stay_finite_for_huge_and_infinite_totals():
    rewards = torch.tensor([3e38, -3e38, 1.0, math.inf, 0.0, 1.0, math.nan, 2.0])
    for scale in ("group", "batch", "none"):
        advantages = algorithm.grpo_advantages(algorithm.AdvantageInputs(rewards, 4, scale))
        assert torch.isfinite(advantages).all(), scale
        assert advantages[3] == 0 and advantages[6] == 0  # inf and NaN: missing


def test_inf_reward_counts_as_an_error_of_its_function(tokenizer, tmp_path):
    trainer = make(
        tokenizer, tmp_path, funcs={"parity": parity_reward, "broken": infinite_for_some}
    )
    history = trainer.train()
    assert [h["rewards/broken/errors"] for h in history] == [1, 1]
    assert history[-1]["rewards/broken/failures"] == 2
    # every reward of its calls missing
    assert all(math.isnan(h["rewards/broken/mean"]) for h in history)
    assert all(math.isfinite(h["loss"]) and h["train/skipped_updates"] == 0 for h in history)
    assert saved_weights_are_finite(tmp_path / "run") >= 1


# ---------------------------------------------------------------- updates


def nan_loss(monkeypatch, when=lambda: True):
    real = algorithm.policy_loss

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan"), stats) if when() else (loss, stats)

    monkeypatch.setattr(algorithm, "policy_loss", poisoned)


def test_nan_loss_skips_the_update_and_changes_nothing(tokenizer, tmp_path, monkeypatch):
    trainer = make(tokenizer, tmp_path, ["training.max_consecutive_skips=5"])
    metrics, _ = trainer.train_step()  # one good step: AdamW has moments to keep
    assert metrics["train/skipped_updates"] == 0
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = [{k: v.clone() for k, v in s.items()} for s in trainer.state.optimizer.state.values()]
    assert moments
    lr = trainer.state.scheduler.get_last_lr()
    nan_loss(monkeypatch)
    metrics, _ = trainer.train_step()
    assert metrics["train/skipped_updates"] == 1 and metrics["train/skipped_updates_total"] == 1
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, weights[n]), n
    after = [dict(s) for s in trainer.state.optimizer.state.values()]
    assert len(after) == len(moments)
    for old, new in zip(moments, after):
        for k in old:
            assert torch.equal(old[k], new[k]), k
    assert trainer.state.scheduler.get_last_lr() == lr
    assert trainer.parts.skips.consecutive == 1


def test_consecutive_skips_stop_the_run_and_only_finite_weights_are_saved(
    tokenizer, tmp_path, monkeypatch, caplog
):
    calls = {"n": 0}

    def after_first_step():
        calls["n"] += 1
        return calls["n"] > 1  # one micro-batch per step here: step 1 is good, every later one NaN

    nan_loss(monkeypatch, after_first_step)
    trainer = make(
        tokenizer, tmp_path, ["training.max_steps=10", "training.max_consecutive_skips=2"]
    )
    good = {}
    real_step = trainer.train_step

    def step_and_remember():
        out = real_step()
        if trainer.state.step == 1:
            good.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        return out

    trainer.train_step = step_and_remember
    with pytest.raises(
        TrainingDiverged,
        match=r"2 optimizer passes in a row.*max_consecutive_skips=2.*"
        r"last good state is saved in .*checkpoint-2",
    ):
        trainer.train()
    assert calls["n"] == 3
    # step 2 was skipped, step 3 failed: checkpoint-2 holds the weights step 1 left
    from grpo.run import checkpoint as ckpt

    assert [c.name for c in ckpt.checkpoints(tmp_path / "run")] == ["checkpoint-2"]
    restored = make(tokenizer, tmp_path / "resumed", [f"output_dir={tmp_path / 'resumed'}"])
    ckpt.load_checkpoint(tmp_path / "run" / "checkpoint-2", trainer.cfg).load_weights(
        restored.model
    )
    for n, p in restored.model.named_parameters():
        assert torch.equal(p, good[n]), n
    assert "update skipped" in caplog.text
    assert not (tmp_path / "run" / "final").exists()
    saved_weights_are_finite(tmp_path / "run")
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_huge_learning_rate_never_writes_non_finite_weights(tokenizer, tmp_path):
    trainer = make(
        tokenizer,
        tmp_path,
        ["training.learning_rate=1e30", "training.max_steps=4", "training.save_steps=1"],
    )
    # step 1 leaves weights of ~1e30 (finite); step 2's forward pass overflows and its sampling stops the run
    with pytest.raises(
        TrainingDiverged, match="generation at step 1: .*lower training.learning_rate"
    ):
        trainer.train()
    assert saved_weights_are_finite(tmp_path / "run") >= 1


def test_save_refuses_non_finite_weights(tokenizer, tmp_path):
    trainer = make(tokenizer, tmp_path)
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("nan")
    with pytest.raises(
        TrainingDiverged, match=r"refusing to write .*model\.norm\.weight holds NaN or inf"
    ):
        trainer.save(tmp_path / "run" / "final")
    assert not (tmp_path / "run" / "final").exists()


def test_a_run_where_every_reward_failed_exits_non_zero_and_says_so(tmp_path, monkeypatch, capsys):
    from grpo.cli import main

    (tmp_path / "rewards.py").write_text(
        "def nothing(completions, **kwargs):\n    return [None] * len(completions)\n"
    )
    monkeypatch.chdir(ROOT)
    rc = main(
        [
            "train",
            "examples/tiny.yaml",
            "training.max_steps=2",
            f"output_dir={tmp_path / 'run'}",
            f"rewards.funcs=[{tmp_path / 'rewards.py'}:nothing]",
            "training.per_device_train_batch_size=16",
            "logging.sample_every=0",
        ]
    )
    assert rc == 4
    assert "no reward was computed in any step" in capsys.readouterr().err
    assert "No reward was computed in any step" in (tmp_path / "run" / "report.md").read_text()


def test_grpo_train_stops_with_an_explanation_and_a_non_zero_exit(tmp_path, monkeypatch, capsys):
    from grpo.cli import main

    monkeypatch.chdir(ROOT)
    nan_loss(monkeypatch)
    rc = main(
        [
            "train",
            "examples/tiny.yaml",
            "training.max_steps=3",
            f"output_dir={tmp_path / 'run'}",
            "training.max_consecutive_skips=1",
            "training.per_device_train_batch_size=16",
            "logging.sample_every=0",
        ]
    )
    assert rc != 0
    assert "training stopped" in capsys.readouterr().err
    saved_weights_are_finite(tmp_path / "run")


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_sampler_refuses_non_finite_scores(temperature, bad):
    logits = torch.zeros(3, 2000)
    logits[1, 7] = bad
    params = SamplingParams(1, temperature=temperature)
    if temperature == 0 and bad == math.inf:  # greedy picks the +inf token: a valid choice
        assert sample_next_token(logits, params)[1] == 7
        return
    with pytest.raises(NonFiniteProbabilities, match="training.learning_rate"):
        sample_next_token(logits, params, torch.Generator().manual_seed(0))
