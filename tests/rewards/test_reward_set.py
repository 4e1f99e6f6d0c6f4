"""The reward set (grpo.rewards.reward_set): functions resolved by name, module or file, their
signatures checked against the data's columns, scores weighted with missing rewards and
failures counted, the columns passed per completion, and what counts as a reward."""

import itertools
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from grpo.config.errors import ConfigError
from grpo.rewards.arithmetic import arithmetic_correct, arithmetic_format
from grpo.rewards.reward_set import RewardSet, check_signature, resolve
from grpo.rewards.worker import as_rewards


def test_resolve_builtin_module_and_file(tmp_path):
    assert resolve("arithmetic_correct")[1] is arithmetic_correct
    assert resolve("grpo.rewards.arithmetic:arithmetic_format")[1] is arithmetic_format
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n"
    )
    name, fn = resolve(f"{f}:length")
    assert name == "length" and fn(["ab", "c"]) == [2.0, 1.0]
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        resolve("nope")
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        resolve(f"{f}:missing")
    with pytest.raises(ConfigError, match="cannot import"):
        resolve("no_such_module_xyz:fn")


def test_signature_checked_against_columns():
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    def no_kwargs(completions):
        return []

    check_signature("ok", needs_solution, {"solution"})
    with pytest.raises(ConfigError, match="needs argument 'solution'"):
        check_signature("needs_solution", needs_solution, {"answer"})
    with pytest.raises(ConfigError, match="must accept \\*\\*kwargs"):
        check_signature("no_kwargs", no_kwargs, set())


def test_score_weights_missing_and_failures():
    def half_none(completions, **kw):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    def broken(completions, **kw):
        raise ValueError("boom")

    def wrong_length(completions, **kw):
        return [1.0]

    rs = RewardSet([], [], torch.zeros(0))
    rs.add("half", half_none, 2.0)
    rs.add("broken", broken, 1.0)
    rs.add("short", wrong_length, 1.0)
    rows = [{"prompt": "p", "answer": 1}] * 4
    out = rs.score(["p"] * 4, ["a", "b", "c", "d"], [[1], [2], [3], [4]], rows)
    assert out.shape == (4, 3)
    assert out[:, 0].tolist()[0] == 1.0 and math.isnan(out[1, 0].item())
    assert torch.isnan(out[:, 1:]).all()
    assert rs.failures == {"half": 0, "broken": 1, "short": 1}


def test_columns_are_passed_per_completion():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kw):
        seen.update(prompts=prompts, answer=answer, ids=completion_ids, extra=kw)
        return [0.0] * len(completions)

    rs = RewardSet([], [], torch.zeros(0))
    rs.add("spy", spy, 1.0)
    rows = [{"prompt": "p1", "answer": 1, "tag": "x"}, {"prompt": "p2", "answer": 2, "tag": "y"}]
    rs.score(["p1", "p2"], ["a", "b"], [[7], [8]], rows)
    # and TRL's loggers, since it takes **kwargs
    assert callable(seen["extra"].pop("log_metric")) and callable(seen["extra"].pop("log_extra"))
    assert (
        seen["answer"] == [1, 2]
        and seen["extra"] == {"tag": ["x", "y"]}
        and seen["ids"] == [[7], [8]]
    )


class _LyingList(list):
    def __init__(self, items, claims):
        super().__init__(items)
        self.claims = claims

    def __len__(self):
        return self.claims


@pytest.mark.parametrize(
    "values, message",
    [
        (["1.0", "0.5"], "expected float or None, got '1.0'"),  # numeric strings are not numbers
        ("10", "got '10'"),
        ({0: 1.0, 1: 1.0}, "got {0: 1.0, 1: 1.0}"),
        ({1.0, 2.0}, "got {1.0, 2.0}"),  # no order
        (_LyingList([1.0], claims=2), "got _LyingList of length 1"),  # too short, whatever len says
        (_LyingList([1.0, 1.0, 1.0], claims=2), "got _LyingList of length more than 2"),
        ((x for x in [1.0, 2.0, 3.0]), "got generator of length more than 2"),
        (itertools.repeat(1.0), "got repeat of length more than 2"),  # endless: bounded by counting
        (1.0, "got 1.0"),
        ([1.0, 1j], "got 1j"),
        ([1.0, [1.0]], "got [1.0]"),
        ([1.0, object], "got <class 'object'>"),
    ],
)
def test_rewards_that_are_not_one_real_number_or_none_each_are_refused(values, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        as_rewards(values, 2)


def test_real_numbers_of_every_kind_are_rewards():
    numbers = [
        1,
        0.5,
        True,
        False,
        np.float32(0.25),
        np.int64(2),
        np.bool_(True),
        np.array(3.0),
        torch.tensor(4.0),
        torch.tensor(5, dtype=torch.int32),
        None,
        math.nan,
        Fraction(1, 4),
    ]
    rewards = as_rewards(numbers, len(numbers))
    assert (
        rewards[:10] == [1.0, 0.5, 1.0, 0.0, 0.25, 2.0, 1.0, 3.0, 4.0, 5.0] and rewards[12] == 0.25
    )
    assert math.isnan(rewards[10]) and math.isnan(rewards[11])  # None and NaN: missing
    assert as_rewards((x for x in [1.0, None]), 2)[0] == 1.0  # any iterable of exactly n
    assert as_rewards(torch.tensor([1.0, 2.0]), 2) == [1.0, 2.0] and as_rewards(
        np.array([1, 2]), 2
    ) == [1.0, 2.0]
    with pytest.raises(
        TypeError, match=r"got Tensor of shape \(1,\)"
    ):  # an item must be a 0-d tensor
        as_rewards([torch.tensor([1.0]), 1.0], 2)
    with pytest.raises(TypeError, match=r"got ndarray of shape \(1,\)"):
        as_rewards([np.array([1.0]), 1.0], 2)
    with pytest.raises(TypeError, match=re.escape("got tensor(1.+1.j)")):
        as_rewards([torch.tensor(1 + 1j), 1.0], 2)
    with pytest.raises(ValueError, match="not a finite float32"):
        as_rewards([10**400, 1.0], 2)


def test_a_function_returning_strings_fails_its_call_and_is_counted():
    rs = RewardSet([], [], torch.zeros(0), isolation="thread")
    rs.add("strings", lambda completions, **kw: ["1.0"] * len(completions), 1.0)
    out = rs.score(["p"] * 2, ["a", "b"], [[1], [2]], [{"prompt": "p"}] * 2)
    assert torch.isnan(out).all() and rs.failures == {"strings": 1}
