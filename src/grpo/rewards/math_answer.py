"""`math_answer`: the completion's final answer against the row's `answer`, as math.

Where the final answer is read from (`rewards.math_forms`, all by default;
the last one in the text wins, whichever its form):

    boxed    the last \\boxed{...} (or \\fbox{...}), nested braces included
    gsm8k    GSM8K's `#### 42`
    answer   the seed's `Answer: 42` (to the end of its line)

The row's `answer` may be a number, or text in any of those forms, or LaTeX
with or without `$...$`. Two answers are equal when

1. both read as plain numbers (commas in numbers, a leading `+`, decimals,
   `a/b` fractions and percentages' `%` dropped) with the same exact rational
   value: `1,000` = `1000`, `0.5` = `1/2`, `-3` != `3`; or otherwise
2. math-verify (sympy) finds them equivalent: `\\frac{1}{2}` = `0.5`,
   `x^2+1` = `1+x^2`, `\\sqrt{4}` = `2`.

Every math-verify comparison runs in a worker process bounded by
`rewards.math_timeout` seconds (grpo.rewards.bounded: a fresh interpreter, never a fork of the
trainer, so safe beside its CUDA), so an expression that sympy
cannot finish with gives 0, not a stuck run; the text handed to it is capped
at MAX_ANSWER_CHARS, and the extraction itself is one linear scan, so huge or
deeply nested completions return promptly. A row without an `answer` gets a
missing reward (None), not a zero.
"""

from __future__ import annotations

import re
from fractions import Fraction

from grpo.rewards.arithmetic import completion_text
from grpo.rewards.bounded import BoundedWorker

FORMS = ("boxed", "gsm8k", "answer")
MAX_ANSWER_CHARS = 1000
"""Longer extracted answers are not compared (0): no real final answer is that long."""

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####\s*([^\n]*)")
_ANSWER = re.compile(r"Answer:\s*([^\n]*)")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def _boxed(text: str) -> list[tuple[int, str]]:
    """(position, content) of every \\boxed{...} whose braces close: one pass pairs every
    brace with its match, so the cost is linear however the braces nest or fail to close."""
    closing: dict[int, int] = {}
    stack: list[int] = []
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            closing[stack.pop()] = i
    found = []
    for match in _BOXED.finditer(text):
        brace = match.end() - 1
        if brace in closing:
            found.append((match.start(), text[brace + 1 : closing[brace]]))
    return found


def extract_answer(text: str, forms: tuple[str, ...] | list[str] = FORMS) -> str | None:
    """The final answer of `text` in one of `forms`: the one that starts last.

    Example: "so \\boxed{\\frac{1}{2}}. #### 3" -> "3"; "\\boxed{x^{2}}" -> "x^{2}".
    """
    candidates: list[tuple[int, str]] = []
    if "boxed" in forms:
        tail = text[-20000:]  # a final answer is near the end; a bounded scan for huge completions
        offset = len(text) - len(tail)
        candidates += [(offset + p, s) for p, s in _boxed(tail)[-1:]]
    if "gsm8k" in forms:
        candidates += [(m.start(), m.group(1)) for m in list(_GSM8K.finditer(text))[-1:]]
    if "answer" in forms:
        candidates += [(m.start(), m.group(1)) for m in list(_ANSWER.finditer(text))[-1:]]
    if not candidates:
        return None
    return _clean(max(candidates)[1])


def _clean(answer: str) -> str:
    answer = answer.strip().rstrip(".").strip()
    while len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer[1:-1].strip()
    return answer.rstrip(".").strip()


def normalise_gold(gold) -> str | None:
    """The row's answer as text: a number as it is, text in any final-answer form unwrapped."""
    if gold is None or isinstance(gold, bool):
        return None
    if isinstance(gold, (int, float)):
        return str(gold)
    text = str(gold).strip()
    if not text:
        return None
    found = extract_answer(text)
    return found if found else _clean(text)


def as_number(text: str) -> Fraction | None:
    """The exact value of a plain number (commas, `+`, `%`, `\\!` spacing dropped), else None."""
    t = (
        text.replace(",", "")
        .replace("\\!", "")
        .replace(" ", "")
        .replace("\\%", "%")
        .rstrip("%")
        .rstrip(".")
    )
    if not _NUMBER.fullmatch(t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


class MathAnswer:
    """The `math_answer` reward function (TRL's calling convention; dataset column `answer`)."""

    runs_in_process = True
    """Its comparisons are bounded in their own worker (grpo.rewards.execution keeps it in the trainer)."""

    def __init__(self, forms: tuple[str, ...] | list[str] = FORMS, timeout: float = 5.0):
        unknown = [f for f in forms if f not in FORMS]
        if unknown or not forms:
            raise ValueError(
                f"math answer forms must be some of {', '.join(FORMS)}, got {list(forms)}"
            )
        self.forms, self.timeout = tuple(forms), timeout
        self.__name__ = "math_answer"
        self._worker: BoundedWorker | None = None
        self.timeouts = 0

    def equal(self, gold: str, predicted: str) -> bool:
        exact_gold, exact_predicted = as_number(gold), as_number(predicted)
        if exact_gold is not None and exact_predicted is not None:
            return exact_gold == exact_predicted
        if len(predicted) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return False
        if self._worker is None:
            self._worker = BoundedWorker("grpo.rewards.equivalence:equivalent", self.timeout)
        status, value = self._worker(gold, predicted)
        if status == "timeout":
            self.timeouts += 1
        return status == "ok" and bool(value)

    def score(self, completion, gold) -> float | None:
        gold_text = normalise_gold(gold)
        if gold_text is None:
            return None
        predicted = extract_answer(completion_text(completion), self.forms)
        if predicted is None or not predicted:
            return 0.0
        return float(self.equal(gold_text, predicted))

    def __call__(self, completions, answer=None, **kwargs) -> list[float | None]:
        answers = answer if answer is not None else [None] * len(completions)
        return [self.score(c, a) for c, a in zip(completions, answers)]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
