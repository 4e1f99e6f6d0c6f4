"""Generation ahead of training (rollout.max_staleness = k > 0): asynchronous GRPO on a fixed
schedule, a rollout source (grpo.training.source) around the run's `server` engine.

The batch of step s (counted from 1) is sampled from the weights after step

    v(s) = N * ceil(max(0, s - 1 - k) / N)          N = rollout.weight_sync_steps (1: max(0, s - 1 - k))

the oldest weights pushed to the generation server that are at most k steps behind the step
(after step 0: the initial weights). The schedule does not depend on timing, so the same config
run twice, or killed and resumed, trains on the same batches.

In the trainer's thread:

    next_batch(step)       the oldest batch drawn, waited for (time/wait_for_rollout)
    pause()                before the update changes the weights: waits until a push due has
                           read them
    policy_changed(model)  after step t, if N divides t: draws the batches the weights after
                           step t sample (none drawn: no push)

In the generator thread (`_generate_loop`), the drawn batches in order: a batch sampled from
newer weights than the server holds first has them pushed (the trainer's, unchanged since step
t), then each batch is generated from the weights the server holds.

The push of step t's weights thus runs beside the first phases of step t + 1 (its batch taken,
its rewards), which read the weights and change nothing; the server holds one version at a
time, so it comes after every batch drawn before it is generated.

Prompts and per-prompt seeds are drawn in batch order, in the trainer's thread, at those fixed
points (the train state's sampler and generator), and encoded there; each batch keeps where it
was drawn (its reward seed and trainer_state come from it, grpo.training.state.DrawnAt), the step
whose weights sample it and the generator's seconds for it. At most k + 1 batches are drawn and
not yet trained. A push's time/weight_sync and weight_sync/bytes are the row of the step it ran
beside (step t + 1's for step t's push; an evaluation's push, the next step's).

A checkpoint (`state_dict`) first waits for the drawn batches to be generated, then holds them:
row indices, seeds, where drawn, the weights' step, the rollouts' tensors (plain types and
tensors: train_state.pt is read with weights_only=True), and the metrics of a push not yet in a
row; `restored` continues them, checked as untrusted input. Held-out evaluation generates through
`evaluation_engine`, which first has the server hold the trainer's weights (pushing them when
the schedule leaves the server older ones).

Faults: every wait is bounded (rollout.server.request_timeout per batch, weight_sync_timeout per
exchange of a push); a generation that fails, or a push, is raised as `GeneratorStopped` (a
ServerError) at the next `next_batch`, where the step is whole: the trainer saves a checkpoint
there and stops with one line. A batch left
ungenerated is generated after --resume from the weights the run resumes with (its
`sampled_from` says so). A generation slower than training: the trainer waits and says so once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from grpo.config.errors import ConfigError
from grpo.rollout.server_http import ServerError
from grpo.rollout.types import Rollout, SamplingParams
from grpo.run import faults
from grpo.training.sampling import Generated, Sampler, decode_completions
from grpo.training.source import PromptDraw
from grpo.training.state import DrawnAt

log = logging.getLogger(__name__)

STATE_FORMAT = 1
"""The version of `state_dict`'s layout."""
SAY_WAITING_AFTER = 30.0
"""Seconds of one wait for the generator after which the trainer says, once per run, that it waits."""
POLL_SECONDS = 0.5
"""How often the idle generator looks whether it was closed."""
PUSH_EXCHANGES = 4
"""A push's exchanges, each bounded by rollout.server.weight_sync_timeout (the group opened, the
push started, the buckets sent, the push finished)."""
MAX_HELD_PUSHES = 4
"""Most pushes whose metrics a checkpoint holds (one, by the schedule; an evaluation's besides)."""
ROLLOUT_TENSORS = {
    "prompt_ids": torch.long,
    "prompt_mask": torch.long,
    "completion_ids": torch.long,
    "completion_mask": torch.long,
    "truncated": torch.bool,
    "sampling_logprobs": torch.float32,
}
"""A rollout as a checkpoint holds it: each tensor and its dtype (sampling_logprobs may be None)."""


class GeneratorStopped(ServerError):
    """Generating ahead stopped (the server lost, a request past its timeout): raised by
    `next_batch`, where the trainer's step is whole, so the trainer can save it."""


def scheduled_step(index: int, max_staleness: int, sync_every: int) -> int:
    """The step whose weights sample the batch of 0-based step `index` (the module's v(s), s = index + 1)."""
    behind = max(0, index - max_staleness)
    return sync_every * math.ceil(behind / sync_every)


def last_drawable(pushed: int, max_staleness: int, sync_every: int) -> int:
    """The last 0-based step whose batch the weights of step `pushed` (or older) sample."""
    return max_staleness + sync_every * (pushed // sync_every)


@dataclass
class AheadBatch:
    """One batch of the schedule: the 0-based step it is for, its rows (indices into the training
    rows), seeds and where drawn, the step whose weights sample it (`version`); its prompts
    encoded; once generated, its rollout, the step whose weights sampled it and the generator's
    seconds."""

    index: int
    indices: list[int]
    seeds: list[int]
    drawn: DrawnAt
    version: int
    prompts: list[list[int]] | None = None
    rollout: Rollout | None = None
    sampled_from: int | None = None
    seconds: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        rollout = None
        if self.rollout is not None:
            rollout = {
                name: None if t is None else t.detach().cpu()
                for name in ROLLOUT_TENSORS
                for t in [getattr(self.rollout, name)]
            }
        return {
            "index": self.index,
            "indices": list(self.indices),
            "seeds": list(self.seeds),
            "drawn": [self.drawn.step, self.drawn.epoch, self.drawn.position],
            "sampled_from": self.sampled_from,
            "seconds": float(self.seconds),
            "rollout": rollout,
        }


class AheadSource:
    """The rollout source that generates ahead of training (see the module's docstring): `draw`
    (the train state's prompt sampler and seed generator), `sample` (its `server` engine, prompt
    encoder and tokenizer), `params`, G, `max_staleness`, `sync_every` (weight_sync_steps),
    `max_steps`, `request_timeout` (a batch's bound), `push_timeout` (a push exchange's), and the
    trained steps so far (`step`); `restored`: a `state_dict` to continue."""

    def __init__(
        self,
        draw: PromptDraw,
        sample: Sampler,
        params: SamplingParams,
        num_generations: int,
        model: torch.nn.Module,
        *,
        max_staleness: int,
        sync_every: int,
        max_steps: int,
        request_timeout: float,
        push_timeout: float,
        step: int = 0,
        restored: dict | None = None,
    ):
        self.draw, self.sample, self.params = draw, sample, params
        self.num_generations, self.model = num_generations, model
        self.max_staleness, self.sync_every, self.max_steps = max_staleness, sync_every, max_steps
        self.request_timeout, self.push_timeout = request_timeout, push_timeout
        self.engine.recovers = False  # its weights are not the trainer's: a lost server stops it
        self.trained = step
        """Steps trained; the server holds the weights after step `held` (a batch drawn for newer
        ones: a push is due)."""
        self.held = step  # the engine pushed the weights it starts with
        self.pushes: list[tuple[int, dict[str, float]]] = []
        """(the step whose weights were pushed, the push's metrics), not yet in a row."""
        self.queue: deque[AheadBatch] = deque()
        self.next_index = step
        if restored is not None:
            self._restore(restored, step)
        self.cond = threading.Condition()
        self.failure: BaseException | None = None
        self.closed = False
        self.thread: threading.Thread | None = None
        self.metrics: dict[str, float] = {}
        self.busy = self.waited = 0.0
        self.said_waiting = False

    @property
    def engine(self):
        return self.sample.engine

    @property
    def evaluation_engine(self):
        """The engine as held-out evaluation uses it: the server first holds the trainer's weights."""
        return _CurrentWeights(self)

    # ------------------------------------------------------------------ the trainer's side

    def next_batch(self, step: int) -> Generated:
        if self.thread is None:
            self._start()
        with self.cond:
            self._wait(
                lambda: self.queue and self.queue[0].rollout is not None, f"step {step + 1}'s batch"
            )
            self._raise_failure()
            batch = self.queue.popleft()
        if batch.index != step:
            raise RuntimeError(
                f"the batch generated ahead is step {batch.index}'s, not step {step}'s"
            )
        rows = [self.draw.rows[i] for i in batch.indices]
        ids, texts = decode_completions(batch.rollout, self.sample.tokenizer)
        staleness = float(batch.index - batch.sampled_from)
        self.metrics.update(
            {
                "async/staleness_mean": staleness,  # one batch a step: every completion's is the same
                "async/staleness_max": staleness,
                "time/generate": batch.seconds,
            }
        )
        return Generated(
            rows,
            batch.rollout,
            ids,
            texts,
            drawn=batch.drawn,
            sampled_from=batch.sampled_from,
            generate_seconds=batch.seconds,
        )

    def pause(self) -> None:
        """Before the update changes the weights: a push due has read them (generation goes on
        while the update runs: the server's memory is its own). A failure is left for the next
        batch, where the step is whole."""
        with self.cond:
            self._wait(lambda: not self._push_due(), "the weights' push", raising=False)

    def policy_changed(self, model: torch.nn.Module) -> None:
        """After a step: on every weight_sync_steps-th, the batches the new weights sample drawn;
        the generator pushes the weights before it generates them."""
        self.trained += 1
        if self.trained % self.sync_every or self.failure is not None:
            return
        with self.cond:
            if self._draw_ready(self.trained):
                self.cond.notify_all()

    def take_metrics(self) -> dict[str, float]:
        """The step's: the batch's staleness (steps between the weights that sampled it and the
        trained ones), time/generate (the generator's seconds for it), time/wait_for_rollout (the
        trainer idle, waiting for the generator), time/overlap (the share of the generator's work
        during the step, generating and pushing, that the trainer did not wait for; null when it
        did none: a timing, named under time/ as the others are) and the pushes done before the
        step's end (time/weight_sync, weight_sync/bytes)."""
        with self.cond:
            busy, waited = self.busy, self.waited
            self.busy = self.waited = 0.0
            # the pushes before this step's end: done (the update waited for them); this step's
            # own push is the next row's, whether or not it is done yet
            done = [m for version, m in self.pushes if version < self.trained]
            self.pushes = [(v, m) for v, m in self.pushes if v >= self.trained]
        metrics = _summed(done)
        metrics.update(self.metrics)
        self.metrics = {}
        metrics["time/wait_for_rollout"] = waited
        metrics["time/overlap"] = max(0.0, busy - waited) / busy if busy > 0 else math.nan
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The batches drawn and not yet trained, once the generator finished them (a failure
        leaves some ungenerated: generated after --resume from the weights resumed)."""
        with self.cond:
            if self.failure is None:
                self._wait(self._all_generated, "the batches drawn", raising=False)
            return {
                "format": STATE_FORMAT,
                "next_index": self.next_index,
                "batches": [b.state_dict() for b in self.queue],
                "pushes": [[v, dict(m)] for v, m in self.pushes],
            }

    def close(self) -> None:
        """The generator stopped (at the end of training)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=POLL_SECONDS * 2)

    def hold_current_weights(self) -> None:
        """The server holds the trainer's weights (for an evaluation): pushed when it holds older
        ones, which the schedule never needs again then (it samples only from later pushes)."""
        with self.cond:
            self._wait(self._all_generated, "the batches drawn")
            if self.held == self.trained:
                return
        if (
            self.next_index < self.max_steps
            and scheduled_step(self.next_index, self.max_staleness, self.sync_every) <= self.trained
        ):
            raise RuntimeError(
                "an evaluation's push would change the weights the schedule samples from"
            )
        self.engine.sync_weights(self.model)  # the generator idle: every batch drawn is generated
        with self.cond:
            self.held = self.trained
            self.pushes.append((self.trained, self.engine.take_metrics()))

    # ------------------------------------------------------------------ scheduling

    def _start(self) -> None:
        with self.cond:
            self._draw_ready(self.held)
        self.thread = threading.Thread(target=self._generate_loop, name="grpo-ahead", daemon=True)
        self.thread.start()

    def _draw_ready(self, version: int) -> int:
        """Draws, in order, every batch the weights after step `version` sample (under the lock);
        how many."""
        last = min(last_drawable(version, self.max_staleness, self.sync_every), self.max_steps - 1)
        drawn_now = 0
        while self.next_index <= last:
            indices, seeds = self.draw.indices()
            drawn = DrawnAt.of(self.next_index, self.draw.sampler)
            batch = AheadBatch(self.next_index, indices, seeds, drawn, version)
            batch.prompts = self.sample.prompts([self.draw.rows[i] for i in indices])
            self.queue.append(batch)
            self.next_index += 1
            drawn_now += 1
        return drawn_now

    def _push_due(self) -> bool:
        """Whether a batch drawn is sampled from newer weights than the server holds."""
        return any(b.version > self.held for b in self.queue)

    def _all_generated(self) -> bool:
        return all(b.rollout is not None for b in self.queue)

    def _wait(self, ready, what: str, raising: bool = True) -> None:
        """Waits (under the lock) until `ready()` or the generator failed, for at most what the
        batches left to generate may take; says so once when it is long. `raising`: a failure
        is raised as GeneratorStopped (else left for the next batch)."""
        start = time.perf_counter()
        left = sum(b.rollout is None for b in self.queue)
        pushes = self._push_due()
        bound = self.request_timeout * max(1, left) + self.push_timeout * PUSH_EXCHANGES * pushes
        bound += 60.0
        while not ready() and self.failure is None:
            waited = time.perf_counter() - start
            if waited > bound:
                self.failure = ServerError(
                    f"rollout.server.request_timeout: the generation server did not deliver {what} within "
                    f"{bound:g} s ({left} batch(es) of at most rollout.server.request_timeout="
                    f"{self.request_timeout:g} s each); continue the run with --resume"
                )
                break
            if waited >= SAY_WAITING_AFTER and not self.said_waiting:
                self.said_waiting = True
                log.warning(
                    "waiting for the generation server: %s not ready after %.0f s; generating (and "
                    "taking the weights) is slower than training here (time/wait_for_rollout in "
                    "metrics.jsonl; each request is bounded by rollout.server.request_timeout=%g s, "
                    "each exchange of a push by rollout.server.weight_sync_timeout=%g s)",
                    what,
                    waited,
                    self.request_timeout,
                    self.push_timeout,
                )
            until_said = SAY_WAITING_AFTER - waited if not self.said_waiting else POLL_SECONDS
            self.cond.wait(timeout=max(0.001, min(POLL_SECONDS, bound - waited, until_said)))
        self.waited += time.perf_counter() - start
        if raising:
            self._raise_failure()

    def _raise_failure(self) -> None:
        """The generator's failure, in the trainer's thread: GeneratorStopped for the server's."""
        error = self.failure
        if isinstance(error, ServerError):
            raise GeneratorStopped(f"while generating ahead of training: {error}") from error
        if error is not None:
            raise RuntimeError(f"generating ahead of training failed: {error!r}") from error

    # ------------------------------------------------------------------ the generator thread

    def _generate_loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and self.failure is None and self._next_to_generate() is None:
                    self.cond.wait(timeout=POLL_SECONDS)
                if self.closed or self.failure is not None:
                    return
                batch = self._next_to_generate()
                version, held, trained = batch.version, self.held, self.trained
            try:
                if version != held:
                    self._push(version, trained)
                    continue
                faults.reached("ahead")  # a batch being generated ahead of training
                start = time.perf_counter()
                rollout = self.engine.generate(
                    batch.prompts, self.num_generations, self.params, batch.seeds
                )
            except BaseException as error:  # noqa: BLE001 (raised in the trainer's thread)
                with self.cond:
                    self.failure = error
                    self.cond.notify_all()
                return
            seconds = time.perf_counter() - start
            with self.cond:
                batch.rollout, batch.sampled_from, batch.seconds = rollout, version, seconds
                self.busy += seconds
                self.cond.notify_all()

    def _push(self, version: int, trained: int) -> None:
        """The weights after step `version` to the server: the trainer's, which the update does
        not change until the push has read them (`pause`)."""
        if trained != version:
            raise RuntimeError(
                f"the weights after step {version} were to be pushed, but the trainer is past step {trained}"
            )
        start = time.perf_counter()
        self.engine.sync_weights(self.model)
        faults.reached("push")  # the server holds them, the trainer does not know yet
        metrics = self.engine.take_metrics()
        with self.cond:
            self.held = version
            self.busy += time.perf_counter() - start
            self.pushes.append((version, metrics))
            self.cond.notify_all()

    def _next_to_generate(self) -> AheadBatch | None:
        return next((b for b in self.queue if b.rollout is None), None)

    # ------------------------------------------------------------------ restore

    def _restore(self, state: dict, step: int) -> None:
        """The queue of a checkpoint (untrusted: checked, else ConfigError naming what is wrong)."""
        try:
            batches = _checked_batches(state, step, self)
            pushes = _checked_pushes(state.get("pushes", []), step)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ConfigError(
                f"--resume: the checkpoint's batches generated ahead (rollout.max_staleness) do not fit "
                f"this run: {type(error).__name__}: {str(error)[:300]}; resume from another checkpoint"
            ) from None
        self.queue.extend(batches)
        self.next_index = state["next_index"]
        self.pushes = pushes
        for batch in self.queue:
            if (
                batch.rollout is None
            ):  # left by a failure: encoded again, generated from the resumed weights
                batch.prompts = self.sample.prompts([self.draw.rows[i] for i in batch.indices])


def _checked_batches(state: dict, step: int, source: AheadSource) -> list[AheadBatch]:
    """A checkpoint's batches, each checked against this run: consecutive steps from `step`, the
    prompts' count, row indices and seeds, the rollout's tensors (dtypes, shapes, token ids)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"format {state.get('format') if isinstance(state, dict) else state!r}")
    raw, next_index = state["batches"], state["next_index"]
    if not isinstance(raw, list) or len(raw) > source.max_staleness + 1:
        raise ValueError(f"{len(raw)} batches, more than max_staleness + 1")
    if not isinstance(next_index, int) or next_index != step + len(raw):
        raise ValueError(f"next batch {next_index!r} after {len(raw)} batches from step {step}")
    num_prompts, rows = source.draw.num_prompts, len(source.draw.rows)
    G = source.num_generations
    vocab = source.engine.vocab
    batches = []
    for offset, item in enumerate(raw):
        index, indices, seeds = item["index"], item["indices"], item["seeds"]
        if index != step + offset:
            raise ValueError(f"batch {offset} is step {index!r}'s, not step {step + offset}'s")
        for name, values, bound in (("row", indices, rows), ("seed", seeds, 2**63)):
            if (
                not isinstance(values, list)
                or len(values) != num_prompts
                or not all(type(v) is int and 0 <= v < bound for v in values)
            ):
                raise ValueError(f"batch {index}: {name}s are not {num_prompts} in [0, {bound})")
        drawn = DrawnAt(*[int(x) for x in item["drawn"]])
        sampled_from, seconds = item["sampled_from"], float(item["seconds"])
        if sampled_from is not None and not (
            type(sampled_from) is int and 0 <= sampled_from <= step
        ):
            raise ValueError(
                f"batch {index}: sampled from step {sampled_from!r}, after step {step}"
            )
        rollout = _checked_rollout(item["rollout"], num_prompts * G, vocab, source)
        if (rollout is None) != (sampled_from is None):
            raise ValueError(f"batch {index}: a rollout without its weights' step, or the reverse")
        # a batch a failure left ungenerated: sampled from the weights resumed
        version = step if sampled_from is None else sampled_from
        batches.append(
            AheadBatch(index, indices, seeds, drawn, version, None, rollout, sampled_from, seconds)
        )
    return batches


def _checked_pushes(raw: Any, step: int) -> list[tuple[int, dict[str, float]]]:
    """A checkpoint's pushes not yet in a row (none in one written before they were kept): each
    the step of its weights and a few named finite numbers."""
    if not isinstance(raw, list) or len(raw) > MAX_HELD_PUSHES:
        raise ValueError(f"pushes: not a list of at most {MAX_HELD_PUSHES}")
    pushes = []
    for item in raw:
        version, metrics = item
        if type(version) is not int or not 0 <= version <= step:
            raise ValueError(f"a push of the weights after step {version!r}, after step {step}")
        if (
            not isinstance(metrics, dict)
            or len(metrics) > 8
            or not all(isinstance(k, str) and len(k) <= 64 for k in metrics)
            or not all(type(v) in (int, float) and math.isfinite(v) for v in metrics.values())
        ):
            raise ValueError("a push's metrics are not a few named finite numbers")
        pushes.append((version, {k: float(v) for k, v in metrics.items()}))
    return pushes


def _checked_rollout(raw, N: int, vocab: int, source: AheadSource) -> Rollout | None:
    if raw is None:
        return None
    tensors = {}
    for name, dtype in ROLLOUT_TENSORS.items():
        t = raw[name]
        if t is None and name == "sampling_logprobs":
            tensors[name] = None
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape[0] != N:
            raise ValueError(f"rollout {name}: not a {dtype} tensor of {N} rows")
        tensors[name] = t
    width = tensors["completion_ids"].shape
    if (
        tensors["prompt_ids"].dim() != 2
        or tensors["prompt_mask"].shape != tensors["prompt_ids"].shape
        or len(width) != 2
        or width[1] > source.params.max_new_tokens
        or tensors["completion_mask"].shape != width
        or tensors["truncated"].shape != (N,)
        or (
            tensors["sampling_logprobs"] is not None and tensors["sampling_logprobs"].shape != width
        )
    ):
        raise ValueError("rollout tensors of mismatched shapes")
    for name in ("prompt_ids", "completion_ids"):
        t = tensors[name]
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise ValueError(f"rollout {name}: token ids outside the vocabulary of {vocab}")
    logprobs = tensors["sampling_logprobs"]
    if logprobs is not None and not torch.isfinite(logprobs).all():
        raise ValueError("rollout sampling_logprobs: not finite")
    device = next(source.model.parameters()).device
    return Rollout(**tensors).to(device)


def _summed(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Several pushes' metrics as one row's: each name's values added up."""
    total: dict[str, float] = {}
    for m in metrics:
        for name, value in m.items():
            total[name] = total.get(name, 0.0) + value
    return total


class _CurrentWeights:
    """The `server` engine as held-out evaluation uses it beside a source generating ahead: each
    generation first has the server hold the trainer's weights (AheadSource.hold_current_weights)."""

    def __init__(self, source: AheadSource):
        self._source = source

    def __getattr__(self, name: str):
        return getattr(self._source.engine, name)

    def generate(self, *args, **kwargs):
        self._source.hold_current_weights()
        return self._source.engine.generate(*args, **kwargs)
