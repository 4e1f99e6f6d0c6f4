"""DeepSeek-R1's output format: reasoning inside `<think>...</think>`, then the answer.

    think_format          strict: the completion starts with <think>, has exactly one
                          <think>...</think> pair, and a non-empty answer after it -> 1, else 0
    think_format_lenient  a <think>...</think> pair somewhere, followed by a non-empty answer -> 1
    think_tag_count       partial credit, 0.25 each: exactly one <think>; exactly one </think>;
                          <think> before </think>; a non-empty answer after that block

Leading whitespace is allowed in the strict form (a chat template may end with
a newline); the reasoning itself may be empty in the lenient form only.
"""

from __future__ import annotations

import re

from grpo.rewards.arithmetic import completion_text

OPEN, CLOSE = "<think>", "</think>"
_STRICT = re.compile(
    r"\s*<think>(?P<reasoning>(?:(?!</?think>).)+?)</think>(?P<answer>(?:(?!</?think>).)*)",
    re.DOTALL,
)
_LENIENT = re.compile(r"<think>.*?</think>(?P<answer>.*)", re.DOTALL)


def strict_ok(text: str) -> bool:
    m = _STRICT.fullmatch(text)
    return bool(m and m.group("reasoning").strip() and m.group("answer").strip())


def lenient_ok(text: str) -> bool:
    m = _LENIENT.search(text)
    return bool(m and m.group("answer").replace(CLOSE, "").strip())


def tag_score(text: str) -> float:
    opens, closes = text.count(OPEN), text.count(CLOSE)
    first_open, last_close = text.find(OPEN), text.rfind(CLOSE)
    score = 0.25 * (opens == 1) + 0.25 * (closes == 1)
    ordered = first_open != -1 and last_close != -1 and first_open < last_close
    score += 0.25 * ordered
    score += 0.25 * (ordered and bool(text[last_close + len(CLOSE) :].replace(OPEN, "").strip()))
    return score


def think_format(completions, **kwargs) -> list[float]:
    return [float(strict_ok(completion_text(c))) for c in completions]


def think_format_lenient(completions, **kwargs) -> list[float]:
    return [float(lenient_ok(completion_text(c))) for c in completions]


def think_tag_count(completions, **kwargs) -> list[float]:
    return [tag_score(completion_text(c)) for c in completions]
