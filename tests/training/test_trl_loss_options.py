"""TRL 1.16's loss options through the trainer on the toy task: each trains a few steps with
finite losses and its metric, and acts as its formula says (grpo.algorithm.losses, .entropy,
.advantages). The exact math is checked in tests/algorithm/test_trl_options.py and against TRL
in tests/test_trl_equivalence.py; exact resume with the adaptive controller in
tests/run/test_resume_entropy.py."""

import math

import pytest
import torch

from grpo import algorithm
from grpo.rewards.arithmetic import completion_text

# one minibatch of 32 completions (2 prompts x 16) per step
SMALL = ["training.max_steps=3", "training.per_device_train_batch_size=32"]


def third(completions, **kwargs):
    """A reward with spread from the first step (a third of the first characters), so that every
    step has advantages and moves the weights (the toy's own reward is 0 for a random model)."""
    return [float(ord(completion_text(c)[:1] or "a") % 3 == 0) for c in completions]


def train(make_trainer, tokenizer, tmp_path, overrides, **kwargs):
    kwargs.setdefault("reward_funcs", {"third": third})
    trainer = make_trainer(tokenizer, tmp_path, [*SMALL, *overrides], **kwargs)
    start = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.train()
    moved = any(not torch.equal(a, p) for a, p in zip(start, trainer.model.parameters()))
    assert moved and len(history) == 3
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in history)
    return trainer, history


def test_luspo_trains(make_trainer, tokenizer, tmp_path):
    overrides = ["algorithm.loss_type=luspo", "algorithm.importance_sampling_level=sequence"]
    _, history = train(make_trainer, tokenizer, tmp_path, overrides)
    assert "clip_ratio/region_mean" in history[-1]


def test_vespo_trains_and_weights_by_the_sequence_ratio(make_trainer, tokenizer, tmp_path):
    _, history = train(
        make_trainer,
        tokenizer,
        tmp_path,
        ["algorithm.policy_loss=vespo", "algorithm.num_iterations=2", "algorithm.vespo_k_pos=2.5"],
    )
    # the first pass is on policy (w = 1, phi = 1); the second, after a step, has w != 1 and
    # phi(w) < 1 (phi peaks at 1 only for k = lambda), so the mean over the two passes is below 1
    for row in history:
        assert 0.0 < row["vespo/phi_seq_mean"] < 1.0


def test_off_policy_mask_drops_drifted_negative_sequences(make_trainer, tokenizer, tmp_path):
    _, history = train(
        make_trainer,
        tokenizer,
        tmp_path,
        ["algorithm.num_iterations=2", "algorithm.off_policy_mask_threshold=1e-9"],
    )
    # the second pass of each step has drifted from the sampler: sequences with A < 0 drop out
    ratios = [row["off_policy/masked_ratio"] for row in history]
    assert all(0.0 <= r <= 0.5 for r in ratios) and max(ratios) > 0, ratios


def test_bias_corrected_kl_changes_the_update_not_the_first_loss(make_trainer, tokenizer, tmp_path):
    runs = []
    for corrected in ("false", "true"):
        overrides = ["algorithm.beta=0.5", f"algorithm.kl_bias_correction={corrected}"]
        trainer, history = train(make_trainer, tokenizer, tmp_path / corrected, overrides)
        runs.append((history, [p.detach().clone() for p in trainer.model.parameters()]))
    (plain, w_plain), (corrected, w_corrected) = runs
    # step 1 starts from the same weights at ratio 1: the same loss and KL value ...
    assert corrected[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert corrected[0]["kl"] == pytest.approx(plain[0]["kl"], rel=1e-6)
    # ... but the ratio's gradient makes a different update
    assert any(not torch.equal(a, b) for a, b in zip(w_plain, w_corrected))


def test_entropy_bonus_is_subtracted_from_the_loss(make_trainer, tokenizer, tmp_path):
    _, history = train(make_trainer, tokenizer, tmp_path, ["algorithm.entropy_coef=0.05"])
    for row in history:
        assert row["entropy_coef"] == 0.05
        # one minibatch in one piece: the bonus is the logged mean entropy
        assert row["loss"] == pytest.approx(row["policy_loss"] - 0.05 * row["entropy"], abs=1e-6)


def test_adaptive_entropy_moves_and_gates_the_coefficient(make_trainer, tokenizer, tmp_path):
    overrides = [
        "algorithm.use_adaptive_entropy=true",
        "algorithm.entropy_coef=0.01",
        "algorithm.entropy_coef_delta=0.005",
        "algorithm.entropy_target=100.0",  # above any entropy here: the coefficient rises
    ]
    trainer, history = train(make_trainer, tokenizer, tmp_path, overrides)
    assert [row["entropy_coef"] for row in history] == pytest.approx([0.015, 0.02, 0.025])
    assert trainer.state.entropy.coef == pytest.approx(0.025)
    assert trainer.state.entropy.last_entropy == pytest.approx(history[-1]["entropy"], rel=1e-6)
    # step 1 applies none (no entropy measured yet); step 2 applies the coefficient step 1 left
    assert history[0]["loss"] == pytest.approx(history[0]["policy_loss"], abs=1e-9)
    assert history[1]["loss"] == pytest.approx(
        history[1]["policy_loss"] - 0.015 * history[1]["entropy"], abs=1e-6
    )


def odd_first(completions, **kwargs):
    """A second objective, with its own spread: 1 when the completion's first character is odd."""
    return [float(completion_text(c)[:1] in "13579") for c in completions]


def test_normalize_then_sum_advantages_in_the_trainer(
    make_trainer, tokenizer, tmp_path, first_char_correct
):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [*SMALL, "algorithm.multi_objective_aggregation=normalize_then_sum"],
        reward_funcs={"correct": first_char_correct, "odd": odd_first},
    )
    _, batch = trainer.train_step()
    advantages = trainer.phases.advantages(batch, None)  # the step's, computed again: the same
    expected = algorithm.normalize_then_sum_advantages(
        batch.rewards_per_func, trainer.rewards.weights, 16
    )
    assert torch.equal(advantages, expected)
    # GDPO's batch normalisation: mean 0 and std 1 over the batch (up to eps)
    assert abs(advantages.mean().item()) < 1e-5
    assert advantages.std().item() == pytest.approx(1.0, abs=1e-3)


def test_cispo_with_a_cap_below_one_trains_as_trl_does_with_a_warning_once(caplog):
    from grpo.config.loading import from_dict
    from grpo.training import update

    # TRL's default epsilon_high for cispo is epsilon (0.2): accepted, as TRL does, and named once
    cfg = from_dict({"algorithm": {"policy_loss": "cispo"}})
    update._warn_once.cache_clear()  # another test in this process may have warned already
    with caplog.at_level("WARNING", logger="grpo.training.update"):
        settings = update.loss_settings(cfg.algorithm)
        update.loss_settings(cfg.algorithm)
    assert settings.params.epsilon_high == 0.2
    warned = [r for r in caplog.records if "CISPO's cap" in r.getMessage()]
    assert len(warned) == 1 and "epsilon_high=5.0" in warned[0].getMessage()
