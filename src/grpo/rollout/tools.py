"""Tools a model may call during a rollout: their schemas, the parsing of calls out of the
model's text, and running them with bounded time and output.

A tool is a plain Python function (sync or async) with type hints and a Google-style
docstring; its schema is transformers' (`transformers.utils.get_json_schema`), which is what
chat templates render in the prompt (`apply_chat_template(..., tools=[...])`).

Calls are parsed from the text of the model's turn. The tokenizer's own response parser is
used when it has one (`tokenizer.response_template`, transformers' `parse_response`);
otherwise the default format, which Qwen, Hermes and many other chat templates use:

    <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>

one JSON object per call, several calls per turn allowed. A call that names no known tool or
has arguments the tool does not take is answered with an error message (and counted as a
failure), as TRL does. A call that cannot be parsed at all (not valid JSON, no name) is, as
in TRL, no call (rollout.malformed_tool_calls: end), or is answered with the parse error
(answer), so a model can learn the format from its mistakes.

Running a call (`ToolRunner`): the result is `str(return value)`, cut to
`rollout.tool_output_chars` characters; an exception becomes its text ("error: ...");
a call that does not return within `rollout.tool_timeout` seconds is abandoned and answered
with a timeout message. With `rollout.tool_isolation: process` (the default) each call runs
in a forked child process, killed at the timeout, whose stdout and stderr are discarded, so a
tool that hangs, prints megabytes, crashes the interpreter or calls os._exit costs the run
only that call. With `thread`, calls run in daemon threads of the training process: cheaper,
and a hung call is abandoned (its thread is left running), but a tool that calls os._exit
or crashes the interpreter ends the run, and what it prints goes to the run's output.

What a forked call may not do: before the tool runs, its process installs
grpo.sandbox.signal_guard's seccomp filter, made in the trainer right before the fork, so no
process of the call can signal, trace or limit a process that existed then (the trainer, its
threads and process group, what started it, what it started): a tool's SIGTERM to the trainer
fails in the tool (PermissionError) instead of stopping the run. A batch's calls that run in
threads start before its forks, so that no thread the trainer starts escapes the filter. Where
there is no filter (not Linux, an unknown architecture, no seccomp) calls run without it, and
a warning says so once. Its memory, `rollout.tool_memory_mb` MiB (grpo.rollout.tool_memory):
a cgroup of its own, made before the fork and entered before the tool runs, counts every page
the call writes, copy-on-write copies of the trainer's included, and the kernel ends the call
at the limit (root with writable cgroups); RLIMIT_DATA at the data it shares with the trainer
plus that many MiB fails an allocation that grows its data past that (MemoryError), and is all
that holds without a cgroup. Either way the call's result is an error naming the limit.

What a forked call starts ends with it: the child leads a session of its own and is a child
subreaper (grpo.rewards.worker's helpers, as a reward worker's keeper), so whatever the tool
starts, a daemon that double-forks into a session of its own included, stays its descendant;
once the tool has returned, the child kills its descendants and its session before it writes
the result (a daemon holding the result's pipe no longer keeps the call waiting to its
timeout). A call past its timeout is stopped (SIGSTOP: it forks no more), its descendants
killed while it still holds them, then it and what remains of its session. A setsid'd
daemon of a tool whose process dies without a result (a crash, os._exit) is init's: killed
with the call's cgroup where it has one, escaping otherwise. With `thread`, what a tool starts
is the trainer's and is not tracked.

A forked call and CUDA: the child is forked from the trainer, which may have initialised CUDA,
and CUDA cannot be used again in a process forked after that. grpo's own part of the child
(running the function, turning its result or error into text, writing one JSON line, os._exit)
imports nothing and calls nothing of torch, and the objects the child inherits are frozen out
of the garbage collector (gc.freeze: a trainer's cycle holding a CUDA tensor is not freed in
the child), so a tool that does not use CUDA itself is safe to
fork, as a DataLoader worker is; a child stuck on a lock some other thread of the trainer held
at the fork is killed at the timeout like any hung call. A tool that does call into CUDA there
gets torch's "Cannot re-initialize CUDA in forked subprocess" error as its result, with the
fix (`rollout.tool_isolation: thread`) named in it and in a warning, once per run; under
`thread` it shares the trainer's CUDA context.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import RolloutConfig
from grpo.registry import load_callable
from grpo.rewards.worker import (
    can_reap_orphans,
    kill_tree,
    reap_children,
    set_child_subreaper,
)
from grpo.rollout.tool_memory import CallMemory
from grpo.sandbox.signal_guard import SignalGuard

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The default call format's tags (a JSON object with `name` and `arguments` between them)."""

MAX_CALL_CHARS = 16_384
"""The longest call (its JSON text) that is parsed; a longer one is answered with an error."""

MAX_CALLS_PER_TURN = 8
"""Calls run per turn; the rest of a turn's calls are answered with an error."""

MAX_PARALLEL = 8
"""Calls running at once (one turn of a whole batch may hold many)."""

OWN_GRACE = 2.0
"""Seconds past rollout.tool_timeout a built-in tool that enforces the timeout itself (the
`python` tool's sandbox) is waited for, to report its own outcome (e.g. "[timeout]")."""

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable
    schema: dict
    """transformers' JSON schema of the function, as chat templates take it."""
    own_isolation: bool = False
    """grpo's own tool that isolates what it runs itself (the `python` tool: grpo.sandbox): run in a
    thread whatever rollout.tool_isolation says, so its sandbox outcomes are counted in the run."""
    stateful: bool = False
    """A method of an environment (grpo.rollout.environments): run in a thread of the training
    process whatever rollout.tool_isolation says, since the environment's state lives there (its
    get_reward and the reward functions read it), and one call at a time in the order the calls
    were made, so that the state each call leaves does not depend on thread timing."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict | None
    """None when the call could not be parsed (`error` says why)."""
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    failed: bool = False
    timed_out: bool = False
    seconds: float = 0.0


def as_tool(obj: Callable | str) -> Tool:
    """A tool from a callable or its `module:function` name; a ConfigError naming the fix otherwise."""
    function = load_callable(obj, "rollout.tools") if isinstance(obj, str) else obj
    if not callable(function):
        raise ConfigError(
            f"rollout.tools: {obj!r} is not callable; give a function or its 'module:function' name"
        )
    from transformers.utils import get_json_schema

    name = getattr(function, "__name__", type(function).__name__)
    try:
        schema = get_json_schema(function)
    except Exception as error:  # transformers raises its own types for each docstring problem
        raise ConfigError(
            f"rollout.tools: {name}: no JSON schema can be made of it ({error}); give it type hints and a "
            "docstring with an Args: section describing each argument"
        ) from None
    return Tool(name, function, schema)


def build_tools(items: list, sandbox=None, timeout: float | None = None) -> dict[str, Tool]:
    """Tools by name, from callables, `module:function` names and `python` (the built-in tool,
    run in grpo.sandbox with the `sandbox` settings, rewards.sandbox, for at most `timeout`
    seconds); two with one name are refused."""
    tools: dict[str, Tool] = {}
    for item in items:
        tool = python_tool(sandbox, timeout) if item == "python" else as_tool(item)
        if tool.name in tools:
            raise ConfigError(
                f"rollout.tools: two tools are named {tool.name!r}; a model calls them by name, so rename one"
            )
        tools[tool.name] = tool
    return tools


def python_tool(settings=None, timeout: float | None = None) -> Tool:
    """The built-in `python` tool: runs the model's program in grpo.sandbox with the code rewards'
    settings (rewards.sandbox: isolation, interpreter, memory, processes, output; its time limit
    also at most `timeout`, rollout.tool_timeout) and returns what it printed, its standard error
    after a '--- stderr ---' line, and its outcome in brackets when it did not end well (e.g.
    "[timeout]") first. Each run counts in the step's sandbox/<status> metrics, as the code rewards' do."""
    from grpo.config.rollout_rewards import SandboxConfig
    from grpo.sandbox import Limits, SandboxError, run

    s = settings or SandboxConfig()
    limits = Limits(
        timeout=min(s.timeout, timeout) if timeout else s.timeout,
        memory=s.memory_mb << 20,
        processes=s.processes,
        output=s.output_kb << 10,
    )

    def python(code: str) -> str:
        """Runs a Python program in a sandbox (no network, no files kept) and returns what it printed.

        Args:
            code: The program's source code; print the values you want to see.
        """
        try:
            result = run(code, isolation=s.isolation, python=s.python, limits=limits)
        except SandboxError as error:
            return f"error: the sandbox could not run the program ({error})"
        # the outcome first, so that the output cap never hides it
        parts = [] if result.ok else [f"[{result.status}]"]
        parts.append(result.stdout)
        if result.stderr:
            parts.append(f"--- stderr ---\n{result.stderr}")
        text = "\n".join(part.rstrip("\n") for part in parts if part)
        return text or "(no output)"

    tool = as_tool(python)
    return Tool(tool.name, tool.function, tool.schema, own_isolation=True)


# ---------------------------------------------------------------- parsing


def parse_default(text: str) -> list[ToolCall]:
    """The calls in `text` in the default format (module docstring), in order.

    Example: 'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    -> [ToolCall("f", {"x": 1})].
    """
    calls = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        calls.append(_call_from_json(body))
    return calls


def _call_from_json(body: str) -> ToolCall:
    if len(body) > MAX_CALL_CHARS:
        return ToolCall("", None, f"the call is longer than {MAX_CALL_CHARS} characters")
    try:
        data = json.loads(body)
    except ValueError as error:
        return ToolCall("", None, f"the call is not valid JSON ({error})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", None, 'a call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some formats give the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], None, "the call's arguments are not a JSON object")
    return ToolCall(data["name"], arguments)


def parse_turn(
    tokenizer, ids: list[int], prefix: list[int], schemas: list[dict]
) -> tuple[str, list[ToolCall]]:
    """One turn of the model, its token ids `ids` after `prefix` (the prompt and the turns before):
    its text without the calls (the message content) and its calls. Parsed by the tokenizer's
    response parser when it has one (`response_template`), else in the default format."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    plain = tokenizer.decode(ids, skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is None:
        return _CALL.sub("", plain).strip(), parse_default(text)
    try:
        message = tokenizer.parse_response(ids, prefix=prefix, tools=schemas) or {}
    except Exception as error:  # the parser refuses malformed output: answered like bad JSON
        content = _CALL.sub("", plain).strip()
        if CALL_OPEN in text:
            return content, parse_default(text)
        return content, [ToolCall("", None, f"the response could not be parsed ({error})")]
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        name, arguments = function.get("name"), function.get("arguments", {})
        if isinstance(arguments, str):
            calls.append(_call_from_json(json.dumps({"name": name, "arguments": arguments})))
        elif isinstance(name, str) and isinstance(arguments, dict):
            calls.append(ToolCall(name, arguments))
        else:
            calls.append(
                ToolCall(
                    str(name or ""),
                    None,
                    "the call names no tool or its arguments are not an object",
                )
            )
    content = message.get("content")
    return (content if isinstance(content, str) else "").strip(), calls


# ---------------------------------------------------------------- running


@dataclass
class ToolCounts:
    """What the tools did since `take` last asked (summed over a step's rollouts)."""

    completions: int = 0
    turns: int = 0
    """Model turns, summed over completions (1 for a completion without a call)."""
    calls: int = 0
    failures: int = 0
    """Calls answered with an error: unknown tool, bad arguments, raised, timed out, died, and (with
    rollout.malformed_tool_calls: answer) unparsable."""
    timeouts: int = 0
    malformed: int = 0
    """Calls that could not be parsed and were dropped (rollout.malformed_tool_calls: end)."""
    seconds: float = 0.0
    by_tool: dict[str, int] = field(default_factory=dict)

    def add(self, result: ToolResult) -> None:
        self.calls += 1
        self.failures += int(result.failed)
        self.timeouts += int(result.timed_out)
        self.seconds += result.seconds
        self.by_tool[result.name] = self.by_tool.get(result.name, 0) + 1

    def as_dict(self) -> dict[str, float]:
        return {
            "completions": self.completions,
            "turns": self.turns,
            "calls": self.calls,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "malformed": self.malformed,
            "seconds": self.seconds,
        }


def tool_metrics(counts: dict[str, float]) -> dict[str, float]:
    """A step's tool metrics from its counts (summed over ranks): TRL's tools/call_frequency (calls
    per completion) and tools/failure_frequency (failed calls per call), turns per completion,
    calls that could not be parsed and were dropped per completion, timeouts and the seconds
    spent in tools."""
    completions, calls = max(1, counts["completions"]), counts["calls"]
    return {
        "tools/call_frequency": calls / completions,
        "tools/failure_frequency": counts["failures"] / calls if calls else 0.0,
        "tools/turns_mean": counts["turns"] / completions,
        "tools/malformed_frequency": counts["malformed"] / completions,
        "tools/timeouts": counts["timeouts"],
        "tools/seconds": counts["seconds"],
    }


def _invoke(function: Callable, arguments: dict) -> Any:
    result = function(**arguments)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable):
    return await awaitable


def _as_text(result: Any, limit: int) -> str:
    text = result if isinstance(result, str) else str(result)
    if len(text) > limit:
        return text[:limit] + f"... [cut at {limit} characters]"
    return text


def _error(exc: BaseException, limit: int) -> str:
    return _as_text(f"error: {type(exc).__name__}: {exc}", limit)


FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"
"""The start of torch's error (torch.cuda._lazy_init) when a process forked after its parent
initialised CUDA calls into CUDA."""

FORKED_CUDA_FIX = (
    "(this tool ran in a process forked from the trainer, which cannot use CUDA once the trainer "
    "has; a tool that uses CUDA needs rollout.tool_isolation: thread)"
)

_forked_cuda_warned = False


def _touched_cuda(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or during, is torch's forked-CUDA error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if FORKED_CUDA in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _forked_error(exc: BaseException, limit: int, memory: CallMemory | None = None) -> dict:
    """A forked call's error payload; torch's forked-CUDA error with its fix first (so that the
    output cap keeps it) and flagged for the trainer's warning; a MemoryError under the call's
    memory limit names the limit."""
    if _touched_cuda(exc):
        text = f"error: {type(exc).__name__}: {FORKED_CUDA_FIX}: {exc}"
        return {"error": _as_text(text, limit), "cuda": True}
    if isinstance(exc, MemoryError) and memory is not None:
        return {"error": _as_text(memory.error_text(False, str(exc)), limit)}
    return {"error": _error(exc, limit)}


_unguarded_warned = False


def _warn_unguarded(reason: str) -> None:
    global _unguarded_warned
    if not _unguarded_warned:
        _unguarded_warned = True
        import logging

        logging.getLogger(__name__).warning(
            "grpo: process-isolated tool calls run without the filter that keeps them from "
            "signalling the trainer (%s): a tool can stop the run here",
            reason,
        )


def _warn_forked_cuda(name: str) -> None:
    global _forked_cuda_warned
    if not _forked_cuda_warned:
        _forked_cuda_warned = True
        import logging

        logging.getLogger(__name__).warning(
            "grpo: tool %r called into CUDA in its forked process (rollout.tool_isolation: "
            "process), which cannot use CUDA once the trainer has; its calls fail. Set "
            "rollout.tool_isolation: thread for tools that use CUDA.",
            name,
        )


class ToolRunner:
    """Runs calls against `tools` with `timeout` seconds each and results cut to `max_chars`
    characters, in forked processes (`isolation` "process") or daemon threads ("thread"); a
    forked call may write `memory_mb` MiB past what it shares with the trainer (0: no limit)."""

    def __init__(
        self,
        tools: dict[str, Tool],
        timeout: float,
        max_chars: int,
        isolation: str = "process",
        memory_mb: int = RolloutConfig.tool_memory_mb,
    ):
        if isolation not in ("process", "thread"):
            raise ConfigError(f"rollout.tool_isolation: process or thread, got {isolation!r}")
        self.tools, self.timeout, self.max_chars, self.isolation = (
            tools,
            timeout,
            max_chars,
            isolation,
        )
        self.memory_mb = memory_mb

    def check(self, call: ToolCall, tools: dict[str, Tool] | None = None) -> ToolResult | None:
        """The answer to a call that cannot run (unparsed, unknown tool, wrong arguments); None if it
        can. `tools`: those the call may use (default: the runner's)."""
        tools = self.tools if tools is None else tools
        if call.arguments is None:
            return ToolResult(call.name or "invalid", f"error: {call.error}", failed=True)
        tool = tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(tools)) or "none"
            return ToolResult(
                call.name, f"error: no tool named {call.name!r} (tools: {known})", failed=True
            )
        try:
            inspect.signature(tool.function).bind(**call.arguments)
        except TypeError as error:
            return ToolResult(call.name, f"error: {error}", failed=True)
        return None

    def run(
        self, calls: list[ToolCall], toolsets: list[dict[str, Tool]] | None = None
    ) -> list[ToolResult]:
        """One result per call, in order, at most MAX_PARALLEL running at once; an environment's
        methods (Tool.stateful) one at a time, in order. `toolsets[i]`: the tools call i may use
        (its rollout's environment's; default: the runner's)."""
        toolsets = toolsets or [self.tools] * len(calls)
        results: list[ToolResult | None] = [
            self.check(call, tools) for call, tools in zip(calls, toolsets)
        ]
        pending = [i for i, r in enumerate(results) if r is None]
        for i in [i for i in pending if toolsets[i][calls[i].name].stateful]:
            results[i] = self._thread(toolsets[i][calls[i].name].function, calls[i].arguments)(
                calls[i].name
            )
        pending = [i for i in pending if results[i] is None]
        for start in range(0, len(pending), MAX_PARALLEL):
            chunk = pending[start : start + MAX_PARALLEL]
            waits = {}
            forked = []
            for i in chunk:  # threads first: what forks then may not signal them either
                tool = toolsets[i][calls[i].name]
                if tool.own_isolation:  # bounded by its own timeout: a moment to report it
                    waits[i] = self._thread(tool.function, calls[i].arguments, OWN_GRACE)
                elif self.isolation == "thread":
                    waits[i] = self._thread(tool.function, calls[i].arguments)
                else:
                    forked.append(i)
            if forked:
                # the processes (and threads) the chunk's forks may not signal: those that exist
                # now; the trainer starts none of its own before they end
                guard = SignalGuard.prepare()
                for i in forked:
                    waits[i] = self._fork(
                        toolsets[i][calls[i].name].function, calls[i].arguments, guard
                    )
            for i in chunk:
                results[i] = waits[i](calls[i].name)
        return results  # type: ignore[return-value]

    # each launcher starts a call and returns `wait(name) -> ToolResult`, which waits at most until
    # the call's own deadline (start + timeout)

    def _thread(self, function, arguments, grace: float = 0.0):
        box: dict[str, Any] = {}
        started = time.monotonic()

        def target():
            try:
                box["result"] = _as_text(_invoke(function, arguments), self.max_chars)
            except BaseException as error:  # SystemExit too: a tool must not end the run
                box["error"] = _error(error, self.max_chars)

        thread = threading.Thread(target=target, daemon=True, name="grpo-tool")
        thread.start()

        def wait(name: str) -> ToolResult:
            thread.join(max(0.0, started + self.timeout + grace - time.monotonic()))
            seconds = time.monotonic() - started
            if thread.is_alive():
                return ToolResult(name, self._timeout_text(), True, True, seconds)
            if "error" in box:
                return ToolResult(name, box["error"], True, False, seconds)
            return ToolResult(name, box.get("result", ""), False, False, seconds)

        return wait

    def _fork(self, function, arguments, guard: SignalGuard):
        # The child runs the function and this module's text and JSON helpers, then os._exit: no
        # torch, and no collection of the trainer's garbage, so a trainer that initialised CUDA
        # may fork it (the module docstring says more).
        can_reap_orphans()  # prctl looked up here, not by the child (a lookup after a fork may hang)
        started = time.monotonic()
        try:  # the call's cgroup (grpo.rollout.tool_memory), made before the fork
            memory = CallMemory.prepare(self.memory_mb) if self.memory_mb else None
        except OSError as error:
            text = f"error: the call's memory cgroup could not be made ({error})"
            return lambda name: ToolResult(name, text, True, False, time.monotonic() - started)
        try:
            read, write = os.pipe()
            pid = os.fork()
        except BaseException:
            if memory is not None:
                memory.finish()  # the cgroup made for it goes
            raise
        if pid == 0:  # the child: run, write one JSON line, exit without running any cleanup
            # what the trainer left for the collector (a cycle holding a CUDA tensor, say) is never
            # collected here: freeing it would call into CUDA from the fork
            gc.freeze()
            code = 0
            try:
                os.close(read)
                # a session of its own (Ctrl-C at the terminal is the trainer's) whose members,
                # and whatever they orphan (a subreaper: double-forked daemons stay its
                # descendants), end with the call
                os.setsid()
                set_child_subreaper(True)
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):  # nothing of the trainer's terminal, in or out
                    os.dup2(devnull, fd)
                # Python-level streams may not write to those descriptors (a captured console)
                sys.stdout = sys.stderr = open(os.devnull, "w")
                # from here on no process of the call can signal or trace one that existed before
                # it (grpo.sandbox.signal_guard): the trainer, its workers, what started it
                unguarded = None if guard.install() else guard.reason
                try:  # the tool runs only under its memory limit (grpo.rollout.tool_memory)
                    if memory is not None:
                        memory.enter()
                except OSError as error:
                    payload = {
                        "error": f"error: the call's memory limit could not be set ({error})"
                    }
                else:
                    try:
                        payload = {"result": _as_text(_invoke(function, arguments), self.max_chars)}
                    except BaseException as error:
                        payload = _forked_error(error, self.max_chars, memory)
                if unguarded:
                    payload["unguarded"] = unguarded
                data = json.dumps(payload).encode()
                # what the call started ends before its result is given (and no longer holds
                # the pipe open)
                kill_tree(os.getpid(), session=os.getpid())
                reap_children(1.0)
                view = memoryview(data)
                while view:
                    view = view[os.write(write, view) :]
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(write)

        def wait(name: str) -> ToolResult:
            chunks, deadline = [], started + self.timeout
            timed_out = False
            try:
                while True:
                    # past the deadline, output that is already flowing is still read
                    left = max(deadline - time.monotonic(), 0.5 if chunks else 0.0)
                    if not _readable(read, left):
                        timed_out = True
                        break
                    chunk = os.read(read, 1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
            finally:
                os.close(read)
            try:
                payload = None if timed_out else json.loads(b"".join(chunks))
            except ValueError:
                payload = None
            if payload is None:  # timed out or died: the child did not end what it started
                _end_call(pid)
            status = _reap(pid)
            # the kernel's kill at the cgroup's limit; what the call left in its cgroup is killed
            killed_at_limit = memory is not None and memory.finish()
            seconds = time.monotonic() - started
            if payload is not None and payload.get("unguarded"):
                _warn_unguarded(payload["unguarded"])
            if timed_out:
                return ToolResult(name, self._timeout_text(), True, True, seconds)
            if payload is None and killed_at_limit:
                text = _as_text(memory.error_text(True), self.max_chars)
                return ToolResult(name, text, True, False, seconds)
            if payload is None:
                return ToolResult(
                    name,
                    f"error: the tool's process ended ({status}) without a result",
                    True,
                    False,
                    seconds,
                )
            if "error" in payload:
                if payload.get("cuda"):
                    _warn_forked_cuda(name)
                return ToolResult(name, payload["error"], True, False, seconds)
            return ToolResult(name, payload["result"], False, False, seconds)

        return wait

    def _timeout_text(self) -> str:
        return f"error: the tool did not return within {self.timeout:g} seconds"


def _readable(fd: int, timeout: float) -> bool:
    import select

    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready)


def _end_call(pid: int) -> None:
    """Ends a forked call that is still running or ended without a result, with what it started:
    stopped (so it forks no more), its descendants killed while it holds them (a subreaper, it
    is their parent once their own parents are gone), then it, then the rest of its session
    (those it orphaned before it died, still named by its pid while it is unreaped)."""
    import signal

    for sig in (signal.SIGSTOP, None, signal.SIGKILL):
        if sig is None:
            kill_tree(pid)
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:  # dead, unreaped: its pid and session id are still its own
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return
    kill_tree(pid, session=pid)


def _reap(pid: int) -> str:
    """Waits for the child (killed or exiting) and says how it ended."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "already reaped"
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}"
