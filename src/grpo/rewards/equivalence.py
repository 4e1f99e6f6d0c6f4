"""Mathematical equivalence of two answers through math-verify, for grpo.rewards.math_answer.

Imported in a worker process (grpo.rewards.bounded: a fresh interpreter, never a fork of
the trainer, so safe beside its CUDA; nothing here uses torch), which bounds each call in time:
math-verify's own timeouts use SIGALRM, which works only in a main thread,
so they are switched off here.
"""

from __future__ import annotations

import logging

from math_verify import parse, verify

# it warns on every call that its timeout is off
logging.getLogger("math_verify").setLevel(logging.ERROR)


def equivalent(gold: str, predicted: str) -> bool:
    """Whether the LaTeX (or plain) expressions `gold` and `predicted` are equal as math:
    `\\frac{1}{2}` and `0.5`, `x^2+1` and `1+x^2`, `\\{1, 2\\}` and `\\{2, 1\\}`."""
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    predicted_parsed = parse(f"${predicted}$", parsing_timeout=None)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=None))
