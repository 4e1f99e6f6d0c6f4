"""Environments (TRL's `environment_factory`): a stateful object per rollout whose public
methods are the tools its completion may call.

An environment is what a factory (a class, or any callable) returns: an object with a
`reset(**row)` method. Its other public methods (names not starting with "_", other than
`reset` and `get_reward`) are the tools offered to the completion it serves, described by
their type hints and docstrings like any tool (grpo.rollout.tools).

- `reset(**row)` is called before the completion's prompt is rendered, with the dataset row's
  columns (`prompt` among them; with several environments, without the `environment` column
  that chose this one). It returns None, or a string that is appended to the prompt's last
  message (to the text, for a text prompt): the task it sets. It may be async; one that does
  not return within rollout.tool_timeout, raises, or returns anything else stops the run with
  one line naming the class and the row, rather than hanging it or training on a broken task.
- `get_reward()`, when the environment has one, scores the finished rollout from the state
  its tool calls left: each environment class with `get_reward` is one more reward function,
  named after the class, weight 1, after the run's own (a rollout of another environment gets
  None from it, so that function does not score it). Reward functions may also read the
  instances themselves: they get them as `environments`, one per completion.
- Instances are made once and reused: a batch of completions takes one instance per
  completion from the pool of its environment, making more only when a batch needs more than
  there are, and resets each before its rollout. The G completions of a prompt each have their
  own instance, so their interactions stay apart.
- Several environments: factories by name, `{"counter": Counter, "echo": Echo}`; each row's
  `environment` column names its environment, and only that environment's methods (and the
  run's other tools) are offered to its completions.

Environment methods run in threads of the training process, one call at a time in the order
the calls were made (grpo.rollout.tools.Tool.stateful): their state lives there, and the order
makes it deterministic. A call past rollout.tool_timeout is abandoned like any tool's.
No process is started for an environment, whatever rollout.tool_isolation says: `reset`,
its methods and `get_reward` run in the trainer's own process, so an environment may use
CUDA as the trainer does.

Processes an environment starts (its factory, `reset` or a method, in the trainer's process)
end when training ends (`Environments.close`, which the trainer calls in a `finally`), with
their descendants and the sessions they lead; `Leftovers` says which processes those are and
what is never killed.

Nothing is pending between steps: every rollout's environment is reset from its row first.
A resumed run therefore continues exactly when `reset` depends on its arguments only; one
that draws from its own random generator continues from wherever that generator stands in the
new process.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from grpo.config.errors import ConfigError
from grpo.registry import load_callable
from grpo.rewards.worker import (
    children,
    is_child_subreaper,
    kill_tree,
    process_start,
    session_of,
    set_child_subreaper,
)
from grpo.rollout.tools import Tool, as_tool
from grpo.tasks.data import Row

ENVIRONMENT_COLUMN = "environment"
"""The column that picks a row's environment when there are several."""

MAX_OBSERVATION_CHARS = 100_000
"""The longest string `reset` may return (it becomes part of the prompt)."""

RESERVED = ("reset", "get_reward")
"""An environment's methods that are not tools."""


@dataclass
class Episode:
    """One completion's environment: which one, the instance, the tools its completion may call
    (the run's own plus the instance's methods) and what its reset returned."""

    name: str | None
    environment: Any
    tools: dict[str, Tool]
    observation: str | None


def method_names(environment) -> list[str]:
    """The public methods of an environment's class that are offered as tools, in name order
    (listed on the class: looking them up on the instance would run its properties)."""
    return [
        name
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in RESERVED
    ]


class Leftovers:
    """The processes the run's environments started in the trainer's own process, ended by `end`.

    An environment's code runs in the trainer's process, so what it starts is the trainer's own
    child, and a double-forked daemon (fork, setsid, fork again, the middle one exits) would be
    init's. While a call of an environment runs (`watching`: its factory, `reset`, a method
    offered as a tool), the trainer is a child subreaper (Linux's PR_SET_CHILD_SUBREAPER,
    counted across overlapping calls and put back as it was after the last), so such a daemon
    becomes the trainer's child; a process that became the trainer's child during the call (not
    one before it; started no earlier than the call began), as a child of the thread that runs
    the call or an orphan the trainer adopted, is the environment's. `end` SIGKILLs
    each of them that is still that process (its pid and start time), its descendants and the
    session it leads, and reaps it, as init would have.

    Never killed: a process that existed before the call (whatever the script started before
    training, e.g. under TRL's API, and its descendants), a child the trainer started outside
    an environment's call (reward workers, tool calls' forks, the sandbox, the report's plot
    renderer, torch.compile's workers, vLLM's, a tracker's), and the trainer's own session
    (a process that did not leave it is killed by its pid and tree only). What is not caught:
    an orphan adopted while an environment's call runs is counted as the environment's whoever
    orphaned it; a process that a thread the environment started forks is not tracked unless
    it is orphaned during a call; a child the trainer's first thread starts while another
    thread runs an environment's call (training run from a thread other than the first) is
    counted as the environment's; a daemon that an environment's process double-forks after the
    call ended, from a session of its own, becomes init's (as for reward functions, whose keeper
    is no longer there to hold it); without /proc or prctl (not Linux) nothing is tracked."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = 0
        self._was_subreaper = False
        self.started: dict[int, int] = {}
        """pid -> start time (clock ticks after boot) of each process an environment started."""
        self._pid = os.getpid()

    @contextlib.contextmanager
    def watching(self):
        """Around one call of an environment: what becomes this process's child meanwhile is its."""
        if os.getpid() != self._pid:  # in a fork of the trainer: not the trainer's children
            yield
            return
        with self._lock:
            if self._calls == 0:
                self._was_subreaper = is_child_subreaper()
                if not self._was_subreaper:
                    set_child_subreaper(True)
            self._calls += 1
        since = _now_ticks() - 1
        # a child is listed under the thread that forked it, and an orphan the trainer adopts
        # under its first thread: those two are read (a few microseconds, not the whole process's)
        threads = sorted({threading.get_native_id(), self._pid})
        before = children(self._pid, threads)
        try:
            yield
        finally:
            new = children(self._pid, threads) - before
            with self._lock:
                for pid in new:
                    start = process_start(pid)
                    if start is not None and start >= since:
                        self.started[pid] = start
                self._calls -= 1
                if self._calls == 0 and not self._was_subreaper:
                    set_child_subreaper(False)

    def end(self) -> list[int]:
        """Kills the processes the environments started (the class docstring) that still run;
        the pids killed."""
        with self._lock:
            started, self.started = self.started, {}
        killed = []
        own_session = os.getsid(0)
        for pid, start in started.items():
            if process_start(pid) != start:
                continue  # ended, or its pid is another process's now
            sid = session_of(pid)
            leads = sid == pid and sid != own_session
            for _ in range(2):  # its tree, it, then what it left in its session
                kill_tree(pid, session=pid if leads else None)
                if process_start(pid) == start:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            _reap(pid)
            killed.append(pid)
        return killed


def _now_ticks() -> int:
    """Clock ticks after boot, the unit of a process's start time in /proc."""
    try:
        return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))
    except (AttributeError, OSError, ValueError):
        return 0


def _reap(pid: int, seconds: float = 1.0) -> None:
    """Waits for a killed child of this process (not for another's)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:
            return  # not this process's child, or reaped already
        time.sleep(0.005)


def _watched(function: Callable, leftovers: Leftovers) -> Callable:
    """An environment's method called inside `leftovers.watching()` (awaited there when async)."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        with leftovers.watching():
            return _awaited(function(*args, **kwargs))

    return call


class Environments:
    """The run's environments: their factories by name (None: the one environment of every
    row), a pool of instances of each, the tools each offers and the reward functions of those
    that score themselves (module docstring)."""

    def __init__(
        self, factories, tools: dict[str, Tool] | None = None, reset_timeout: float = 60.0
    ):
        if isinstance(factories, dict):
            if not factories:
                raise ConfigError(
                    "environment_factory: an empty mapping; give one factory, or factories by name"
                )
            self.factories: dict[str | None, Callable] = dict(factories)
        else:
            self.factories = {None: factories}
        self.multi = None not in self.factories
        self.reset_timeout = reset_timeout
        """Seconds a reset may take (rollout.tool_timeout): one that takes longer stops the run
        with the fix, rather than hanging it."""
        self.standalone = dict(tools or {})
        self.pool: dict[str | None, list] = {}
        """Each environment's instances, reused batch after batch (the probe is the first)."""
        self.schemas: dict[str | None, list[dict]] = {}
        """The tool schemas each environment's prompts offer."""
        self.scoring_classes: list[type] = []
        """The environment classes with a get_reward, in order (each is one reward function)."""
        self._schemas: dict[tuple[type, str], dict] = {}
        """Each environment class's methods' schemas, made once."""
        self.leftovers = Leftovers()
        """The processes the environments started, ended by `close`."""
        for name, factory in self.factories.items():
            if not callable(factory):
                raise ConfigError(
                    f"{_label(name)}: {factory!r} is not callable; give a class or a function that returns an "
                    "environment"
                )
            probe = self._make(name)
            tools = self.tools_of(probe)
            self.pool[name] = [probe]
            self.schemas[name] = [tool.schema for tool in tools.values()]
            if (
                callable(getattr(type(probe), "get_reward", None))
                and type(probe) not in self.scoring_classes
            ):
                self.scoring_classes.append(type(probe))

    @classmethod
    def from_config(cls, spec, tools: dict[str, Tool], reset_timeout: float) -> "Environments":
        """From rollout.environment: 'module:Factory', or environment names mapped to such names."""
        if isinstance(spec, dict):
            factories = {
                name: load_callable(value, f"rollout.environment.{name}")
                for name, value in spec.items()
            }
            return cls(factories, tools, reset_timeout)
        return cls(load_callable(spec, "rollout.environment"), tools, reset_timeout)

    def _make(self, name: str | None):
        factory = self.factories[name]
        try:
            with self.leftovers.watching():
                environment = factory()
        except Exception as error:
            raise ConfigError(
                f"{_label(name)}: {_name(factory)}() raised {type(error).__name__}: {error}"
            ) from error
        if not callable(getattr(type(environment), "reset", None)):
            raise ConfigError(
                f"{_label(name)}: {_name(factory)}() made a {type(environment).__name__}, which has no reset "
                "method; an environment needs reset(**row) (returning None or a string for the prompt)"
            )
        return environment

    def tools_of(self, environment) -> dict[str, Tool]:
        """The run's own tools plus the environment's methods (Tool.stateful), by name."""
        tools = dict(self.standalone)
        for method in method_names(environment):
            key = (type(environment), method)
            if key not in self._schemas:
                try:
                    self._schemas[key] = as_tool(getattr(environment, method)).schema
                except ConfigError as error:  # as_tool names rollout.tools: name the class instead
                    raise ConfigError(
                        f"environment_factory: {type(environment).__name__}.{method}: {error}".replace(
                            f"rollout.tools: {method}: ", ""
                        )
                    ) from None
                if method in tools:
                    raise ConfigError(
                        f"environment_factory: {type(environment).__name__}.{method} has the name of another "
                        "tool; a model calls tools by name, so rename one"
                    )
            function = _watched(getattr(environment, method), self.leftovers)
            tools[method] = Tool(method, function, self._schemas[key], stateful=True)
        return tools

    def choose(self, row: Row, i: int) -> str | None:
        """The name of row i's environment."""
        if not self.multi:
            return None
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.factories:
            raise ConfigError(
                f"row {i}: {ENVIRONMENT_COLUMN}={name!r} is not among the environments ({', '.join(map(str, self.factories))}); "
                f"give every row an {ENVIRONMENT_COLUMN!r} column naming one"
            )
        return name

    def check_rows(self, rows: list[Row], what: str) -> None:
        """Start-up: with several environments, every row names one of them."""
        for i, row in enumerate(rows):
            try:
                self.choose(row, i)
            except ConfigError as error:
                raise ConfigError(f"{what}: {error}") from None

    def start(self, rows: list[Row], num_generations: int) -> list[Episode]:
        """One reset environment per completion: `num_generations` for each row, group-major."""
        episodes, taken = [], {}
        for i, row in enumerate(rows):
            name = self.choose(row, i)
            arguments = {
                k: v for k, v in row.items() if not (self.multi and k == ENVIRONMENT_COLUMN)
            }
            for _ in range(num_generations):
                pool, k = self.pool[name], taken.get(name, 0)
                if k == len(pool):
                    pool.append(self._make(name))
                taken[name] = k + 1
                environment = pool[k]
                observation = _reset(environment, arguments, i, self.reset_timeout, self.leftovers)
                episodes.append(Episode(name, environment, self.tools_of(environment), observation))
        return episodes

    def close(self) -> list[int]:
        """Ends the processes the environments started (`Leftovers`), at the end of training; the
        instances stay (a later `train` resets them again). The pids killed."""
        return self.leftovers.end()

    def reward_functions(self) -> dict[str, Callable]:
        """A reward function per environment class with get_reward, named after the class."""
        return {cls.__name__: _scorer(cls) for cls in self.scoring_classes}

    @property
    def tool_functions(self) -> dict[str | None, list[Callable]]:
        """Each environment's tools as functions (the run's own, then its pooled probe's methods)."""
        return {
            name: [tool.function for tool in self.tools_of(pool[0]).values()]
            for name, pool in self.pool.items()
        }


def with_observation(row: Row, observation: str | None) -> Row:
    """`row` with `observation` appended to its prompt's last message (or text)."""
    if observation is None:
        return row
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return {**row, "prompt": prompt + observation}
    last = prompt[-1]
    content = last.get("content")
    if isinstance(content, list):  # typed content parts
        content = content + [{"type": "text", "text": observation}]
    else:
        content = (content or "") + observation
    return {**row, "prompt": list(prompt[:-1]) + [{**last, "content": content}]}


def _reset(
    environment, arguments: dict, i: int, timeout: float, leftovers: Leftovers
) -> str | None:
    label = f"{type(environment).__name__}.reset"
    box: dict[str, Any] = {}

    def run():
        try:
            with leftovers.watching():  # in the thread that runs it (Leftovers reads its children)
                box["observation"] = _awaited(environment.reset(**arguments))
        except BaseException as error:  # SystemExit too: reported, not the thread's end
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="grpo-environment-reset")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ConfigError(
            f"rollout.environment: {label} did not return within {timeout:g} s (rollout.tool_timeout; row {i} "
            "of the batch); make it return, or raise rollout.tool_timeout"
        )
    if "error" in box:
        error = box["error"]
        raise ConfigError(
            f"rollout.environment: {label} raised {type(error).__name__}: {error} (row {i} of the batch)"
        ) from error
    observation = box.get("observation")
    if observation is not None and not isinstance(observation, str):
        raise ConfigError(
            f"rollout.environment: {label} returned a {type(observation).__name__}; return None or a string "
            "(appended to the prompt)"
        )
    if observation is not None and len(observation) > MAX_OBSERVATION_CHARS:
        raise ConfigError(
            f"rollout.environment: {label} returned {len(observation):,} characters; at most "
            f"{MAX_OBSERVATION_CHARS:,} (it becomes part of the prompt)"
        )
    return observation


def _scorer(cls: type) -> Callable:
    """The reward function of an environment class with get_reward: its rollouts' get_reward(),
    None for other environments' rollouts (exact class: a subclass registered on its own scores
    itself)."""

    def get_reward(environments, **kwargs):
        return [_awaited(e.get_reward()) if type(e) is cls else None for e in environments]

    get_reward.__name__ = cls.__name__
    get_reward.runs_in_process = True  # the instances live in the training process
    return get_reward


def _awaited(value):
    if inspect.isawaitable(value):
        import asyncio

        async def wait():
            return await value

        return asyncio.run(wait())
    return value


def _label(name: str | None) -> str:
    return "environment_factory" if name is None else f"environment_factory[{name!r}]"


def _name(factory) -> str:
    return getattr(factory, "__name__", type(factory).__name__)
