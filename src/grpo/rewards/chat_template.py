"""Chat templates rendered within limits: a time limit and an output limit per rendering, and a
memory limit, in a worker process that is killed when a rendering overruns.

A model directory is untrusted input and its chat template is code: Jinja's sandboxed
environment (what transformers compiles templates with) stops a template from reaching
Python's internals, but not from looping `range(100000)` inside `range(100000)` (a run that
hangs at full CPU, printing nothing) or from writing `'x' * 100000 * 100000` (gigabytes in
seconds). So every rendering of a tokenizer's chat template in grpo goes through `render`
here (the prompts of training and evaluation, grpo.tasks.data; the tool results of a
multi-turn rollout, grpo.rollout.multiturn; a reward model's texts, grpo.rewards.reward_model),
and a rendering past a limit is refused with a ConfigError (`TemplateRefused`) naming the
file the template came from and the limit:

- time: MAX_SECONDS per rendering (one conversation);
- output: MAX_RENDERED_CHARS characters per rendering, four times the most a row's prompt
  may have (grpo.tasks.data.MAX_PROMPT_CHARS): the template's own text around the largest
  prompt allowed has that much room, and nothing beyond it could fit any model's context;
- memory: MEMORY_MB MiB for the process that renders (RLIMIT_DATA).

Why a worker process. In-process Jinja cannot be bounded in time: a `for` loop over
`messages` or over a string's characters, nested a few deep, runs without any call or output
to check from; SIGALRM works only in the main thread (a reward model's texts are rendered
from the reward executor's threads); sys.settrace costs some thirty times the rendering.
A worker can simply be killed. It is the long-lived worker grpo already starts for bounded
calls (grpo.rewards.worker.Worker): a fresh interpreter (subprocess.Popen of sys.executable,
never a fork of the trainer, so it is safe beside CUDA), started lazily at the first
templated rendering and shared by the whole process (a fork, such as a forked tool call,
starts its own), with RLIMIT_DATA set, and with one thread each for the BLAS libraries that
transformers' import brings in (their per-thread buffers would count against the limit).

What the worker renders is exactly what `tokenizer.apply_chat_template(..., tokenize=False)`
returns: the trainer side does what needs the tokenizer (the template it picks,
`get_chat_template`, and its special tokens as variables, as apply_chat_template does) and
the worker calls transformers' own `render_jinja_template` (the same preparation of the
messages, the tools and the variables, the same compiled template: `_compile_jinja_template`),
with the compiled template's `render` replaced by one that streams `generate()`, so that it
stops at the output limit or the deadline without holding more than the limit. Tokenizing
stays in the trainer (`render_ids`: `tokenizer(text, add_special_tokens=False)`, what
apply_chat_template(tokenize=True) does with its text), so the ids are the same.

The trainer's side of a request: a batch of conversations (cut so that a request carries at
most BATCH_CHARS characters of messages and a reply at most as many of output), one reply per
batch, so the cost of the round trip is per batch. The worker checks each rendering's time
after each piece it writes and when it ends, and sends a short "alive" message after a
rendering whenever HEARTBEAT seconds have passed without one; the trainer waits at most
MAX_SECONDS + HEARTBEAT + SLACK for each message, and kills the worker when none comes (a
loop that writes nothing): a rendering that runs past its limit is stopped at most
HEARTBEAT + SLACK seconds after it. The next rendering starts a new worker.

What is not bounded: a tokenizer whose class has its own apply_chat_template (not
transformers' Jinja, e.g. mistral-common's) and arguments of apply_chat_template other than
tools, documents and chat_template are rendered in-process, as before; plain-text prompts
and a tokenizer without a template cost nothing new (no worker is started).
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from grpo.config.errors import ConfigError
from grpo.rewards.worker import Worker

MAX_SECONDS = 5.0
"""The most one rendering (one conversation) may take, in seconds."""
MAX_RENDERED_CHARS = 4 << 20
"""The most characters one rendering may write: four times grpo.tasks.data.MAX_PROMPT_CHARS."""
MEMORY_MB = 512
"""The rendering process's memory limit (RLIMIT_DATA), in MiB: transformers' import, a batch,
and a rendering of MAX_RENDERED_CHARS fit with room to spare."""
BATCH_CHARS = 8 << 20
"""The most characters of messages one request carries, and of output one reply carries."""
HEARTBEAT = 0.25
"""Seconds between the worker's "alive" messages while a long batch renders."""
SLACK = 1.0
"""Seconds past MAX_SECONDS + HEARTBEAT the trainer waits for a message before killing the worker."""
STARTUP_SECONDS = 120.0
"""How long the worker may take to start (import transformers); not counted as rendering."""

_IN_TRAINER = frozenset({"tools", "documents", "chat_template"})
"""apply_chat_template's own arguments `render` handles; any other one is rendered in-process."""


class TemplateRefused(ConfigError):
    """A chat template that ran past a limit (time, output, memory) or whose renderer died."""


# ---------------------------------------------------------------------- the trainer's side


def render(
    tokenizer,
    conversations: Sequence[list[dict]],
    *,
    add_generation_prompt: bool | Sequence[bool] = False,
    **kwargs: Any,
) -> list[str]:
    """`tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=..., **kwargs)`
    for each conversation `c`, each rendering bounded (module docstring). `add_generation_prompt`
    may be one flag per conversation. Raises TemplateRefused past a limit, and what the template
    itself raised (a TemplateError, say) as apply_chat_template would."""
    conversations = list(conversations)
    flags = (
        [bool(add_generation_prompt)] * len(conversations)
        if isinstance(add_generation_prompt, bool)
        else [bool(f) for f in add_generation_prompt]
    )
    if len(flags) != len(conversations):
        raise ValueError(
            f"{len(flags)} add_generation_prompt flags for {len(conversations)} conversations"
        )
    if not conversations:
        return []
    if not _bounded(tokenizer) or set(kwargs) & _apply_arguments() - _IN_TRAINER:
        return [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=f, **kwargs)
            for c, f in zip(conversations, flags)
        ]
    kwargs = dict(kwargs)
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    template = tokenizer.get_chat_template(kwargs.pop("chat_template", None), tools)
    for c in conversations:
        if isinstance(c, (list, tuple)) and not c:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
    if tools is not None:  # functions as their schemas, as render_jinja_template makes them
        from transformers.utils import get_json_schema

        tools = [t if isinstance(t, dict) or not callable(t) else get_json_schema(t) for t in tools]
    variables = {**tokenizer.special_tokens_map, **kwargs}
    texts: list[str] = []
    with _SHARED.lock:
        while len(texts) < len(conversations):
            start = len(texts)
            end, size = start, 0
            while end < len(conversations) and (end == start or size < BATCH_CHARS):
                size += _size(conversations[end])
                end += 1
            request = (
                template,
                conversations[start:end],
                flags[start:end],
                tools,
                documents,
                variables,
            )
            for result in _SHARED.ask(request):
                if result[0] != "ok":
                    _fail(result, tokenizer, template)
                texts.append(result[1])
    return texts


def render_ids(
    tokenizer, conversation: list[dict], *, add_generation_prompt: bool = False, **kwargs
) -> list[int]:
    """`tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, ...)`, the
    rendering bounded: the text from `render`, tokenized here as apply_chat_template tokenizes it."""
    text = render(tokenizer, [conversation], add_generation_prompt=add_generation_prompt, **kwargs)[
        0
    ]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bounded(tokenizer) -> bool:
    """Whether the tokenizer renders with transformers' own apply_chat_template (Jinja)."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (
        isinstance(tokenizer, PreTrainedTokenizerBase)
        and getattr(type(tokenizer), "apply_chat_template", None)
        is PreTrainedTokenizerBase.apply_chat_template
    )


_APPLY_ARGUMENTS: frozenset[str] | None = None


def _apply_arguments() -> frozenset[str]:
    global _APPLY_ARGUMENTS
    if _APPLY_ARGUMENTS is None:
        from transformers import PreTrainedTokenizerBase

        _APPLY_ARGUMENTS = frozenset(
            name
            for name, p in inspect.signature(
                PreTrainedTokenizerBase.apply_chat_template
            ).parameters.items()
            if p.kind is not p.VAR_KEYWORD and name != "self"
        )
    return _APPLY_ARGUMENTS


def _size(conversation) -> int:
    """The characters of a conversation's texts (what it costs to send), roughly."""
    total = 0
    for message in conversation if isinstance(conversation, (list, tuple)) else ():
        if isinstance(message, dict):
            for value in message.values():
                total += len(value) if isinstance(value, str) else 16
    return total + 16


def _fail(result: tuple, tokenizer, template: str):
    kind = result[0]
    if kind == "error":  # the template's own error, raised as apply_chat_template would raise it
        raise result[1]
    where = template_source(tokenizer, template)
    fix = (
        "use a model whose template renders within the limit, or give the tokenizer a chat template you "
        "trust (data.chat_template=never renders prompts as plain text)"
    )
    if kind == "timeout":
        raise TemplateRefused(
            f"the chat template of {where} took over {MAX_SECONDS:g} s to render one prompt (a loop without "
            f"end?); {fix}"
        )
    if kind == "too long":
        raise TemplateRefused(
            f"the chat template of {where} wrote more than {MAX_RENDERED_CHARS:,} characters for one prompt "
            f"(four times the most a prompt may have); {fix}"
        )
    if kind == "memory":
        raise TemplateRefused(
            f"the chat template of {where} needed more than the {MEMORY_MB} MiB its renderer may use to render "
            f"one prompt; {fix}"
        )
    raise TemplateRefused(
        f"the process rendering the chat template of {where} ended while rendering a prompt ({result[1]}); {fix}"
    )


def template_source(tokenizer, template: str) -> str:
    """The file a tokenizer's chat template came from: its model directory's chat_template.jinja
    (or chat_templates/NAME.jinja) or tokenizer_config.json holding exactly `template`; else the
    tokenizer's name (a hub id, or a template set in memory)."""
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    folder = Path(name) if name else None
    if folder is not None and folder.is_dir():
        jinja = [
            folder / "chat_template.jinja",
            *sorted((folder / "chat_templates").glob("*.jinja")),
        ]
        for path in jinja:
            try:
                if path.is_file() and path.stat().st_size <= 4 * len(template) + 64:
                    if path.read_text(encoding="utf-8") in (template, template + "\n"):
                        return str(path)
            except (OSError, UnicodeDecodeError):
                pass
        config = folder / "tokenizer_config.json"
        try:
            if config.is_file() and config.stat().st_size <= (64 << 20):
                value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
                if value == template or (
                    isinstance(value, list)
                    and any(isinstance(t, dict) and t.get("template") == template for t in value)
                ):
                    return str(config)
        except (OSError, ValueError, AttributeError):
            pass
        return f"the tokenizer of {folder} (set in memory, not from its files)"
    return f"the tokenizer {name!r}" if name else "the tokenizer (built in memory)"


class _Renderer:
    """The process's one rendering worker, started on first use; `lock` serialises requests."""

    def __init__(self):
        self.lock = threading.Lock()
        self.worker: Worker | None = None
        self._parents: list[Worker] = []

    def forget(self) -> None:
        """In a forked child: the parent's worker is the parent's. Its socket is closed here, and
        the object kept, never collected (its Popen would warn of a process still running)."""
        self.lock = threading.Lock()
        if self.worker is not None:
            try:
                self.worker.conn.close()
            except OSError:
                pass
            self._parents.append(self.worker)
        self.worker = None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
        self.worker = None

    def _start(self) -> None:
        self.worker = Worker("grpo.rewards.chat_template:_serve", {}, memory_mb=MEMORY_MB)
        conn = self.worker.conn
        try:
            ready = conn.poll(STARTUP_SECONDS) and conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        except BaseException:
            self.close()  # interrupted while it starts
            raise
        if not ready:
            code = self.worker.kill()
            self.worker = None
            raise RuntimeError(
                f"the chat template renderer did not start within {STARTUP_SECONDS:.0f} s (exit code {code})"
            )

    def ask(self, request: tuple) -> list[tuple]:
        """The results of one request, a prefix of its conversations; the last one may be a failure."""
        if self.worker is not None and not self.worker.alive():
            self.close()
        if self.worker is None:
            self._start()
        conn = self.worker.conn
        try:
            conn.send(("render", MAX_SECONDS, MAX_RENDERED_CHARS, BATCH_CHARS, *request))
            while True:
                if not conn.poll(MAX_SECONDS + HEARTBEAT + SLACK):
                    self.close()  # a rendering that writes nothing and never ends
                    return [("timeout",)]
                message = conn.recv()
                if message[0] == "done":
                    return message[1]
        except (EOFError, OSError):
            code = self.worker.kill()
            self.worker = None
            return [("crashed", f"exit code {code}")]
        except BaseException:
            self.close()  # interrupted mid-request (Ctrl-C): its reply must not answer the next
            raise


_SHARED = _Renderer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SHARED.forget)


# ---------------------------------------------------------------------- the worker's side


class _TooSlow(BaseException):
    pass


class _TooLong(BaseException):
    pass


def _serve(conn) -> None:
    """The rendering worker's loop: ("render", ...) -> ("done", results), results as `_render_all`'s."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"  # a BLAS thread's buffers would count against the memory limit
    from transformers.utils import chat_template_utils

    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        except MemoryError:
            conn.send(("done", [("memory",)]))
            continue
        if message is None:
            return
        try:
            results = _render_all(conn, chat_template_utils, *message[1:])
        except MemoryError:
            results = [("memory",)]
        conn.send(("done", results))


def _render_all(
    conn,
    ctu,
    seconds,
    max_chars,
    reply_chars,
    template,
    conversations,
    flags,
    tools,
    documents,
    variables,
):
    """("ok", text) for each conversation rendered, in order, until the first failure: ("timeout",),
    ("too long",), ("memory",) or ("error", the exception); or until the reply holds reply_chars."""
    try:
        compiled = ctu._compile_jinja_template(template)
    except MemoryError:
        return [("memory",)]
    except Exception as e:
        return [("error", _portable(e))]
    deadline = [0.0]

    def bounded_render(*args, **kwargs) -> str:  # Template.render, streamed and bounded
        pieces, written = [], 0
        for piece in compiled.generate(*args, **kwargs):
            written += len(piece)
            if written > max_chars:
                raise _TooLong
            if time.monotonic() > deadline[0]:
                raise _TooSlow
            pieces.append(piece)
        return "".join(pieces)

    compiled.render = (
        bounded_render  # what render_jinja_template calls, on the same cached template
    )
    normalize = getattr(
        ctu, "_normalize_chat_messages", None
    )  # apply_chat_template's first step, where it has it
    results, total, said = [], 0, time.monotonic()
    for conversation, flag in zip(conversations, flags):
        start = time.monotonic()
        deadline[0] = start + seconds
        try:
            chat = normalize(conversation) if normalize is not None else conversation
            rendered, _ = ctu.render_jinja_template(
                conversations=[chat],
                tools=tools,
                documents=documents,
                chat_template=template,
                add_generation_prompt=flag,
                **variables,
            )
            if time.monotonic() > deadline[0]:
                raise _TooSlow
        except _TooSlow:
            return [*results, ("timeout",)]
        except _TooLong:
            return [*results, ("too long",)]
        except MemoryError:
            return [*results, ("memory",)]
        except Exception as e:
            return [*results, ("error", _portable(e))]
        results.append(("ok", rendered[0]))
        total += len(rendered[0])
        if total >= reply_chars:
            break
        if time.monotonic() - said > HEARTBEAT:
            conn.send(("alive", len(results)))
            said = time.monotonic()
    return results


def _portable(error: Exception) -> Exception:
    """The template's exception if it survives pickling whole (jinja2's TemplateError does), else a
    ValueError with its type and message."""
    import pickle

    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:
        pass
    return ValueError(f"{type(error).__name__}: {str(error)[:2000]}")
