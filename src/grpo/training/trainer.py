"""The GRPO training loop: a run's parts (grpo.training.build), run.

    trainer = Trainer.from_config(cfg)      # the parts built: every bad input fails here
    history = trainer.train()               # one metrics dict per step

Each step is grpo.training.step.train_step; around it the loop keeps the bookkeeping: the step's
metrics (grpo.training.metrics), the callbacks' events, sample completions, held-out evaluations,
checkpoints (grpo.training.saving), the stop signals and output_dir's claim.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

from grpo.config.schema import Config
from grpo.run import checkpoint, faults
from grpo.run.eval_results import EvalResult
from grpo.run.stop_signals import StopSignals
from grpo.training import step
from grpo.training.ahead import GeneratorStopped
from grpo.training.batching import GenerationBatch
from grpo.training.build import RunParts, build_parts, evaluator_of
from grpo.training.callbacks import Callbacks
from grpo.training.evaluate import eval_metrics, held_out_evaluation
from grpo.training.metrics import PhaseTimer
from grpo.training.samples import log_samples
from grpo.training.state import trainer_state
from grpo.training.update import TrainingDiverged

__all__ = ["Trainer", "eval_metrics"]


def _part(name: str) -> property:
    """A run part shown as the trainer's own attribute, read-only (RunParts says what each is)."""
    return property(lambda self: getattr(self.parts, name), doc=f"RunParts.{name}")


class Trainer:
    """Runs a run's parts: the loop, its evaluations and checkpoints. The parts most code reads
    are shown as the trainer's own attributes (below); the rest are `trainer.parts`'."""

    cfg = _part("cfg")
    backend = _part("backend")
    model = _part("model")
    tokenizer = _part("tokenizer")
    state = _part("state")
    task = _part("task")
    log = _part("log")
    rewards = _part("rewards")
    reference = _part("reference")
    critic = _part("critic")
    environments = _part("environments")
    sampler = _part("sampler")
    phases = _part("phases")
    health = _part("health")
    engine = _part("engine")
    sampling = _part("sampling")

    def __init__(
        self,
        parts: RunParts,
        *,
        callbacks: Callbacks | list | None = None,
        extra_evaluation: Callable[[Trainer], dict[str, float]] | None = None,
    ):
        """`callbacks` (grpo.training.callbacks: a Callbacks, or callback objects called with the
        config as `args`) are called at the loop's events. `extra_evaluation(trainer)` adds its
        metrics (as `eval_<name>`) to every evaluation's row (TRL's: evaluate.held_out_group_evaluation).
        A start that fails here gives output_dir up again."""
        if not isinstance(parts, RunParts):
            raise TypeError(
                f"Trainer(parts) takes a run's parts (grpo.training.build.build_parts), got "
                f"{type(parts).__name__}; from a config: Trainer.from_config(cfg, ...)"
            )
        self.parts = parts
        parts.sampler.caller = self  # a rollout_func is called with the trainer
        try:
            self.callbacks = Callbacks.of(callbacks, parts.cfg)
            self.extra_evaluation = extra_evaluation
            self.stopped_by: int | None = None
            """The signal (SIGINT, SIGTERM) that stopped `train` early, after a checkpoint."""
            self.saved: Path | None = None
            """The last checkpoint this trainer wrote."""
            self.trained_steps = self.rewarded_steps = 0
            """Steps `train` ran, and those in which some completion got a reward."""
            self.callbacks.configure(
                parts.cfg, parts.num_prompts, len(parts.task.train_rows), parts.backend.is_main
            )
            self.sync_run_state()
            self.callbacks.objects.update(
                model=parts.model,
                processing_class=parts.tokenizer,
                optimizer=parts.state.optimizer,
                lr_scheduler=parts.state.scheduler,
            )
            self.callbacks.init_end()
        except BaseException:
            parts.output_dir.abandon()
            raise

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        callbacks: Callbacks | list | None = None,
        extra_evaluation: Callable[[Trainer], dict[str, float]] | None = None,
        **inputs,
    ) -> Trainer:
        """The trainer of `cfg`'s run, its parts built by grpo.training.build.build_parts(cfg,
        **inputs) and its rows checked to name an environment when there are several: every bad
        input fails here, before any generation."""
        parts = build_parts(cfg, check_rows=True, **inputs)
        return cls(parts, callbacks=callbacks, extra_evaluation=extra_evaluation)

    def train_step(self) -> tuple[dict[str, float], GenerationBatch]:
        """One GRPO step (grpo.training.step); returns its metrics and its generation batch."""
        timer = PhaseTimer()
        self.parts.metrics.start()
        stats, batch = step.train_step(self.phases, self.state.step, timer)
        self.state.step += 1
        return self.parts.metrics(batch, stats, timer), batch

    def collect_batch(self, timer: PhaseTimer | None = None) -> GenerationBatch:
        """The next scored generation batch (grpo.training.collect), as a step collects it."""
        return self.phases.collect(self.state.step, timer)

    def update(self, batch: GenerationBatch, timer: PhaseTimer | None = None) -> dict[str, float]:
        """The update half of a step on `batch` (grpo.training.step.update), without the sync."""
        return step.update(self.phases, batch, timer or PhaseTimer())

    def train(self) -> list[dict[str, float]]:
        """The loop to max_steps, then final/. SIGINT or SIGTERM stops it at the next step's end with
        a checkpoint (`stopped_by`), a second one at once (Interrupted); output_dir is the run's
        until it returns; a checkpoint the disk cannot take ends it (checkpoint.SaveFailed)."""
        if not self.parts.output_dir.held:  # trained before: claimed again
            self.parts.output_dir.claim()
        try:
            return self._train()
        finally:
            self.parts.output_dir.release()  # the run is over (the report written): the directory is free

    def _train(self) -> list[dict[str, float]]:
        cfg, log, callbacks = self.cfg, self.log, self.callbacks
        history: list[dict[str, float]] = []
        started, first_step = time.monotonic(), self.state.step
        log.start()
        try:
            with StopSignals() as stop:
                self.sync_run_state()
                callbacks.fire("on_train_begin")
                # a resumed run's "before" evaluation is its first run's (eval.jsonl keeps it)
                fresh = cfg.eval.before and self.parts.resumed is None
                before = self._evaluate_and_log("before") if fresh else None
                log.start_training(self.state.step)
                signum, epoch = self._steps(history, stop)
                if signum:
                    self.stopped_by = signum
                    return history
                if not self._finish(before, epoch, stop):
                    return history
                runtime, steps = time.monotonic() - started, self.state.step - first_step
                self.log_row(self.parts.metrics.summary(history, runtime, steps))
                callbacks.fire("on_train_end")
        finally:
            self.parts.close()  # no reward worker, environment's process or generator outlives it
            log.close()
        log.report()
        return history

    def _steps(self, history: list, stop: StopSignals) -> tuple[int | None, int]:
        """Steps to max_steps (or a callback's stop, or a signal's); the signal, and the epoch."""
        cfg, callbacks = self.cfg, self.callbacks
        epoch = self.state.sampler.epoch
        callbacks.fire("on_epoch_begin")
        signum = None
        # asked again after each step's checkpoint: a signal during the save stops the loop there;
        # a run resumed from the checkpoint of a health.fail_on stop is stopped there
        while (
            self.state.step < cfg.training.max_steps
            and not callbacks.control.should_training_stop
            and self.health.stopped is None
            and not (signum := self._stop_signal(stop))
        ):
            callbacks.fire("on_step_begin")
            try:
                metrics, batch = self.train_step()
            except (TrainingDiverged, GeneratorStopped) as error:  # the state saved, if it can be
                saved, done = self.parts.saver.save_last_good()
                self.saved = saved or self.saved
                raise type(error)(f"{error}; {done}") from error
            control = self._log_step(metrics, batch, history)
            step_done = self.state.step
            if (
                cfg.eval.every
                and step_done % cfg.eval.every == 0
                and step_done < cfg.training.max_steps
            ) or control.should_evaluate:
                self._evaluate_and_log(f"step {step_done}")
            faults.reached("logged")
            signum = self._stop_signal(stop)  # under torchrun a collective: asked where it decides
            # last, so that a checkpoint's step has all its logs: resuming cuts them back to it
            periodic = cfg.training.save_steps and step_done % cfg.training.save_steps == 0
            if periodic or signum or callbacks.control.should_save:
                self.save(self.log.dir / f"checkpoint-{step_done}")
                if self.backend.is_main:
                    checkpoint.prune(self.log.dir, cfg.training.save_total_limit)
                callbacks.fire("on_save")
            if self.state.sampler.epoch != epoch:  # the prompt order went round
                epoch = self.state.sampler.epoch
                callbacks.fire("on_epoch_end")
                if not signum and self.state.step < cfg.training.max_steps:
                    callbacks.fire("on_epoch_begin")
        return signum, epoch

    def _log_step(self, metrics: dict, batch: GenerationBatch, history: list):
        """A step's metrics to metrics.jsonl, the history, the callbacks (on_step_end, then its
        log_history row) and, every logging.sample_every steps, its sample completions; returns
        the control on_step_end left."""
        self.trained_steps += 1
        self.rewarded_steps += math.isfinite(metrics["reward"])
        # health/* into this step's row; a health.fail_on check stops the loop after it, saved
        c = self.callbacks
        metrics.update(self.health.observe(metrics, c.state.log_history, c.control))
        self.log.step(metrics)
        history.append(metrics)
        self.sync_run_state()
        control = self.callbacks.fire("on_step_end")
        self.log_row(metrics)
        every, done = self.cfg.logging.sample_every, self.state.step
        if every and (done == 1 or done % every == 0):
            names, G = self.rewards.names, self.cfg.rollout.num_generations
            log_samples(self.log, self.backend, self.tokenizer, names, G, done, batch)
        return control

    def _finish(self, before: list[EvalResult] | None, epoch: int, stop: StopSignals) -> bool:
        """final/, then (unless a signal came during its save) the "after" evaluation and the
        epoch's end; whether training finished."""
        self.saved = self.parts.saver.save_final(self.saved)
        self.callbacks.fire("on_save")
        signum = self._stop_signal(stop)
        if signum:  # came during the save: the evaluation after is left to a resumed run
            self.stopped_by = signum
            return False
        if self.cfg.eval.after:
            after = self._evaluate_and_log("after")
            if before is not None:
                self.log.before_after(before, after)
        if self.state.sampler.epoch == epoch:  # the epoch under way ends with training
            self.callbacks.fire("on_epoch_end")
        return True

    def _stop_signal(self, stop: StopSignals) -> int | None:
        """Any rank's stopping signal: every rank stops after the same step."""
        return max(s or 0 for s in self.backend.all_gather_object(stop.signum)) or None

    def sync_run_state(self) -> None:
        """The callbacks' view of where training is (TRL's units)."""
        a, t = self.cfg.algorithm, self.cfg.training
        progress = trainer_state(self.state, a.num_iterations, t.max_steps)
        self.callbacks.progress(progress.global_step, progress.epoch, self.state.tokens_seen)

    def log_row(self, row: dict[str, Any]) -> None:
        """A row of the callbacks' log_history, then on_log."""
        self.callbacks.log_row(row)

    def evaluate(self, label: str) -> list[EvalResult]:
        """Held-out evaluation (greedy and sampled, as configured); results go to eval.jsonl."""
        if self.parts.evaluator is None and self.task.eval_rows:  # asked for outside the schedule
            self.parts.evaluator = evaluator_of(self.parts)
        return held_out_evaluation(
            self.parts.evaluator, self.log, self.backend, self.model, self.state.step, label
        )

    def _evaluate_and_log(self, label: str) -> list[EvalResult]:
        """`evaluate(label)`, and its `eval_...` row for the callbacks (log_history, on_evaluate):
        each decoding's accuracy and mean reward, and the extra evaluation's metrics."""
        results = self.evaluate(label)
        metrics = eval_metrics(results)
        if self.extra_evaluation is not None:
            metrics.update({f"eval_{k}": v for k, v in self.extra_evaluation(self).items()})
        self.sync_run_state()
        self.log_row(metrics)  # then on_evaluate, as transformers' evaluate does
        self.callbacks.fire("on_evaluate", metrics=metrics)
        return results

    def state_dict(self) -> dict[str, Any]:
        """Everything besides the policy's weights that continues this run exactly (`restore=`)."""
        return self.parts.saver.state_dict()

    def save(self, directory: Path) -> Path:
        """A checkpoint of this step (grpo.training.saving.save)."""
        self.saved = self.parts.saver.save(directory)
        return self.saved
