"""Chat templates rendered within limits: a time limit and an output limit per rendering, a time
limit for a whole set of renderings, a memory limit, and a size limit for the template, in a
worker process that is killed when a rendering overruns; every failure of a template refused
with one line that names the template's file and the fix.

A model directory is untrusted input and its chat template is code: Jinja's sandboxed
environment (what transformers compiles templates with) stops a template from reaching
Python's internals, but not from looping `range(100000)` inside `range(100000)` (a run that
hangs at full CPU, printing nothing) or from writing `'x' * 100000 * 100000` (gigabytes in
seconds). So every rendering of a tokenizer's chat template in grpo goes through `render`
here (the prompts of training and evaluation, grpo.tasks.data; the tool results of a
multi-turn rollout, grpo.rollout.multiturn; a reward model's texts, grpo.rewards.reward_model),
and a rendering past a limit is refused with a ConfigError (`TemplateRefused`) naming the
file the template came from and the limit:

- size: MAX_TEMPLATE_CHARS characters for a template (refused before it is ever sent; the
  prompt encoder checks it when it is built, `check_size`);
- time: MAX_SECONDS per rendering (one conversation), and TOTAL_SECONDS for one set of
  renderings (a `Budget`): each call of `render` has its own, and set-up's renderings of every
  training and held-out prompt share one, so a template just under MAX_SECONDS per prompt
  cannot stall set-up for rows x MAX_SECONDS; a set that runs longer than PROGRESS_AFTER
  seconds shows a progress bar;
- output: MAX_RENDERED_CHARS characters per rendering, four times the most a row's prompt
  may have (grpo.tasks.data.MAX_PROMPT_CHARS): the template's own text around the largest
  prompt allowed has that much room, and nothing beyond it could fit any model's context;
- memory: MEMORY_MB MiB for the process that renders (RLIMIT_DATA).

A template that fails by itself (its `raise_exception(...)`, an undefined name, a syntax error,
recursion without end, `1/0`, what the sandbox forbids) is refused the same way
(`TemplateFailed`), with the template's own message and line and the fix for that kind of
failure, never as the exception Jinja raised: that would end a run with a traceback.

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
(against the earlier of its own deadline and the budget's) after each piece it writes and when
it ends, and sends a short "alive" message with its count after a rendering whenever HEARTBEAT
seconds have passed without one (the progress bar's updates); the trainer waits at most
MAX_SECONDS + HEARTBEAT + SLACK for each message (less when the budget has less left), and
kills the worker when none comes (a loop that writes nothing): a rendering that runs past its
limit is stopped at most HEARTBEAT + SLACK seconds after it. The next rendering starts a new
worker.

What is not bounded: a tokenizer whose class has its own apply_chat_template (not
transformers' Jinja, e.g. mistral-common's) and arguments of apply_chat_template other than
tools, documents and chat_template are rendered in-process, as before (their failures are
refused as the worker's are); plain-text prompts and a tokenizer without a template cost
nothing new (no worker is started).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from grpo.config.errors import ConfigError
from grpo.rewards.worker import Worker

MAX_SECONDS = 5.0
"""The most one rendering (one conversation) may take, in seconds."""
TOTAL_SECONDS = 300.0
"""The most one set of renderings may take together, in seconds (a `Budget`): set-up's prompts
(every training and held-out row's, for the start-up context check) or one call of `render`
(a step's prompts, an evaluation's). Real templates render a prompt in well under a
millisecond (Qwen2.5's, some 30 microseconds through the renderer: docs/untrusted-input.md)."""
PROGRESS_AFTER = 2.0
"""Seconds a call of `render` runs before it shows a progress bar."""
MAX_TEMPLATE_CHARS = 1 << 20
"""The longest chat template accepted, in characters. Real ones are under 100,000 (the 72 TRL
1.16 ships: at most 19,572); a larger one would be sent to the renderer with every request."""
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
_OTHER_TEMPLATE = (
    "use a model whose template renders these prompts, or give the tokenizer a chat template you trust "
    "(data.chat_template=never renders prompts as plain text)"
)
"""The fix every refusal offers last: another template, or none."""


class TemplateRefused(ConfigError):
    """A chat template refused: past a limit (size, time, output, memory), its renderer died, or
    it failed by itself (TemplateFailed). Its message is one line naming the template's file."""


class TemplateFailed(TemplateRefused):
    """A chat template that failed by itself: `kind` is "raised" (its raise_exception), "undefined",
    "syntax", "recursion", "sandbox" or "error" (any other exception, `error_type` its name);
    `detail` is the template's own message and `line` the template's line (None if unknown)."""

    def __init__(self, message: str, kind: str, error_type: str, detail: str, line: int | None):
        super().__init__(message)
        self.kind, self.error_type, self.detail, self.line = kind, error_type, detail, line


class Budget:
    """The time a set of renderings may still take (TOTAL_SECONDS in all), and what it has rendered;
    `what` names the set in a refusal. Every call of `render` spends one of its own unless it is
    given one (set-up's: grpo.tasks.data.PromptEncoder)."""

    def __init__(self, what: str = "one batch of prompts"):
        self.seconds, self.what = TOTAL_SECONDS, what
        self.spent, self.rendered = 0.0, 0

    def left(self) -> float:
        return self.seconds - self.spent


# ---------------------------------------------------------------------- the trainer's side


def render(
    tokenizer,
    conversations: Sequence[list[dict]],
    *,
    add_generation_prompt: bool | Sequence[bool] = False,
    **kwargs: Any,
) -> list[str]:
    """`tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=..., **kwargs)`
    for each conversation `c`, each rendering and all of them together bounded (module
    docstring). `add_generation_prompt` may be one flag per conversation. Raises TemplateRefused
    past a limit and TemplateFailed where the template fails by itself."""
    return render_within(Budget(), tokenizer, conversations, add_generation_prompt, kwargs)


def render_within(
    budget: Budget,
    tokenizer,
    conversations: Sequence[list[dict]],
    add_generation_prompt: bool | Sequence[bool] = False,
    template_kwargs: dict | None = None,
) -> list[str]:
    """`render`, spending `budget` (shared by several calls: set-up's); the template's variables
    as a dict, so that no name of this function's can take one's place."""
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
    kwargs = dict(template_kwargs or {})
    if not _bounded(tokenizer) or set(kwargs) & _apply_arguments() - _IN_TRAINER:
        return _in_process(tokenizer, conversations, flags, kwargs)
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    given = kwargs.pop("chat_template", None)
    template = _chosen_template(tokenizer, given, tools)

    def where() -> str:  # reads the model's files: only to refuse
        return _source(tokenizer, template, given)

    _check_length(template, where)
    for c in conversations:
        if isinstance(c, (list, tuple)) and not c:
            raise ConfigError(
                "a chat prompt with no messages cannot be rendered with a chat template; give each "
                'prompt at least one message, e.g. [{"role": "user", "content": "..."}]'
            )
    if tools is not None:  # functions as their schemas, as render_jinja_template makes them
        from transformers.utils import get_json_schema

        tools = [t if isinstance(t, dict) or not callable(t) else get_json_schema(t) for t in tools]
    variables = {**tokenizer.special_tokens_map, **kwargs}
    texts: list[str] = []
    with _SHARED.lock:
        _SHARED.start()  # before the progress bar's clock starts: starting is not rendering
        with _Progress(len(conversations)) as progress:
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
                results = _SHARED.ask(
                    request, budget, lambda n, start=start: progress.show(start + n)
                )
                for result in results:
                    if result[0] != "ok":
                        raise _refusal(result, where(), budget)
                    texts.append(result[1])
                    budget.rendered += 1
                progress.show(len(texts))
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


def check_size(tokenizer, template_kwargs: dict | None = None) -> None:
    """Every chat template the tokenizer has (and one given as data.chat_template_kwargs'
    chat_template) within MAX_TEMPLATE_CHARS; else TemplateRefused naming its file. At set-up,
    so that a template too large is refused before any rendering."""
    own = getattr(tokenizer, "chat_template", None)
    templates = list(own.values()) if isinstance(own, dict) else [own]
    given = (template_kwargs or {}).get("chat_template")
    if isinstance(given, str) and not (isinstance(own, dict) and given in own):
        templates.append(given)
    for template in templates:
        if isinstance(template, str):
            _check_length(template, lambda t=template: _source(tokenizer, t, given))


def _check_length(template: str, where: Callable[[], str]) -> None:
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRefused(
            f"the chat template of {where()} is {len(template):,} characters, more than the "
            f"{MAX_TEMPLATE_CHARS:,} a chat template may have (real ones are under 100,000); "
            f"{_OTHER_TEMPLATE}"
        )


def _chosen_template(tokenizer, given, tools) -> str:
    """The template apply_chat_template would render (`get_chat_template`), or a ConfigError where
    the tokenizer has none of that name."""
    try:
        return tokenizer.get_chat_template(given, tools)
    except ValueError as error:
        raise ConfigError(
            f"the chat templates of the tokenizer {_name(tokenizer)!r}: {_one_line(str(error))}; "
            "name one of the tokenizer's templates in data.chat_template_kwargs' chat_template, or set "
            "data.chat_template=never to render prompts as plain text"
        ) from None


def _in_process(tokenizer, conversations: list, flags: list[bool], kwargs: dict) -> list[str]:
    """apply_chat_template itself (no time bound: module docstring), its failures refused as the
    worker's are."""
    texts = []
    for c, f in zip(conversations, flags):
        try:
            texts.append(
                tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=f, **kwargs)
            )
        except ConfigError:
            raise
        except Exception as error:
            subject = f"the chat template of the tokenizer {_name(tokenizer)!r}"
            raise _failed(_fault(error), subject) from None
    return texts


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


class _Progress:
    """A tqdm bar over a call's conversations, made only once the call has run PROGRESS_AFTER
    seconds (a fast call makes none and prints nothing); on stdout, redrawn at most every 10 s
    when that is not a terminal, as grpo.run.progress draws its bars."""

    def __init__(self, total: int):
        self.total, self.bar, self.began = total, None, time.monotonic()

    def __enter__(self) -> "_Progress":
        return self

    def show(self, done: int) -> None:
        if self.bar is None:
            if time.monotonic() - self.began < PROGRESS_AFTER:
                return
            from tqdm.auto import tqdm

            stream = sys.stdout
            self.bar = tqdm(
                total=self.total,
                initial=done,
                desc="chat template",
                unit="prompt",
                file=stream,
                mininterval=0.1 if getattr(stream, "isatty", lambda: False)() else 10.0,
                dynamic_ncols=True,
                smoothing=0,
            )
        elif done > self.bar.n:
            self.bar.update(done - self.bar.n)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------- refusals


_WITHIN = (
    "use a model whose template renders within the limit, or give the tokenizer a chat template you "
    "trust (data.chat_template=never renders prompts as plain text)"
)
"""The fix a refusal past a limit offers."""


def _refusal(result: tuple, subject: str, budget: Budget) -> TemplateRefused:
    """The refusal for a worker's result other than ("ok", text); `subject` names the template."""
    kind = result[0]
    if kind == "error":
        return _failed(result[1], subject)
    if kind == "timeout":
        return TemplateRefused(
            f"{subject} took over {MAX_SECONDS:g} s to render one prompt (a loop without end?); {_WITHIN}"
        )
    if kind == "over budget":
        each = (
            f"{budget.spent / budget.rendered:.2g} s each" if budget.rendered else "none finished"
        )
        return TemplateRefused(
            f"{subject} took over {budget.seconds:g} s in all to render {budget.what} "
            f"({budget.rendered:,} prompts rendered, {each}; real templates take under a millisecond "
            f"a prompt); {_WITHIN}"
        )
    if kind == "too long":
        return TemplateRefused(
            f"{subject} wrote more than {MAX_RENDERED_CHARS:,} characters for one prompt (four times "
            f"the most a prompt may have); {_WITHIN}"
        )
    if kind == "memory":
        return TemplateRefused(
            f"{subject} needed more than the {MEMORY_MB} MiB its renderer may use to render one "
            f"prompt; {_WITHIN}"
        )
    return TemplateRefused(
        f"the process rendering {subject} ended while rendering a prompt ({result[1]}); {_WITHIN}"
    )


def _failed(fault: tuple, subject: str) -> TemplateFailed:
    """The refusal of a template that failed by itself, from `_fault`'s description of its error."""
    kind, error_type, detail, line = fault
    at = f" at line {line}" if line else ""
    fix = f"correct the template{at}, or {_OTHER_TEMPLATE}"
    if kind == "raised":
        message = (
            f"{subject} refused a prompt{at} with its own error: {detail!r}; make the prompts what "
            f"the template accepts (its message says what), or "
            f"{_OTHER_TEMPLATE}"
        )
    elif kind == "undefined":
        name = detail[1 : -len("' is undefined")] if _is_undefined_name(detail) else None
        variable = (
            f"if {name!r} is a variable the template expects, give it in data.chat_template_kwargs "
            f"(e.g. data.chat_template_kwargs.{name}=...); else "
            if name
            else ""
        )
        message = f"{subject} uses a name it does not define{at} ({detail}); {variable}{fix}"
    elif kind == "syntax":
        message = f"{subject} is not valid Jinja{at} ({detail}); {fix}"
    elif kind == "recursion":
        message = f"{subject} recursed without end{at} (a macro that calls itself: {detail}); {fix}"
    elif kind == "sandbox":
        message = (
            f"{subject} did what Jinja's sandbox forbids{at} ({detail}): a template may not change "
            f"its inputs or reach Python's internals; {fix}"
        )
    else:
        message = f"{subject} failed{at} with {error_type}: {detail}; {fix}"
    return TemplateFailed(message, kind, error_type, detail, line)


def _is_undefined_name(detail: str) -> bool:
    """Whether an UndefinedError's message is Jinja's "'NAME' is undefined" for a plain name."""
    name = detail[1 : -len("' is undefined")]
    return detail.startswith("'") and detail.endswith("' is undefined") and name.isidentifier()


def _fault(error: BaseException) -> tuple[str, str, str, int | None]:
    """A template's exception as plain values (it crosses the worker's pipe whole): its kind (see
    TemplateFailed), its type's name, its message on one line, and the template's line where
    Jinja says (a syntax error's own, else the last frame of the compiled template)."""
    kind = "recursion" if isinstance(error, RecursionError) else "error"
    try:
        from jinja2 import exceptions, sandbox

        if isinstance(error, exceptions.TemplateSyntaxError):
            kind = "syntax"
        elif isinstance(error, sandbox.SecurityError):
            kind = "sandbox"
        elif isinstance(error, exceptions.UndefinedError):
            kind = "undefined"
        elif type(error) is exceptions.TemplateError:  # what transformers' raise_exception raises
            kind = "raised"
    except ImportError:
        pass
    line = getattr(error, "lineno", None) if kind == "syntax" else None
    frame = error.__traceback__
    while frame is not None and kind != "syntax":
        if frame.tb_frame.f_code.co_filename == "<template>":  # Jinja's rewritten frames
            line = frame.tb_lineno
        frame = frame.tb_next
    message = str(error).split("\n")[0] if kind == "syntax" else str(error)
    return kind, type(error).__name__, _one_line(message), line if isinstance(line, int) else None


def _one_line(text: str, limit: int = 300) -> str:
    """`text` on one line (its whitespace runs as single spaces), cut at `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _source(tokenizer, template: str, given: Any) -> str:
    """The template named for a refusal: a template given as data.chat_template_kwargs'
    chat_template by that key, else by the file it came from (`template_source`)."""
    own = getattr(tokenizer, "chat_template", None)
    if (
        isinstance(given, str)
        and given == template
        and not (isinstance(own, dict) and given in own)
    ):
        return "the chat template given as data.chat_template_kwargs.chat_template"
    return f"the chat template of {template_source(tokenizer, template)}"


def _name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or "") or "(built in memory)"


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

    def start(self) -> None:
        """A live worker: this one, or a new one in place of one that died or was killed."""
        if self.worker is not None and not self.worker.alive():
            self.close()
        if self.worker is None:
            self._start()

    def ask(self, request: tuple, budget: Budget, alive: Callable[[int], None]) -> list[tuple]:
        """The results of one request, a prefix of its conversations; the last one may be a failure.
        The time it takes (not the worker's start) is spent from `budget`; `alive` is told how many
        of the request's conversations are rendered whenever the worker says."""
        self.start()
        if budget.left() <= 0:
            return [("over budget",)]
        conn, began = self.worker.conn, time.monotonic()
        end = began + budget.left()
        try:
            conn.send(
                ("render", MAX_SECONDS, end - began, MAX_RENDERED_CHARS, BATCH_CHARS, *request)
            )
            while True:
                wait = min(MAX_SECONDS, max(0.0, end - time.monotonic())) + HEARTBEAT + SLACK
                if not conn.poll(wait):
                    self.close()  # a rendering that writes nothing and never ends
                    return [("over budget",) if time.monotonic() >= end else ("timeout",)]
                message = conn.recv()
                if message[0] == "done":
                    return message[1]
                alive(message[1])
        except (EOFError, OSError):
            code = self.worker.kill()
            self.worker = None
            return [("crashed", f"exit code {code}")]
        except BaseException:
            self.close()  # interrupted mid-request (Ctrl-C): its reply must not answer the next
            raise
        finally:
            budget.spent += time.monotonic() - began


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
    total_seconds,
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
    ("over budget",) (all of them past `total_seconds`), ("too long",), ("memory",) or ("error",
    `_fault` of the template's exception); or until the reply holds reply_chars."""
    end = time.monotonic() + total_seconds
    try:
        compiled = ctu._compile_jinja_template(template)
    except MemoryError:
        return [("memory",)]
    except Exception as e:
        return [("error", _fault(e))]
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
        deadline[0] = min(start + seconds, end)
        slow = ("over budget",) if end < start + seconds else ("timeout",)
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
            return [*results, slow]
        except _TooLong:
            return [*results, ("too long",)]
        except MemoryError:
            return [*results, ("memory",)]
        except Exception as e:
            return [*results, ("error", _fault(e))]
        results.append(("ok", rendered[0]))
        total += len(rendered[0])
        if total >= reply_chars:
            break
        if time.monotonic() - said > HEARTBEAT:
            conn.send(("alive", len(results)))
            said = time.monotonic()
    return results
