"""The arithmetic task's rewards (grpo.rewards.arithmetic): the answer extracted as the seed
extracts it, and the correctness and format rewards on plain text and on chat messages."""

import pytest

from grpo.rewards.arithmetic import arithmetic_correct, arithmetic_format, extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: 127", 127),
        ("Answer:127", 127),
        ("84 + 43 = 127\nAnswer: 1,270", 1270),
        ("Answer: 5\nwait\nAnswer: -3", -3),
        ("the answer is 127", None),
        ("\\boxed{127}", None),
        ("answer: 127", None),
    ],
)
def test_extract_answer_follows_the_seed(text, expected):
    assert extract_answer(text) == expected


def test_arithmetic_rewards_on_text_and_messages():
    completions = ["Answer: 127", [{"role": "assistant", "content": "so\nAnswer: 12"}], "127"]
    assert arithmetic_correct(completions, answer=[127, 127, 127]) == [1.0, 0.0, 0.0]
    assert arithmetic_format(completions) == [1.0, 1.0, 0.0]


def test_what_a_tool_answered_is_not_the_models_answer():
    # a conversation with a tool turn: only the assistant's messages count
    conversation = [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "lookup"}]},
        {"role": "tool", "content": "Answer: 127"},
        {"role": "assistant", "content": "I do not know"},
    ]
    assert arithmetic_correct([conversation], answer=[127]) == [0.0]
    assert arithmetic_format([conversation]) == [0.0]
    conversation[-1]["content"] = "Answer: 127"
    assert arithmetic_correct([conversation], answer=[127]) == [1.0]
