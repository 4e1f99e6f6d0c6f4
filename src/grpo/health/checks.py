"""The health checks: each a pure function of a run's step metrics and a short history of them.

    fn(view: View) -> Finding | None

A `View` is what a check may read: the recent steps' metrics (the last is this step), the
run's first `health.window` steps, the training reward of every step so far, the held-out
scores seen so far, a few facts from the config (`RunFacts`) and the thresholds
(`health.*`, grpo.config.health.HealthConfig). A check that finds something returns a
`Finding`: its severity, what it found, the evidence (the numbers and the steps) and the fix,
in words a user can act on. Nothing here runs a model: the checks read what the step logged.

The checks are registered in grpo.registry.HEALTH_CHECKS (their names are what
`health.fail_on` accepts) and run in that order; grpo.health.monitor keeps their state from
step to step. docs/health.md is the user's page for each.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from grpo.config.health import HealthConfig

SEVERITIES = ("note", "warning", "error")
"""note: a number that looks wrong and is not (said once, never a problem); warning: learning
is hampered; error: nothing (or nothing right) is being trained."""

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Finding:
    """What a check found at a step."""

    severity: str
    message: str
    """What is wrong, in a sentence."""
    evidence: str
    """The numbers and the steps it is read from."""
    fix: str
    """What to change."""
    explains: tuple[str, ...] = ()
    """Checks whose findings this one accounts for at the same step (they are not reported
    beside it: one cause, one line)."""
    check: str = ""
    """The registered name (set by the monitor)."""
    step: int = 0
    """The step it was found at (set by the monitor)."""

    def line(self) -> str:
        """The one console line."""
        return f"[{self.severity}] {self.check} at step {self.step}: {self.message} ({self.evidence}). Fix: {self.fix}"


@dataclass(frozen=True)
class EvalPoint:
    """One held-out score: the evaluation's step and its score (accuracy, or the mean reward
    for a task scored by its rewards alone) under one decoding setting."""

    step: int
    score: float
    decoding: str = "greedy"


WEIGHT_DTYPE_RESOLUTION = {"float32": 2.0**-25, "bfloat16": 2.0**-9, "float16": 2.0**-12}
"""Below this fraction of a weight's magnitude a change is lost to rounding whatever the weight:
a quarter of the dtype's machine epsilon (the spacing of its floats near |w| is at least
eps·|w|/2, and round-to-nearest drops a change under half the spacing)."""


@dataclass(frozen=True)
class RunFacts:
    """What the checks need to know of the run's settings."""

    num_iterations: int = 1
    beta: float = 0.0
    entropy_coef: float = 0.0
    advantage_estimator: str = "grpo"
    policy_loss: str = "clipped"
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    max_completion_length: int = 512
    num_generations: int = 8
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    reward_weights: tuple[float, ...] | None = None
    weight_dtype: str = "float32"
    """The dtype the trained weights are held in: model.dtype, or float32 for LoRA adapters
    (peft keeps them in float32 over a bf16 base)."""

    @classmethod
    def from_config(cls, data: Mapping[str, Any]) -> "RunFacts":
        """From a config as a dict (`Config.to_dict()`, or a run's config.yaml as read): missing
        keys take the defaults."""

        def value(section: str, key: str) -> Any:
            node = data.get(section) if isinstance(data, Mapping) else None
            return node.get(key) if isinstance(node, Mapping) else None

        def get(section: str, key: str, default: Any) -> Any:
            # a run directory's config is untrusted: a value of another type is the default's
            found = value(section, key)
            if isinstance(default, float) and _number(found):
                return float(found)
            same = isinstance(found, type(default)) and not (
                isinstance(found, bool) and not isinstance(default, bool)
            )
            return found if same else default

        model = data.get("model") if isinstance(data, Mapping) else None
        lora = model.get("lora") if isinstance(model, Mapping) else None
        lora_rank = lora.get("r", 0) if isinstance(lora, Mapping) else 0
        weights = value("rewards", "weights")
        weighted = isinstance(weights, list) and all(_number(w) for w in weights)
        return cls(
            num_iterations=get("algorithm", "num_iterations", 1),
            beta=get("algorithm", "beta", 0.0),
            entropy_coef=get("algorithm", "entropy_coef", 0.0),
            advantage_estimator=get("algorithm", "advantage_estimator", "grpo"),
            policy_loss=get("algorithm", "policy_loss", "clipped"),
            loss_type=get("algorithm", "loss_type", "dapo"),
            mask_truncated_completions=get("algorithm", "mask_truncated_completions", False),
            dynamic_sampling=get("algorithm", "dynamic_sampling", False),
            max_completion_length=get("rollout", "max_completion_length", 512),
            num_generations=get("rollout", "num_generations", 8),
            temperature=get("rollout", "temperature", 1.0),
            max_grad_norm=get("training", "max_grad_norm", 1.0),
            reward_weights=tuple(float(w) for w in weights) if weighted else None,
            weight_dtype="float32"
            if _number(lora_rank) and lora_rank > 0
            else get("model", "dtype", "float32"),
        )


def _number(x: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class View:
    """What a check reads at one step."""

    rows: Sequence[Row]
    """The recent steps' metrics, oldest first; the last is this step's."""
    early: Sequence[Row]
    """The run's first `limits.window` steps (fewer at its start)."""
    run: RunFacts
    limits: HealthConfig
    rewards: Sequence[tuple[int, float]] = ()
    """(step, reward) of every step so far with a finite reward."""
    evaluations: Sequence[EvalPoint] = ()
    """The held-out scores seen so far, in step order."""
    final: bool = False
    """The pass after the last step, with every evaluation of the run (the `after` one too)."""
    check: str = ""
    """The check reading it (set by the monitor)."""
    firing: frozenset[str] = frozenset()
    """The checks firing before this step."""

    @property
    def row(self) -> Row:
        return self.rows[-1]

    @property
    def step(self) -> int:
        return int(self.row.get("step", len(self.rows)))

    def reward_names(self) -> list[str]:
        """The reward functions, in the config's order (their `rewards/<name>/mean` keys)."""
        return [k[len("rewards/") : -len("/mean")] for k in self.row if _is_reward_mean(k)]

    def weight(self, name: str) -> float:
        return self._weights.get(name, 1.0)

    @functools.cached_property
    def _weights(self) -> dict[str, float]:
        """Each reward function's weight, found once per view: a check asks for every function's,
        and a search per call made a row of K functions cost K^2."""
        names, weights = self.reward_names(), self.run.reward_weights
        if weights is None or len(weights) != len(names):
            return {}
        return dict(zip(names, weights))

    def needs(self, steps: int) -> int:
        """The steps in a row a condition must hold: `steps` to fire, one to go on firing (a
        check that fired stays until health.clear_after steps go by without it)."""
        return 1 if self.check in self.firing else steps

    def trailing(self, holds: Callable[[Row], bool]) -> list[Row]:
        """The last steps in a row for which `holds` is true (oldest first; empty when this step's is false)."""
        out = []
        for row in reversed(self.rows):
            if not holds(row):
                break
            out.append(row)
        return out[::-1]

    def recent(self) -> list[Row]:
        """The last `window` steps, when they come after the run's first `window` (so a trend has
        two windows that do not overlap); else empty."""
        n = self.limits.window
        if len(self.early) < n or len(self.rows) < n:
            return []
        recent = list(self.rows[-n:])
        return recent if _step(recent[0]) > _step(self.early[-1]) else []


# ------------------------------------------------------------------ reading numbers


def _is_reward_mean(key: str) -> bool:
    return key.startswith("rewards/") and key.endswith("/mean") and key.count("/") == 2


def num(row: Row, key: str) -> float | None:
    """The metric as a finite float, or None (absent, missing, NaN, inf, not a number)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _missing(row: Row, key: str) -> bool:
    """Logged, but without a value (NaN, or None as JSON writes a missing number)."""
    if key not in row:
        return False
    value = row[key]
    return value is None or (isinstance(value, float) and math.isnan(value))


def _step(row: Row) -> int:
    return int(row.get("step", 0))


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _at_least(key: str, threshold: float) -> Callable[[Row], bool]:
    return lambda row: (x := num(row, key)) is not None and x >= threshold


def _above(key: str, threshold: float) -> Callable[[Row], bool]:
    return lambda row: (x := num(row, key)) is not None and x > threshold


def g(value: float | None) -> str:
    """A number as the evidence shows it: three significant digits."""
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    return f"{value:.3g}"


def steps(rows: Sequence[Row]) -> str:
    """ "step 7" or "steps 3–7" (the first and last of `rows`)."""
    if not rows:
        return "no step"
    a, b = _step(rows[0]), _step(rows[-1])
    return f"step {a}" if a == b else f"steps {a}–{b}"


def _span(rows: Sequence[Row]) -> str:
    return f"{len(rows)} steps ({steps(rows)})" if len(rows) > 1 else steps(rows)


def _reward_at(view: View, step: int) -> float | None:
    """The mean training reward of the `window` steps up to `step` (an evaluation's step); the
    run's first `window` steps for an evaluation before training."""
    n = view.limits.window
    end = bisect.bisect_right(view.rewards, step, key=lambda pair: pair[0])  # in step order
    upto = [r for _, r in view.rewards[max(0, end - n) : end]]
    return _mean(upto) if upto else _mean(r for _, r in view.rewards[:n])


# ------------------------------------------------------------------ the checks

SIGNAL_FIXES = (
    "larger groups (rollout.num_generations, now {G}) or a higher rollout.temperature (now {T}) find "
    "the other answer more often; a graded reward (partial credit) instead of pass/fail gives groups a "
    "spread; algorithm.dynamic_sampling: true draws more prompts until groups vary"
)


def no_learning_signal(view: View) -> Finding | None:
    """Every group (health.zero_spread_share of them) has zero reward spread for health.patience
    steps: every advantage is 0 and the update does nothing. Names the reward functions that are
    constant over the whole batch."""
    limits = view.limits
    run = view.trailing(_at_least("frac_reward_zero_std", limits.zero_spread_share))
    if len(run) < view.needs(limits.patience):
        return None
    G, T = view.run.num_generations, view.run.temperature
    share = (
        "every group"
        if limits.zero_spread_share >= 1.0
        else f"at least {limits.zero_spread_share:.0%} of the groups"
    )
    constant = [
        name
        for name in view.reward_names()
        if view.weight(name) != 0 and all(num(r, f"rewards/{name}/std") == 0 for r in run)
    ]
    reward = num(view.row, "reward")
    evidence = f"frac_reward_zero_std {g(num(view.row, 'frac_reward_zero_std'))} over {_span(run)}, reward {g(reward)}"
    if constant:
        evidence += "; constant over the whole batch: " + ", ".join(
            f"{name} (always {g(num(view.row, f'rewards/{name}/mean'))})" for name in constant
        )
    fix = SIGNAL_FIXES.format(G=G, T=g(T))
    if all(_at_least("completions/clipped_ratio", limits.truncated_share)(r) for r in run):
        fix += (
            f"; every completion is also cut at max_completion_length={view.run.max_completion_length}: "
            "if the reward reads the end of the answer, raise it or end answers with rollout.stop_strings"
        )
    best = max((r for _, r in view.rewards), default=None)
    if constant and reward is not None and reward == 0:
        fix = (
            "every completion scores 0: check a few completions in samples.jsonl against the reward "
            "function (does it ever pay?), give the model an example of the answer's form "
            "(data.few_shot), or pay partial credit; then " + fix
        )
    elif (
        reward is not None
        and best is not None
        and reward >= best
        and best
        > (_mean(r for _, r in view.rewards[: limits.window]) or 0.0)  # it rose to get here
    ):
        fix = (
            "if the reward is at its best (it is the highest seen), the task is learned at this "
            "difficulty: stop, or make it harder; otherwise " + fix
        )
    elif not constant:
        fix = (
            "the rewards differ between prompts but not within a group (each prompt always or never "
            "solved): " + fix
        )
    return Finding(
        "warning",
        f"no learning signal: in {share} all {G} completions got the same reward, so every advantage "
        "is 0 and the update changes nothing",
        evidence,
        fix,
    )


def zero_loss(view: View) -> Finding | None:
    """The logged loss is 0 (within health.zero_loss_tolerance in 8 of the last health.window
    steps) while the gradient is not: with one optimizer pass (num_iterations 1) the ratio is 1,
    with beta 0 there is no KL term, and each group's advantages sum to 0, so the loss is a mean
    of advantages. A note: nothing is wrong."""
    run, limits = view.run, view.limits
    if (
        run.num_iterations != 1
        or run.beta != 0
        or run.entropy_coef != 0
        or run.advantage_estimator == "gae"
        or run.policy_loss != "clipped"
    ):
        return None
    rows = list(view.rows[-limits.window :])
    if len(rows) < limits.window:
        return None
    zero = [
        r
        for r in rows
        if (x := num(r, "loss")) is not None and abs(x) <= limits.zero_loss_tolerance
    ]
    learning = [
        r for r in zero if (num(r, "grad_norm") or 0) > 0 and (num(r, "reward_std") or 0) > 0
    ]
    if len(zero) < 0.8 * len(rows) or not learning:
        return None
    return Finding(
        "note",
        "the logged loss is 0 by construction, not because nothing is learned: with one optimizer pass "
        "per batch (algorithm.num_iterations 1) the ratio is 1, with beta 0 there is no KL term, and each "
        "group's advantages sum to 0, so the loss is a weighted mean of the advantages; its gradient is "
        "not 0",
        f"|loss| <= {g(limits.zero_loss_tolerance)} in {len(zero)} of {steps(rows)}, while grad_norm is "
        f"{g(num(learning[-1], 'grad_norm'))} and reward_std {g(num(learning[-1], 'reward_std'))}",
        "nothing to fix: read reward, reward_std and frac_reward_zero_std to see learning (the loss moves "
        "with algorithm.num_iterations > 1 or beta > 0)",
    )


def all_truncated(view: View) -> Finding | None:
    """Every completion (health.truncated_share of them) is cut at max_completion_length for
    health.patience steps while algorithm.mask_truncated_completions leaves cut completions out of
    the loss: nothing is trained. (Cut completions that are trained on are not a fault in
    themselves: a one-token answer is cut by design; when every group is also scored alike,
    no_learning_signal says so.)"""
    limits, run = view.limits, view.run
    if not run.mask_truncated_completions:
        return None
    cut = view.trailing(_at_least("completions/clipped_ratio", limits.truncated_share))
    if len(cut) < view.needs(limits.patience):
        return None
    length = run.max_completion_length
    return Finding(
        "error",
        f"nothing is trained: every completion is cut at max_completion_length={length} and "
        "algorithm.mask_truncated_completions leaves cut completions out of the loss",
        f"completions/clipped_ratio {g(num(view.row, 'completions/clipped_ratio'))} over {_span(cut)}",
        f"raise rollout.max_completion_length (now {length}), end answers with rollout.stop_strings, ask "
        "for a shorter answer in the prompt, or set algorithm.mask_truncated_completions: false",
        explains=("no_learning_signal", "zero_loss", "entropy_collapse", "entropy_blowup"),
    )


def reward_failing(view: View) -> Finding | None:
    """A reward function that fails (raises or times out: rewards/<f>/errors, /timeouts), or
    gives no reward to more than health.reward_missing_share of the batch (rewards/<f>/missing;
    a run logged before that metric: rewards/<f>/mean missing, None for every completion), in
    each of health.patience steps."""
    limits, failing = view.limits, []
    for name in view.reward_names():
        mean, errors, timeouts, missing = (
            f"rewards/{name}/{k}" for k in ("mean", "errors", "timeouts", "missing")
        )

        def fails(row: Row, mean=mean, errors=errors, timeouts=timeouts, missing=missing) -> bool:
            unscored = (num(row, missing) or 0) > limits.reward_missing_share
            failed = (num(row, errors) or 0) + (num(row, timeouts) or 0) > 0
            return _missing(row, mean) or unscored or failed

        run = view.trailing(fails)
        if len(run) >= view.needs(limits.patience):
            failing.append((name, run))
    if not failing:
        return None
    parts, fixes = [], []
    for name, run in failing:
        errors = sum(num(r, f"rewards/{name}/errors") or 0 for r in run)
        timeouts = sum(num(r, f"rewards/{name}/timeouts") or 0 for r in run)
        scored_none = all(_missing(r, f"rewards/{name}/mean") for r in run)
        share = max(num(r, f"rewards/{name}/missing") or 0 for r in run)
        what = (
            "no completion scored"
            if scored_none
            else f"up to {share:.0%} of completions unscored (None or a failed call)"
        )
        parts.append(
            f"{name}: {what} over {_span(run)}, {int(errors)} failed calls, {int(timeouts)} timed out"
        )
        if timeouts:
            fixes.append(f"{name} times out: raise rewards.timeout or make it faster")
        if errors:
            fixes.append(
                f"{name} raises: the console shows its first traceback; fix it (rewards/{name}/errors counts them)"
            )
        if not errors and not timeouts:
            fixes.append(
                f"{name} returns None for {'every' if scored_none else 'most'} completion"
                f"{'' if scored_none else 's'}: None means 'does not apply'; return a number (0.0 for a "
                "wrong answer) where it should score"
            )
    weighted = any(view.weight(name) != 0 for name, _ in failing)
    return Finding(
        "error" if weighted else "warning",
        "a reward function gives no reward: "
        + ", ".join(name for name, _ in failing)
        + (
            " (its completions are missing a reward, not scored 0)"
            if weighted
            else " (logged only, weight 0)"
        ),
        "; ".join(parts),
        "; ".join(fixes),
        explains=("no_learning_signal", "zero_loss", "constant_reward"),
    )


def constant_reward(view: View) -> Finding | None:
    """A weighted reward function that gives every completion of the batch the same value for
    health.window steps while the total reward still varies: it adds nothing to the advantages.
    (When it is the only signal, no_learning_signal names it.)"""
    limits, constant = view.limits, []
    for name in view.reward_names():
        if view.weight(name) == 0:
            continue
        run = view.trailing(lambda r, name=name: num(r, f"rewards/{name}/std") == 0)
        if len(run) >= view.needs(limits.window) and any(
            (num(r, "reward_std") or 0) > 0 for r in run
        ):
            constant.append((name, run))
    if not constant:
        return None
    return Finding(
        "warning",
        "a reward function is constant, so it adds nothing to the advantages: "
        + ", ".join(name for name, _ in constant),
        "; ".join(
            f"rewards/{name}/std 0 over {_span(run)} (always {g(num(view.row, f'rewards/{name}/mean'))})"
            for name, run in constant
        ),
        "read a few completions in samples.jsonl with their rewards: a function that never moves is "
        "broken (a wrong column, a parse that always fails) or cannot be met by this model yet; fix it or "
        "drop it from rewards.funcs",
    )


def _entropy(row: Row) -> float | None:
    """The step's token entropy, None when no token was in the loss (every completion masked: the
    update logs an entropy of exactly 0 and a gradient norm of 0)."""
    entropy = num(row, "entropy")
    if entropy == 0 and num(row, "grad_norm") == 0:
        return None
    return entropy


def entropy_collapse(view: View) -> Finding | None:
    """Token entropy below health.entropy_floor for health.patience steps while at least
    health.collapse_zero_spread_share of the groups have zero reward spread: the policy samples
    the same completion for every try, so nothing is explored."""
    limits = view.limits
    run = view.trailing(lambda r: (x := _entropy(r)) is not None and x < limits.entropy_floor)
    if len(run) < view.needs(limits.patience):
        return None
    share = _mean(num(r, "frac_reward_zero_std") for r in run)
    if share is None or share < limits.collapse_zero_spread_share:
        return None
    return Finding(
        "warning",
        "entropy collapse: the policy is near-deterministic, so a group's completions are alike and "
        "nothing new is tried",
        f"entropy {g(num(view.row, 'entropy'))} (< {g(limits.entropy_floor)}) over {_span(run)}, "
        f"{share:.0%} of groups with zero reward spread",
        f"raise rollout.temperature (now {g(view.run.temperature)}), add an entropy bonus "
        "(algorithm.entropy_coef, or use_adaptive_entropy with entropy_target), let rare tokens grow with "
        "clip-higher (algorithm.epsilon_high: 0.28), or lower training.learning_rate; if the reward is at "
        "its best, the task is learned",
        explains=("no_learning_signal", "zero_loss"),
    )


def entropy_blowup(view: View) -> Finding | None:
    """Token entropy above health.entropy_blowup_ratio times the run's early median (at least
    health.entropy_floor) for health.patience steps: the policy is spreading toward noise."""
    limits = view.limits
    if len(view.early) < limits.window or _step(view.row) <= _step(view.early[-1]):
        return None
    base = _median(_entropy(r) for r in view.early)
    if base is None or base <= 0:
        return None
    # against at least entropy_floor: a collapsed policy's entropy of 1e-10 tripling is no blow-up
    high = limits.entropy_blowup_ratio * max(base, limits.entropy_floor)
    run = view.trailing(lambda r: (x := _entropy(r)) is not None and x > high)
    if len(run) < view.needs(limits.patience):
        return None
    return Finding(
        "warning",
        "entropy blow-up: the policy's token distribution is spreading toward noise",
        f"entropy {g(num(view.row, 'entropy'))} over {_span(run)}, {g(num(view.row, 'entropy') / base)}x "
        f"the median {g(base)} of {steps(view.early)}",
        "lower training.learning_rate, lower or drop the entropy bonus (algorithm.entropy_coef, "
        f"entropy_target), lower rollout.temperature (now {g(view.run.temperature)}); read samples.jsonl "
        "for gibberish",
    )


def kl_runaway(view: View) -> Finding | None:
    """KL to the reference above health.kl_max nats per token for health.patience steps (only
    with beta > 0, where kl is logged)."""
    limits = view.limits
    run = view.trailing(_above("kl", limits.kl_max))
    if len(run) < view.needs(limits.patience):
        return None
    return Finding(
        "warning",
        "KL runaway: the policy has moved far from the reference model",
        f"kl {g(num(view.row, 'kl'))} nats/token (> {g(limits.kl_max)}) over {_span(run)}, beta {g(view.run.beta)}",
        f"raise algorithm.beta (now {g(view.run.beta)}) or lower training.learning_rate; if the drift is "
        "wanted, refresh the reference (algorithm.ref_sync_steps); read samples.jsonl for reward hacking",
    )


def clip_ratio_high(view: View) -> Finding | None:
    """The share of clipped tokens (clip_ratio/region_mean) above health.clip_ratio_max for
    health.patience steps: the update is pinned at the trust region's edge."""
    limits = view.limits
    run = view.trailing(_above("clip_ratio/region_mean", limits.clip_ratio_max))
    if len(run) < view.needs(limits.patience):
        return None
    return Finding(
        "warning",
        "the clip ratio is pinned high: most of the update is cut at the trust region's edge",
        f"clip_ratio/region_mean {g(num(view.row, 'clip_ratio/region_mean'))} (> {g(limits.clip_ratio_max)}) "
        f"over {_span(run)}, num_iterations {view.run.num_iterations}",
        "lower training.learning_rate or algorithm.num_iterations (each pass moves the policy further "
        "from the one that sampled); with a rollout engine whose logprobs differ from the trainer's, set "
        "algorithm.rollout_correction",
    )


def rollout_wait(view: View) -> Finding | None:
    """Generating ahead of training (rollout.max_staleness > 0) that does not overlap: the trainer
    waited for the generator (time/wait_for_rollout: for a batch, or for the push the generator
    makes before the batches it samples) for more than health.rollout_wait_share of its step's
    time (time/step) for health.patience steps."""
    limits = view.limits

    def waits(row: Row) -> bool:
        wait, total = num(row, "time/wait_for_rollout"), num(row, "time/step")
        return wait is not None and total is not None and wait > limits.rollout_wait_share * total

    run = view.trailing(waits)
    if len(run) < view.needs(limits.patience):
        return None
    generate, step = num(view.row, "time/generate"), num(view.row, "time/step")
    return Finding(
        "warning",
        "generating ahead does not overlap: the trainer waits for the generation server most of each step",
        f"time/wait_for_rollout {g(num(view.row, 'time/wait_for_rollout'))} s of time/step {g(step)} s "
        f"(> {limits.rollout_wait_share:.0%}) over {_span(run)}, time/generate {g(generate)} s a batch, "
        f"time/weight_sync {g(num(view.row, 'time/weight_sync'))} s a push",
        "generation (with the push of the weights) is slower than the update, so overlapping them cannot "
        "hide it: give the server more compute (a GPU, `grpo serve --engine vllm`, a server of its own), "
        "or generate less per step (rollout.num_generations, rollout.max_completion_length); when the "
        "push is most of it, push less often (rollout.weight_sync_steps); if the server is slowed by "
        "other work, free it; a larger rollout.max_staleness only absorbs uneven steps",
    )


def stale_ratio_drift(view: View) -> Finding | None:
    """Generating ahead of training (async/staleness_max logged and above 0): the sampler's policy
    drifts too far from the trained one for its batches to be trusted. The share of tokens whose
    importance weight against the sampler was cut (rollout/is_capped_ratio) above
    health.capped_share_max, or the clip ratio (clip_ratio/region_mean) above
    health.clip_ratio_max, for health.patience steps."""
    limits = view.limits

    def drifts(row: Row) -> bool:
        stale = num(row, "async/staleness_max")
        capped, clipped = num(row, "rollout/is_capped_ratio"), num(row, "clip_ratio/region_mean")
        return (
            stale is not None
            and stale > 0
            and (
                (capped is not None and capped > limits.capped_share_max)
                or (clipped is not None and clipped > limits.clip_ratio_max)
            )
        )

    run = view.trailing(drifts)
    if len(run) < view.needs(limits.patience):
        return None
    row = view.row
    return Finding(
        "warning",
        "the policy moves too far between the weights that sampled a batch and the trained ones: "
        "its importance ratios drift out of bounds",
        f"rollout/is_capped_ratio {g(num(row, 'rollout/is_capped_ratio'))} (> {g(limits.capped_share_max)}), "
        f"clip_ratio/region_mean {g(num(row, 'clip_ratio/region_mean'))} (> {g(limits.clip_ratio_max)}), "
        f"async/staleness_max {g(num(row, 'async/staleness_max'))} over {_span(run)}",
        "lower rollout.max_staleness (each step of staleness lets the policy move further from the sampler) "
        "or training.learning_rate; keep algorithm.rollout_correction on (auto)",
        explains=("clip_ratio_high",),
    )


def grad_norm_spike(view: View) -> Finding | None:
    """This step's gradient norm above health.grad_norm_spike_ratio times the median of the
    health.window steps before it (steps with a zero norm, which trained nothing, left out; at
    least half of them must remain)."""
    limits = view.limits
    now = num(view.row, "grad_norm")
    before = [
        x
        for r in view.rows[:-1][-limits.window :]
        if (x := num(r, "grad_norm")) is not None and x > 0
    ]
    if now is None or len(before) < max(2, limits.window // 2):
        return None
    median = statistics.median(before)
    if now <= limits.grad_norm_spike_ratio * median:
        return None
    clipped = view.run.max_grad_norm
    return Finding(
        "warning",
        "a gradient-norm spike",
        f"grad_norm {g(now)} at step {view.step}, {g(now / median)}x the median {g(median)} of "
        f"{steps(view.rows[:-1][-limits.window :])}",
        (
            f"training.max_grad_norm={g(clipped)} clipped the step; "
            if clipped > 0
            else "training.max_grad_norm is 0, so nothing clipped it: set it to 1.0; "
        )
        + "read that step's completions and rewards (samples.jsonl) for an outlier; lower "
        "training.learning_rate if spikes recur",
    )


def nonfinite_updates(view: View) -> Finding | None:
    """The step skipped an optimizer pass whose loss or gradient was NaN or inf
    (train/skipped_updates > 0); max_consecutive_skips of them in a row stop the run."""
    skipped = num(view.row, "train/skipped_updates") or 0
    if skipped <= 0:
        return None
    total = num(view.row, "train/skipped_updates_total")
    return Finding(
        "error",
        "non-finite updates: an optimizer pass had a NaN or inf loss or gradient and was skipped "
        "(the weights are as before it)",
        f"train/skipped_updates {int(skipped)} at step {view.step}"
        + (f", {int(total)} in the run" if total is not None else ""),
        "lower training.learning_rate; keep training.max_grad_norm > 0; look for inf or huge values in the "
        "rewards; run once with training.bf16: false to see whether bf16 overflows",
    )


def heldout_not_improving(view: View) -> Finding | None:
    """Likely reward hacking: the training reward rose by health.reward_rise between two held-out
    evaluations while the held-out score gained no more than health.heldout_min_gain (needs two
    evaluations at least health.window steps apart: eval.every, or eval.before and eval.after,
    which is judged after the last step)."""
    limits = view.limits
    points = [p for p in view.evaluations if math.isfinite(p.score)]
    if len(points) < 2:
        return None
    first, last = points[0], points[-1]
    if last.step - first.step < limits.window:
        return None
    before, after = _reward_at(view, first.step), _reward_at(view, last.step)
    if before is None or after is None or after - before < limits.reward_rise:
        return None
    gain = last.score - first.score
    if gain > limits.heldout_min_gain:
        return None
    return Finding(
        "warning",
        "likely reward hacking: the training reward rises while the held-out score does not",
        f"training reward {g(before)} -> {g(after)} (steps around {first.step} and {last.step}), held-out "
        f"{first.decoding} score {g(first.score)} at step {first.step} -> {g(last.score)} at step {last.step}",
        "read samples.jsonl for what the reward pays for: make it check the answer itself, not its form "
        "or length alone, or add a penalty for the shortcut; evaluate more often (eval.every) to see when "
        "they part",
    )


def length_hacking(view: View) -> Finding | None:
    """Likely reward hacking through length: the mean completion length has grown
    health.length_growth-fold from the run's first health.window steps to within
    health.length_cap_share of max_completion_length, while the reward rose by health.reward_rise."""
    limits, cap = view.limits, view.run.max_completion_length
    recent = view.recent()
    if not recent:
        return None
    early_length = _mean(num(r, "completions/mean_length") for r in view.early)
    length = _mean(num(r, "completions/mean_length") for r in recent)
    early_reward = _mean(num(r, "reward") for r in view.early)
    reward = _mean(num(r, "reward") for r in recent)
    if None in (early_length, length, early_reward, reward) or early_length <= 0:
        return None
    if (
        length < limits.length_cap_share * cap
        or length < limits.length_growth * early_length
        or reward - early_reward < limits.reward_rise
    ):
        return None
    return Finding(
        "warning",
        "likely reward hacking through length: completions grow to the length cap as the reward rises",
        f"completions/mean_length {g(early_length)} over {steps(view.early)} -> {g(length)} over "
        f"{steps(recent)} (max_completion_length {cap}), reward {g(early_reward)} -> {g(reward)}",
        "check whether longer completions score higher for the wrong reason (samples.jsonl); add DAPO's "
        "overlong penalty (rewards.overlong_buffer), aggregate by tokens (algorithm.loss_type: dapo or "
        "dr_grpo, which do not favour long wrong answers as grpo's per-sequence mean does), or set "
        "algorithm.mask_truncated_completions: true",
    )


def reward_tradeoff(view: View) -> Finding | None:
    """Likely reward hacking between objectives: one weighted reward function's mean rose by
    health.reward_rise from the run's first health.window steps to its last while another fell
    by as much."""
    limits = view.limits
    recent = view.recent()
    names = [n for n in view.reward_names() if view.weight(n) != 0]
    if not recent or len(names) < 2:
        return None
    change = {}
    for name in names:
        a = _mean(num(r, f"rewards/{name}/mean") for r in view.early)
        b = _mean(num(r, f"rewards/{name}/mean") for r in recent)
        if a is not None and b is not None:
            change[name] = (a, b)
    up = [n for n, (a, b) in change.items() if b - a >= limits.reward_rise]
    down = [n for n, (a, b) in change.items() if a - b >= limits.reward_rise]
    if not up or not down:
        return None
    shown = ", ".join(f"{n} {g(change[n][0])} -> {g(change[n][1])}" for n in up + down)
    return Finding(
        "warning",
        f"the reward functions pull apart: {', '.join(up)} rises while {', '.join(down)} falls",
        f"{shown} ({steps(view.early)} -> {steps(recent)})",
        "the run buys one objective with the other: re-balance rewards.weights, or normalise each "
        "function in its group before summing (algorithm.multi_objective_aggregation: normalize_then_sum)",
    )


def _lr_floor(view: View) -> float:
    resolution = WEIGHT_DTYPE_RESOLUTION.get(
        view.run.weight_dtype, WEIGHT_DTYPE_RESOLUTION["float32"]
    )
    return resolution * view.limits.weight_scale


def lr_too_small(view: View) -> Finding | None:
    """A learning rate that changes nothing: every learning rate of the run so far (its first
    and its recent health.patience steps at least) below the step a weight of health.weight_scale
    can take in its dtype. AdamW moves each weight by about the learning rate per step, whatever
    the gradient's size; a change below a quarter of the dtype's epsilon times the weight is
    rounded away."""
    limits = view.limits
    seen = {_step(r): num(r, "learning_rate") for r in [*view.early, *view.rows]}
    if len(seen) < limits.patience or any(lr is None for lr in seen.values()):
        return None
    floor, highest = _lr_floor(view), max(seen.values())
    if highest >= floor:
        return None
    dtype = view.run.weight_dtype
    return Finding(
        "error",
        f"the learning rate changes nothing: a weight of about {g(limits.weight_scale)} held in {dtype} "
        f"changes only by steps above {g(floor)}, and AdamW steps each weight by about the learning rate",
        f"learning_rate at most {g(highest)} over {len(seen)} steps",
        "raise training.learning_rate (fine-tuning uses 1e-6 to 1e-5, LoRA 1e-5 to 1e-3)"
        + (
            "; or hold the weights in float32 (model.dtype: float32 with training.bf16: true computes in "
            "bf16 over float32 master weights)"
            if dtype != "float32"
            else ""
        ),
    )


def lr_too_large(view: View) -> Finding | None:
    """A learning rate above health.max_relative_update times health.weight_scale: AdamW moves
    each weight by about the learning rate per step, so each step would move a typical weight by
    several times its own size."""
    limits = view.limits
    lr = num(view.row, "learning_rate")
    if lr is None or lr <= limits.max_relative_update * limits.weight_scale:
        return None
    skipped = num(view.row, "train/skipped_updates_total")
    return Finding(
        "warning",
        f"the learning rate is too large: AdamW moves each weight by about the learning rate per step, "
        f"{g(lr / limits.weight_scale)}x a typical weight ({g(limits.weight_scale)})",
        f"learning_rate {g(lr)} at step {view.step}, grad_norm {g(num(view.row, 'grad_norm'))}"
        + (f", {int(skipped)} updates skipped so far" if skipped else ""),
        "lower training.learning_rate (fine-tuning uses 1e-6 to 1e-5, LoRA 1e-5 to 1e-3)",
        explains=(
            "grad_norm_spike",
            "entropy_blowup",
            "entropy_collapse",
            "kl_runaway",
            "clip_ratio_high",
            "no_learning_signal",
            "zero_loss",
        ),
    )


READS_TIMES = frozenset({"time/step", "time/wait_for_rollout"})
"""The only timings a check reads (rollout_wait): a check that reads them fires by how long things
took, so its health/* metric may differ between two runs of the same config."""

READS_EVALUATIONS = ("heldout_not_improving",)
"""The checks that read the held-out evaluations: judged once more after the last step, with every
evaluation (the `after` one too); under torchrun only rank 0 holds the results, so they never
stop a run of several processes (health.fail_on), which must stop on every rank at once."""
