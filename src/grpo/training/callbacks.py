"""Callbacks: user code the training loop calls at its events, as transformers' Trainer does.

A callback is any object with some of the methods `on_init_end`, `on_train_begin`,
`on_epoch_begin`, `on_step_begin`, `on_step_end`, `on_log`, `on_evaluate`, `on_save`,
`on_epoch_end`, `on_train_end` (a `transformers.TrainerCallback` subclass works as it is;
grpo does not import transformers here). Each is called as
`method(args, state, control, **kwargs)`:

    args     the run's settings (grpo's Config; GRPOTrainer passes its GRPOConfig)
    state    a `RunState`: TrainerState's names (global_step, max_steps, epoch, log_history, ...),
             counted in optimizer steps like TRL (a grpo step is num_iterations of them)
    control  a `Control` (or a transformers.TrainerControl): what the callback asks the loop to do
    kwargs   model, processing_class, optimizer, lr_scheduler, train_dataloader and
             eval_dataloader (None: grpo has no dataloaders), and per event: `logs` (on_log),
             `metrics` (on_evaluate)

A method that returns a control object replaces the loop's (transformers' rule). What the loop
honours, checked after each step's `on_step_end`:

    should_training_stop   the loop ends after this step, as at max_steps: final/ is saved, the
                           "after" evaluation and the summary row follow
    should_save            a checkpoint of this step, besides those of save_steps
    should_evaluate        a held-out evaluation after this step (needs held-out rows)
    should_log             nothing to add: every step is logged (log_history, metrics.jsonl)

As in transformers, the flags a callback may raise are lowered again by the loop: should_log,
should_evaluate and should_save at each `on_step_begin`, each also after its own event
(on_log, on_evaluate, on_save), should_epoch_stop at `on_epoch_begin`, should_training_stop at
`on_train_begin`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_epoch_end",
    "on_train_end",
)
"""The events the loop calls, in the order a run meets them."""

_LOWERED = {
    "on_train_begin": ("should_training_stop",),
    "on_epoch_begin": ("should_epoch_stop",),
    "on_step_begin": ("should_log", "should_evaluate", "should_save"),
    "on_log": ("should_log",),
    "on_evaluate": ("should_evaluate",),
    "on_save": ("should_save",),
}
"""The flags lowered when an event is fired (before its callbacks run for the step's flags,
after them for the event's own), as transformers' CallbackHandler does."""


@dataclass
class Control:
    """transformers.TrainerControl's flags, without transformers."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


@dataclass
class RunState:
    """transformers.TrainerState's names for what grpo's loop knows. Steps are optimizer steps
    (TRL's count: grpo steps x num_iterations); `epoch` is fractional (how far the prompt order
    has gone through the rows); `log_history` holds one row per grpo step (its metrics with
    `step` and `epoch`), one per evaluation (`eval_...` keys) and, at the end of training, the
    summary row (train_loss, train_runtime, ...). `total_flos` is never counted (0)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 0
    logging_steps: int = 0
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict | None = None
    stateful_callbacks: dict = field(default_factory=dict)


class Callbacks:
    """The run's callbacks, and the (args, state, control) they are called with.

    `fire(event, **kwargs)` calls each callback's method for `event` in order; `objects` are the
    keyword arguments every call gets (the trainer sets model, processing_class, optimizer,
    lr_scheduler). A callback given as a class is made with no arguments."""

    def __init__(self, callbacks=(), *, args=None, state: RunState | None = None, control=None):
        self.args = args
        self.state = state if state is not None else RunState()
        self.control = control if control is not None else Control()
        self.callbacks: list = []
        self.objects: dict[str, Any] = {
            "model": None,
            "processing_class": None,
            "optimizer": None,
            "lr_scheduler": None,
            "train_dataloader": None,
            "eval_dataloader": None,
        }
        self.init_ended = False
        """Whether on_init_end has been fired (once, however many trainers the callbacks serve)."""
        for callback in callbacks or ():
            self.add(callback)

    @classmethod
    def of(cls, callbacks, args) -> "Callbacks":
        """`callbacks` when it is a Callbacks, else one of the callback objects (or classes) given,
        called with `args`."""
        return callbacks if isinstance(callbacks, Callbacks) else cls(callbacks or (), args=args)

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def add(self, callback) -> None:
        """Appends `callback` (an object, or a class to make one of)."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback):
        """Removes and returns the first callback that is `callback` (or an instance of it, when it is
        a class); None when there is none."""
        for i, cb in enumerate(self.callbacks):
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                return self.callbacks.pop(i)
        return None

    def remove(self, callback) -> None:
        """`pop`, without the result."""
        self.pop(callback)

    def fire(self, event: str, **kwargs):
        """Calls every callback's `event` method; returns the control they leave."""
        if event not in EVENTS:
            raise ValueError(f"unknown callback event {event!r}; one of {', '.join(EVENTS)}")
        lowered = _LOWERED.get(event, ())
        if event in ("on_train_begin", "on_epoch_begin", "on_step_begin"):
            for flag in lowered:
                setattr(self.control, flag, False)
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, **self.objects, **kwargs)
            if result is not None:
                self.control = result
        if event in ("on_log", "on_evaluate", "on_save"):
            for flag in lowered:
                setattr(self.control, flag, False)
        return self.control

    def configure(self, cfg, num_prompts: int, num_rows: int, is_main: bool) -> None:
        """The state's sizes in TRL's units (optimizer steps: a grpo step is num_iterations of
        them), for a run of `num_prompts` groups a step over `num_rows` training rows."""
        mu, s = cfg.algorithm.num_iterations, self.state
        s.max_steps = cfg.training.max_steps * mu
        s.logging_steps = cfg.logging.log_every * mu
        s.eval_steps = cfg.eval.every * mu
        s.save_steps = cfg.training.save_steps * mu
        s.train_batch_size = cfg.training.per_device_train_batch_size
        s.num_train_epochs = math.ceil(cfg.training.max_steps * num_prompts / num_rows)
        s.is_world_process_zero = s.is_local_process_zero = is_main

    def progress(self, global_step: int, epoch: float, tokens_seen: int) -> None:
        """Where training is, in TRL's units."""
        s = self.state
        s.global_step, s.epoch, s.num_input_tokens_seen = global_step, epoch, tokens_seen

    def init_end(self) -> None:
        """on_init_end, once however many trainers these callbacks serve."""
        if not self.init_ended:
            self.init_ended = True
            self.fire("on_init_end")

    def log_row(self, row: dict[str, Any]) -> None:
        """A row of log_history (TRL's: its `step` in optimizer steps, and `epoch`), then on_log."""
        s = self.state
        logs = {**{k: v for k, v in row.items() if k != "step"}, "epoch": s.epoch}
        s.log_history.append({**logs, "step": s.global_step})
        self.fire("on_log", logs=logs)
