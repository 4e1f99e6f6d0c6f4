"""Rewards that draw from Python's `random` or NumPy's global stream score alike in two fresh
runs and in a restored one: training.seed seeds both streams as TRL's set_seed does, and each
reward call is seeded from the run's state (grpo.training.state.reward_seed), in a worker
process (before each call) and in the trainer's threads (before each batch)."""

import copy
import random

import numpy
import pytest

from grpo.config import loading as config
from grpo.models.tiny import tiny_model
from grpo.training.state import TrainState
from grpo.training.trainer import Trainer

TIMING = ("time/", "tokens_per_second")

DRAWN = """
import random

import numpy


def drawn(completions, **kwargs):
    return [random.random() + float(numpy.random.rand()) for _ in completions]
"""


@pytest.fixture
def drawn_trainer(toy_config, tmp_path):
    """drawn_trainer(tokenizer, name, isolation, model=None, restore=None): a toy-task Trainer of
    16 completions a step rewarded by `drawn` (a file's function: light for a worker to load)."""
    path = tmp_path / "drawn.py"
    path.write_text(DRAWN)

    def build(tokenizer, name, isolation, model=None, restore=None):
        cfg = config.from_dict(
            {**toy_config, "output_dir": str(tmp_path / name)},
            [
                "training.per_device_train_batch_size=16",
                "rollout.num_generations=4",
                "training.max_steps=4",
                f"rewards.funcs=[{path}:drawn]",
                f"rewards.isolation={isolation}",
                "rewards.workers=2",  # two chunks, to whichever worker is free
            ],
        )
        model = (
            model
            if model is not None
            else tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
        )
        return Trainer.from_config(cfg, model=model, tokenizer=tokenizer, restore=restore)

    return build


def _untimed(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(TIMING)}


def _steps(trainer, count):
    out = []
    for _ in range(count):
        out.append(_untimed(trainer.train_step()[0]))
        # other code of the process drawing between steps (a callback, a library) moves nothing
        random.random(), numpy.random.rand()
    return out


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_reward_drawing_from_random_and_numpy_is_the_same_in_every_run(
    tokenizer, isolation, drawn_trainer
):
    first = drawn_trainer(tokenizer, "first", isolation)
    second = drawn_trainer(tokenizer, "second", isolation)
    try:
        expected = _steps(first, 2)
        assert _steps(second, 2) == expected
        # the rewards are draws, and differ from step to step: the equality above is not trivial
        assert all(m["reward_std"] > 0.1 for m in expected), expected
        assert expected[0]["reward"] != expected[1]["reward"]
        saved = copy.deepcopy(first.state_dict())
        model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=1)
        model.load_state_dict(first.model.state_dict())
        restored = drawn_trainer(tokenizer, "restored", isolation, model=model, restore=saved)
        try:
            assert _steps(restored, 2) == _steps(first, 2)
        finally:
            restored.rewards.close()
    finally:
        first.rewards.close()
        second.rewards.close()


def test_training_seed_seeds_python_and_numpy_as_trl_does(toy_config, tmp_path):
    cfg = config.from_dict({**toy_config, "output_dir": str(tmp_path)}, ["training.seed=7"])
    random.seed(0), numpy.random.seed(0)
    TrainState.create(cfg, _optimizer(), 4)
    got = random.random(), float(numpy.random.rand())
    random.seed(7), numpy.random.seed(7)  # transformers' set_seed(7), which TRL calls
    assert got == (random.random(), float(numpy.random.rand()))


def _optimizer():
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
