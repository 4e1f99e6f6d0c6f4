"""Running untrusted programs (model-written code) isolated and bounded.

    from grpo.sandbox import run
    result = run(program, stdin="1 2\\n", timeout=5)
    result.status    # ok | failed | timeout | memory | crashed | output_limit

See grpo.sandbox.runner for the isolation, grpo.sandbox.limits for the limits.
"""

from grpo.sandbox.counts import take_counts
from grpo.sandbox.limits import Limits
from grpo.sandbox.runner import (
    ISOLATIONS,
    STATUSES,
    SandboxError,
    SandboxResult,
    SandboxUnavailable,
    bwrap_path,
    interpreter,
    run,
)

__all__ = [
    "ISOLATIONS",
    "STATUSES",
    "Limits",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
    "bwrap_path",
    "interpreter",
    "run",
    "take_counts",
]
