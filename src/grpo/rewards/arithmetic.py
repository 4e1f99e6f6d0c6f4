"""The seed's reward: the last `Answer: N` in the completion must equal the answer."""

from __future__ import annotations

import re

ANSWER_PATTERN = re.compile(r"Answer:\s*(-?\d+)")


def completion_text(completion) -> str:
    """Plain text of a completion: a string, or TRL-style [{"role": ..., "content": ...}] with
    the tool messages left out (what a tool answered is not the model's answer)."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") != "tool")


def extract_answer(text: str) -> int | None:
    """The number after the last `Answer:` (commas removed), or None.

    Example: "28 * 3 = 84\\nAnswer: 1,27" -> 127; "Answer: 5 ... Answer: -3" -> -3.
    """
    found = ANSWER_PATTERN.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def arithmetic_correct(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last `Answer: N` equals the row's `answer`, else 0.0."""
    return [
        float(extract_answer(completion_text(c)) == int(a)) for c, a in zip(completions, answer)
    ]


def arithmetic_format(completions, **kwargs) -> list[float]:
    """1.0 when the completion writes an `Answer: N` line at all (right or wrong)."""
    return [float(extract_answer(completion_text(c)) is not None) for c in completions]
