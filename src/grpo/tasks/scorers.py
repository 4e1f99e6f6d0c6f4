"""Evaluation scorers: how a task counts its held-out completions."""

from __future__ import annotations

from grpo.config.errors import ConfigError
from grpo.rewards.arithmetic import completion_text, extract_answer
from grpo.rewards.math_answer import FORMS, MathAnswer, normalise_gold
from grpo.rewards.math_answer import extract_answer as final_answer
from grpo.tasks import Row, Scores


def _answer_of(row: Row, index: int) -> int:
    if "answer" not in row:
        raise ConfigError(
            f"held-out row {index} has no 'answer' column (columns: {sorted(row)}); evaluation compares the "
            "last 'Answer: N' of each completion with row['answer'], so every held-out row needs an integer "
            "'answer' (add it to data.eval_file)"
        )
    value = row["answer"]
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str):
            value = value.replace(",", "").strip()
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"held-out row {index}: 'answer' must be an integer (e.g. 127 or \"127\"), got {row['answer']!r}"
        ) from None


def integer_answers(rows: list[Row]) -> list[int]:
    """The integer answer of every row; a clear error for a missing or non-integer one."""
    return [_answer_of(row, i) for i, row in enumerate(rows)]


def has_integer_answers(rows: list[Row]) -> bool:
    try:
        integer_answers(rows)
    except ConfigError:
        return False
    return bool(rows)


class AnswerScorer:
    """The seed's check: a completion is *formatted* when it writes an `Answer: N` line,
    and *correct* when the last such N equals the row's integer `answer`.

    Example: answers [127, -5, 1000, 3], texts
        ["... Answer: 127", "Answer: 2\\nAnswer: -5", "Answer: 1,000", "the answer is 3"]
    -> correct 3/4, formatted 3/4, correct among formatted 3/3.
    """

    description = (
        "A completion is *formatted* when it writes an `Answer: N` line and *correct* when the last N equals "
        "the answer; *correct among formatted* is correct / formatted."
    )

    def check(self, rows: list[Row]) -> None:
        integer_answers(rows)

    def score(self, rows: list[Row], texts: list[str]) -> Scores:
        if len(texts) != len(rows):
            raise ValueError(f"score: {len(texts)} completions for {len(rows)} rows")
        answers = integer_answers(rows)
        predicted = [extract_answer(completion_text(t)) for t in texts]
        correct = [p is not None and p == a for p, a in zip(predicted, answers)]
        n, formatted = len(texts), sum(p is not None for p in predicted)
        counts = {
            "correct": (sum(correct), n),
            "formatted": (formatted, n),
            "correct among formatted": (
                sum(correct),
                formatted,
            ),  # an unformatted completion is never correct
        }
        details = [
            {"answer": a, "predicted": p, "correct": c}
            for a, p, c in zip(answers, predicted, correct)
        ]
        return Scores(counts, details)


class RewardScorer:
    """For tasks with no answer to compare: the held-out completions are scored by the
    configured reward functions only (the evaluation's mean reward and each
    function's mean), with no counts."""

    description = (
        "Scored by the configured reward functions: their weighted mean and each function's mean."
    )

    def check(self, rows: list[Row]) -> None:
        pass

    def score(self, rows: list[Row], texts: list[str]) -> Scores:
        if len(texts) != len(rows):
            raise ValueError(f"score: {len(texts)} completions for {len(rows)} rows")
        return Scores({}, [{} for _ in rows])


class MathScorer:
    """The `math_answer` reward's check, counted: a completion is *answered* when it writes a
    final answer in one of `forms` (rewards.math_forms) and *correct* when that answer equals
    the row's `answer` as math (the reward's extraction and equivalence, each math-verify
    comparison bounded by `timeout` seconds in a worker process).

    Example: answers ["72", "\\\\frac{1}{2}", "5"], texts
        ["#### 72", "so \\\\boxed{0.5}", "five"]  -> correct 2/3, answered 2/3.
    """

    description = (
        "A completion is *answered* when it writes a final answer (the last \\boxed{...}, `#### N` or `Answer: N`) "
        "and *correct* when that answer equals the row's answer as math (the `math_answer` reward's check)."
    )

    def __init__(self, forms=FORMS, timeout: float = 5.0):
        self.reward = MathAnswer(forms, timeout)

    def check(self, rows: list[Row]) -> None:
        for i, row in enumerate(rows):
            if normalise_gold(row.get("answer")) is None:
                raise ConfigError(
                    f"held-out row {i}: no gold 'answer' (got {row.get('answer')!r}; columns: {sorted(row)}); every "
                    "held-out row needs its final answer in 'answer' (a number or LaTeX)"
                )

    def score(self, rows: list[Row], texts: list[str]) -> Scores:
        if len(texts) != len(rows):
            raise ValueError(f"score: {len(texts)} completions for {len(rows)} rows")
        self.check(rows)
        answers = [row["answer"] for row in rows]
        predicted = [final_answer(completion_text(t), self.reward.forms) or None for t in texts]
        # the reward's own score, so the count and the reward can never disagree
        correct = [self.reward.score(t, a) == 1.0 for t, a in zip(texts, answers)]
        n = len(texts)
        counts = {
            "correct": (sum(correct), n),
            "answered": (sum(p is not None for p in predicted), n),
        }
        details = [
            {"answer": a, "predicted": p, "correct": c}
            for a, p, c in zip(answers, predicted, correct)
        ]
        return Scores(counts, details)

    def close(self) -> None:
        self.reward.close()
