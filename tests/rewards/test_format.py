"""The <think> format rewards (grpo.rewards.format): strict, lenient and the tag count, on plain
text and on chat messages."""

import pytest

from grpo.rewards.format import think_format, think_format_lenient, think_tag_count

FORMAT_CASES = [
    # text, strict, lenient, tag count
    ("<think>add them</think>42", 1.0, 1.0, 1.0),
    ("\n<think>\nreasoning\n</think>\nAnswer: 3", 1.0, 1.0, 1.0),
    ("<think></think>3", 0.0, 1.0, 1.0),  # empty reasoning: lenient only
    ("<think>only thinking</think>", 0.0, 0.0, 0.75),  # no answer after it
    ("preamble <think>a</think>3", 0.0, 1.0, 1.0),  # text before the block
    ("<think>a</think>3<think>b</think>4", 0.0, 1.0, 0.5),  # two blocks
    ("</think>x<think>", 0.0, 0.0, 0.5),  # tags in the wrong order
    ("just an answer", 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("text, strict, lenient, tags", FORMAT_CASES)
def test_think_format_rewards(text, strict, lenient, tags):
    assert think_format([text]) == [strict]
    assert think_format_lenient([text]) == [lenient]
    assert think_tag_count([text]) == [tags]
    assert think_format([[{"role": "assistant", "content": text}]]) == [strict]
