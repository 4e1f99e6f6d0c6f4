"""The value checks the config sections share: a choice among names, a number in range, an OS
limit's bound, and no NaN or inf anywhere; each refusal names the key."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Protocol

from grpo.config import safe_yaml
from grpo.config.errors import ConfigError


def one_of(key: str, value: Any, choices: tuple[str, ...]) -> None:
    """`value` is one of `choices`; refused naming them, and the closest when there is one."""
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{key}: {safe_yaml.shown(value)} is not one of {', '.join(choices)}{hint}"
        )


MAX_SECONDS = 86_400
"""A day: the most any time limit (a reward call, a program run) may be; what the OS takes as a
CPU-time limit is far above it, and a longer limit is no limit."""
MAX_MIB = 1 << 20
"""1 TiB in MiB (or 1 GiB in KiB): the most any memory or output limit may be."""
MAX_PROCESSES = 1 << 16
"""The most processes a sandboxed run may be allowed at once (Linux's pid_max is 2^22 at most)."""


def within(key: str, value: float, most: float, unit: str) -> None:
    """value in (0, most], checked before it reaches an OS limit (prlimit, a cgroup, an alarm)."""
    if not 0 < value <= most:
        raise ConfigError(f"{key}: must be in (0, {most}] {unit}, got {value}")


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    """`value` > 0 (or >= 0 with `allow_zero`)."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def all_finite(node: Any, prefix: str = "") -> None:
    """Every float of every section, list elements included: NaN or inf is never a setting
    (and would pass the range checks, which compare false against NaN)."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            all_finite(value, f"{key}.")
            continue
        for where, v in (
            [(f"{key}[{i}]", v) for i, v in enumerate(value)]
            if isinstance(value, list)
            else [(key, value)]
        ):
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(
                    f"{where}: must be a finite number, got {v}; set it to a number (NaN and inf are not settings)"
                )


class WholeConfig(Protocol):
    """The whole config as a section's `check` reads it: the other sections by name, for the
    fields that depend on them. grpo.config.schema.Config is one; naming it here (not importing
    it) keeps the sections below the schema that holds them, with no import cycle."""

    model: Any
    data: Any
    rollout: Any
    rewards: Any
    algorithm: Any
    training: Any
    eval: Any
    logging: Any
    cpu: Any
    health: Any

    @property
    def epsilon_high(self) -> float: ...

    def generation_batch_size(self, world_size: int = 1) -> int: ...
