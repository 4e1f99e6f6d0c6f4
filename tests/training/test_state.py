"""The train state: saved after N steps and restored into a fresh trainer, the next step is
the same as the uninterrupted trainer's (metrics and weights). This is what exact resume
stands on."""

import copy
import math

import pytest
import torch

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.models.tiny import tiny_model
from grpo.training.trainer import Trainer

TIMING = ("time/", "tokens_per_second")


@pytest.fixture
def state_trainer(toy_config, first_char_correct):
    """state_trainer(tokenizer, path, overrides, model=None, restore=None): a toy-task Trainer of 6
    steps of 32 completions writing to `path`, on a 1-layer tiny model unless `model` is given,
    restored from the train state `restore` if given."""

    def build(tokenizer, path, overrides, model=None, restore=None):
        cfg = config.from_dict(
            {**toy_config, "output_dir": str(path)},
            ["training.per_device_train_batch_size=32", "training.max_steps=6", *overrides],
        )
        model = (
            model
            if model is not None
            else tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
        )
        return Trainer.from_config(
            cfg,
            model=model,
            tokenizer=tokenizer,
            reward_funcs={"correct": first_char_correct},
            restore=restore,
        )

    return build


def _untimed(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(TIMING)}


@pytest.mark.parametrize(
    "overrides",
    [
        ["training.lr_scheduler_type=linear", "training.warmup_steps=2"],
        [
            "algorithm.beta=0.04",
            "algorithm.ref_sync_steps=2",
            "algorithm.num_iterations=2",
            "rollout.temperature=0.9",
        ],
        ["algorithm.dynamic_sampling=true", "rollout.max_completion_length=2"],
    ],
)
def test_restored_trainer_takes_the_same_next_steps(tokenizer, tmp_path, overrides, state_trainer):
    original = state_trainer(tokenizer, tmp_path / "a", overrides)
    for _ in range(3):
        original.train_step()
    saved = copy.deepcopy(original.state_dict())
    weights = copy.deepcopy(original.model.state_dict())

    # other weights, replaced below
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=1)
    model.load_state_dict(weights)
    restored = state_trainer(tokenizer, tmp_path / "b", overrides, model=model, restore=saved)
    assert restored.state.step == 3

    # meanwhile, torch's global stream moves on; the restored state must not depend on it
    torch.rand(100)
    for _ in range(2):
        expected, expected_batch = original.train_step()
        got, got_batch = restored.train_step()
        assert _untimed(got) == _untimed(expected)
        assert torch.equal(got_batch.rollout.completion_ids, expected_batch.rollout.completion_ids)
    for (name, a), b in zip(original.model.named_parameters(), restored.model.parameters()):
        assert torch.equal(a, b), name
    if original.reference.enabled:
        for a, b in zip(
            original.reference.model.parameters(), restored.reference.model.parameters()
        ):
            assert torch.equal(a, b)
    assert not math.isnan(got["loss"])


def test_without_restore_the_next_step_differs(tokenizer, tmp_path, state_trainer):
    """The check above can fail: a fresh trainer given the same weights but not the state
    takes a different step (other prompts, another learning rate, other Adam moments)."""
    original = state_trainer(tokenizer, tmp_path / "a", ["training.lr_scheduler_type=linear"])
    for _ in range(3):
        original.train_step()
    model = copy.deepcopy(original.model)
    fresh = state_trainer(
        tokenizer, tmp_path / "b", ["training.lr_scheduler_type=linear"], model=model
    )
    expected, _ = original.train_step()
    got, _ = fresh.train_step()
    assert got["step"] != expected["step"] and got["learning_rate"] != expected["learning_rate"]


def test_restore_refuses_other_data(tokenizer, tmp_path, state_trainer):
    original = state_trainer(tokenizer, tmp_path / "a", [])
    original.train_step()
    saved = original.state_dict()
    with pytest.raises(ConfigError, match="data.seed"):
        state_trainer(tokenizer, tmp_path / "b", ["data.seed=5"], restore=saved)
