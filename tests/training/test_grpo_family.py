"""The GRPO family through the one trainer: each preset and each advantage estimator learns the
toy task, PPO's critic learns its values, and the engine's sampling logprobs are the update's."""

import math

import pytest
import torch

from grpo.config import loading as config
from grpo.cpu import kernels
from grpo.cpu.fused_decoding import FusedDecoder
from grpo.models.tiny import tiny_model
from grpo.training.trainer import Trainer


def mean(history, key, part):
    rows = history[:10] if part == "first" else history[-10:]
    return sum(h[key] for h in rows) / len(rows)


def learns(make_trainer, tokenizer, tmp_path, overrides, steps=100):
    trainer = make_trainer(tokenizer, tmp_path, [f"training.max_steps={steps}", *overrides])
    history = trainer.train()
    return trainer, history


@pytest.mark.parametrize(
    "preset",
    # dr_grpo's, gspo's and dapo's runs (a few seconds each) are in make test-slow; dapo's
    # dynamic sampling runs in the default suite in tests/backends/test_distributed.py
    [
        "grpo",
        pytest.param("dr_grpo", marks=pytest.mark.slow),
        pytest.param("dapo", marks=pytest.mark.slow),
        pytest.param("gspo", marks=pytest.mark.slow),
    ],
)
def test_each_preset_learns(tokenizer, tmp_path, preset, make_trainer):
    overrides = [f"algorithm.preset={preset}"]
    if preset == "gspo":
        # GSPO's clipping range (3e-4) is sized for its many updates per batch; with one pass the
        # ratio is 1 and the range never binds, so the toy's learning rate works unchanged
        overrides.append("algorithm.num_iterations=1")
    trainer, history = learns(make_trainer, tokenizer, tmp_path, overrides)
    first, last = mean(history, "reward", "first"), mean(history, "reward", "last")
    assert last > first + 0.3, (preset, first, last)
    if preset == "grpo":
        assert "kl" in history[-1] and trainer.reference.enabled
    if preset == "dapo":
        assert "sampling/rounds" in history[-1]


@pytest.mark.parametrize(
    "estimator",
    [
        # learning runs, in make test-slow (suite time): the estimators' values are checked in
        # tests/algorithm/test_advantages.py, and grpo's and dr_grpo's learn as the presets of
        # their names in test_each_preset_learns
        pytest.param("grpo", marks=pytest.mark.slow),
        pytest.param("dr_grpo", marks=pytest.mark.slow),
        pytest.param("rloo", marks=pytest.mark.slow),
        pytest.param("reinforce_pp", marks=pytest.mark.slow),
    ],
)
def test_each_outcome_estimator_learns(tokenizer, tmp_path, estimator, make_trainer):
    _, history = learns(
        make_trainer, tokenizer, tmp_path, [f"algorithm.advantage_estimator={estimator}"]
    )
    first, last = mean(history, "reward", "first"), mean(history, "reward", "last")
    assert last > first + 0.3, (estimator, first, last)


# a learning run, in make test-slow (suite time): the critic's own tests below stay
@pytest.mark.slow
def test_gae_learns(tokenizer, tmp_path, make_trainer):
    """PPO through the `gae` estimator: the policy's reward rises with a learned value baseline."""
    trainer, history = learns(
        make_trainer,
        tokenizer,
        tmp_path,
        ["algorithm.advantage_estimator=gae", "algorithm.critic_learning_rate=1e-3"],
    )
    assert trainer.critic is not None
    first, last = mean(history, "reward", "first"), mean(history, "reward", "last")
    assert last > first + 0.3, (first, last)
    # the critic is a separate trunk: training one leaves the other's parameters alone
    policy = {p.data_ptr() for p in trainer.model.parameters()}
    assert policy.isdisjoint(p.data_ptr() for p in trainer.critic.model.parameters())


def answer_over_ten(completions, answer, **kwargs):
    """A reward that the prompt alone decides: a critic can learn it exactly."""
    return [a / 10 for a in answer]


def test_gae_critic_learns_the_values(tokenizer, tmp_path, make_trainer):
    """With rewards a critic can predict from the prompt, its value loss falls towards 0 and its
    values come to explain the returns."""
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=60",
            "algorithm.advantage_estimator=gae",
            "algorithm.critic_learning_rate=3e-3",
        ],
        reward_funcs={"answer": answer_over_ten},
    )
    history = trainer.train()
    loss_first, loss_last = (
        mean(history, "critic/value_loss", "first"),
        mean(history, "critic/value_loss", "last"),
    )
    assert loss_last < 0.1 * loss_first, (loss_first, loss_last)
    assert mean(history, "critic/explained_variance", "last") > 0.8


def test_gae_resume_restores_the_critic(
    tokenizer, tmp_path, make_trainer, toy_config, first_char_correct
):
    cfg_overrides = [
        "algorithm.advantage_estimator=gae",
        "algorithm.critic_learning_rate=1e-3",
        "training.max_steps=4",
        "training.save_steps=2",
        "training.per_device_train_batch_size=32",
    ]
    full = make_trainer(tokenizer, tmp_path / "a", cfg_overrides)
    full.train()
    cut = make_trainer(tokenizer, tmp_path / "b", [*cfg_overrides, "training.max_steps=2"])
    cut.train()
    cfg = config.from_dict({**toy_config, "output_dir": str(tmp_path / "b" / "run")}, cfg_overrides)
    resumed = Trainer.from_config(
        cfg,
        model=tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0),
        tokenizer=tokenizer,
        reward_funcs={"correct": first_char_correct},
        resume=tmp_path / "b" / "run" / "checkpoint-2",
    )
    resumed.train()
    for a, b in zip(full.critic.model.parameters(), resumed.critic.model.parameters()):
        # exact: the resumed steps compute as the uninterrupted ones
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("decoding", ["plain", "auto"])
def test_sampling_logprobs_are_the_updates(
    decoding, tokenizer, tmp_path, monkeypatch, make_trainer
):
    """In float32, with transformers' decoding steps or the fused ones (auto on the CPU), the
    engine's logprobs equal the update's, so the mismatch metric reads ~0; it is logged every step."""
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=1",
            "rollout.max_completion_length=4",
            f"cpu.decoding={decoding}",
            "training.per_device_train_batch_size=32",
        ],
    )
    # the fused steps are the CPU layer's: on another device (no CPU layer) transformers' decode
    layer = trainer.backend.cpu
    fused = decoding == "auto" and kernels.onednn_available() and layer is not None
    assert layer is None or layer.uses_fused_decoding(trainer.model, torch.float32) == fused
    assert (layer is None) == (trainer.backend.device.type != "cpu")
    built, original = [], FusedDecoder.__init__
    monkeypatch.setattr(
        FusedDecoder, "__init__", lambda self, *a, **kw: built.append(1) or original(self, *a, **kw)
    )
    history = trainer.train()
    # the step's rollout decoded fused, or through transformers
    assert len(built) == (1 if fused else 0)
    m = history[-1]
    assert m["rollout/logprob_diff_mean"] < 1e-5 and m["rollout/logprob_diff_max"] < 1e-4
    assert math.isclose(m["rollout/is_ratio"], 1.0, abs_tol=1e-4)


def test_rollout_correction_metrics_under_bf16(tokenizer, tmp_path, make_trainer):
    """bf16 decoding against the bf16 update: a small, logged mismatch, the weights capped at the cap."""
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=2",
            "rollout.max_completion_length=4",
            "training.bf16=true",
            "algorithm.rollout_correction=token_truncate",
            "training.per_device_train_batch_size=32",
        ],
    )
    history = trainer.train()
    m = history[-1]
    assert 0 <= m["rollout/logprob_diff_mean"] < 0.1
    assert 0 < m["rollout/is_weight"] <= 3.0
    assert 0 <= m["rollout/is_capped_ratio"] <= 1


# learning runs, in make test-slow (suite time): both losses' values are checked against TRL's in
# tests/test_trl_equivalence.py and tests/algorithm/test_losses.py
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["cispo", "sapo"])
def test_each_policy_loss_learns(tokenizer, tmp_path, loss, make_trainer):
    overrides = [f"algorithm.policy_loss={loss}"]
    if loss == "cispo":
        # CISPO's cap on the importance weight (TRL's advice)
        overrides.append("algorithm.epsilon_high=5.0")
    _, history = learns(make_trainer, tokenizer, tmp_path, overrides)
    assert mean(history, "reward", "last") > mean(history, "reward", "first") + 0.3


def test_top_entropy_quantile_trains_on_a_fraction_of_the_tokens(tokenizer, tmp_path, make_trainer):
    _, history = learns(
        make_trainer,
        tokenizer,
        tmp_path,
        [
            "algorithm.top_entropy_quantile=0.5",
            "rollout.max_completion_length=4",
            "training.per_device_train_batch_size=64",
        ],
        steps=3,
    )
    kept = history[-1]["entropy/kept_ratio"]
    assert 0.4 <= kept <= 0.75, kept
