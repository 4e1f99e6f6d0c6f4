"""Code rewards: a completion's program run against tests in the sandbox (grpo.sandbox).

    code_tests       the program is the completion's last fenced python block (or the whole
                     text when it has none); the row's `tests` column is a list of cases:
                     {"input": ..., "output": ...} runs the program on that stdin and compares
                     its stdout (trailing whitespace ignored), a string is assert-style code
                     run after the program (e.g. "assert add(2, 3) == 5")
    humaneval_tests  HumanEval-style rows (`test`, `entry_point`): the program is the prompt
                     followed by the completion's function body (the completion up to its
                     first unindented line, where HumanEval's stop sequences cut), or by its
                     fenced block for chat models that rewrite the whole function; then
                     `test`, then check(entry_point)

The reward is the fraction of cases passed (for humaneval_tests, of the
assertions in `check`), or 1/0 all-or-nothing with `rewards.code_reward: all`.
None when the sandbox itself could not run the program (a missing reward, not a
zero). Evaluation (pass@1) always asks for the whole check.

What makes a pass. Assert-style tests run in a harness: the harness reads a
random token from its stdin (then closes it), runs the program in a fresh
namespace, restores the builtins the program may have replaced, runs each
test, and writes `<token> <i> ok` per passed test and `<token> done` at the
end, through a write function and file descriptor it saved before the
program ran. A case counts only when its line carries the token and the
harness reached `done`. So a program that exits early with status 0
(sys.exit(0), os._exit(0), a signal to itself), swallows the output
(replaces print, sys.stdout or os.write), redefines `check` or the tests'
builtins (`len`, `abs`, `AssertionError`...), or prints "ok" lines of its own
does not pass. stdin/stdout cases compare the output only, so an early exit
after the right output is a pass, as it should be.

Not guarded: a program that deliberately searches the interpreter's memory
for the token (gc, frame inspection) can forge the harness's lines; objects
whose `__eq__` always returns True satisfy `assert f(x) == y`; tests that
the program can read (they are in the same process). These need intent, not
luck; a reward that trains for hours may still find them, so read samples.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import SandboxConfig
from grpo.sandbox import Limits, SandboxError, run

CODE_REWARDS = ("fraction", "all")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_FENCES = ("", "python", "py", "python3")


def extract_program(text: str) -> str | None:
    """The last fenced python block of `text` (``` or ```python; an unclosed last fence runs to
    the end, as a truncated completion leaves it), or None when there is none."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in PYTHON_FENCES]
    return blocks[-1] if blocks else None


# --------------------------------------------------------------------------
# The harness for assert-style tests
# --------------------------------------------------------------------------

_HARNESS = """\
def _grpo_harness(program, tests):
    import builtins, os, sys
    token = sys.stdin.readline().strip()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    # Everything the harness calls after the program has run is bound here, before it runs:
    # the program may rebind names in builtins, in this module, in os or in sys.
    out, err, write, exit_ = os.dup(1), os.dup(2), os.write, os._exit
    run, compile_, enumerate_, type_, Failure = exec, compile, enumerate, type, BaseException
    builtins_now = vars(builtins)
    real_builtins = dict(builtins_now)
    namespace = {"__name__": "__grpo_program__", "__builtins__": builtins}  # no `if __name__ == "__main__"` run
    run(compile_(program, "<program>", "exec"), namespace)
    builtins_now.clear()
    builtins_now.update(real_builtins)
    for i, test in enumerate_(tests):
        try:
            run(compile_(test, "<test %d>" % i, "exec"), namespace)
        except Failure as e:
            write(err, ("test %d failed: %s\\n" % (i, type_(e).__name__)).encode())
        else:
            write(out, ("\\n%s %d ok\\n" % (token, i)).encode())
    write(out, ("\\n%s done\\n" % token).encode())
    exit_(0)


_grpo_harness({program}, {tests})
"""


def harness(program: str, tests: list[str]) -> str:
    """A script that runs `program`, then each assert-style test, reporting to the token's holder."""
    return _HARNESS.replace("{program}", repr(program)).replace("{tests}", repr(list(tests)))


def _harness_passes(stdout: str, token: str, n: int) -> tuple[list[bool], bool]:
    """(passed per test, reached the end) from the harness's token lines."""
    passed = [False] * n
    done = False
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == token:
            if parts[1] == "done":
                done = True
            elif len(parts) == 3 and parts[2] == "ok" and parts[1].isdigit() and int(parts[1]) < n:
                passed[int(parts[1])] = True
    return passed, done


# --------------------------------------------------------------------------
# Outcomes
# --------------------------------------------------------------------------


@dataclass
class Outcome:
    """How one program did on its tests."""

    passed_cases: int
    cases: int
    status: str
    """The sandbox status of the run that decided it (the first failing one), or `error`
    when the sandbox itself failed."""
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.cases > 0 and self.passed_cases == self.cases

    @property
    def fraction(self) -> float:
        return self.passed_cases / self.cases if self.cases else 0.0


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(got) == lines(expected)


class CodeRunner:
    """Runs programs against tests in the sandbox, several at once."""

    def __init__(self, settings: SandboxConfig | None = None):
        self.settings = settings or SandboxConfig()
        s = self.settings
        self.limits = Limits(
            timeout=s.timeout,
            memory=s.memory_mb << 20,
            processes=s.processes,
            output=s.output_kb << 10,
        )

    def _run(self, code: str, stdin: str | None = None, count: bool = True):
        return run(
            code,
            stdin=stdin,
            isolation=self.settings.isolation,
            python=self.settings.python,
            limits=self.limits,
            count=count,
        )

    def check(self) -> None:
        """Fail now, naming the fix, when the sandbox cannot run programs on this machine."""
        try:
            result = self._run("print(1 + 1)", count=False)  # not a reward's run: no step metric
        except SandboxError as e:
            raise ConfigError(f"rewards.sandbox: {e}") from e
        if result.stdout.strip() != "2":
            raise ConfigError(
                f"rewards.sandbox: a trivial program did not run in the sandbox "
                f"({result.status}: {result.stderr.strip()[-300:]})"
            )

    def outcome(self, program: str, cases: list[Any]) -> Outcome:
        """Run `program` against `cases` (stdin/stdout dicts and assert-style strings)."""
        io_cases = [c for c in cases if isinstance(c, dict)]
        asserts = [c for c in cases if isinstance(c, str)]
        passed, status = 0, "ok"
        try:
            for case in io_cases:
                result = self._run(program, stdin=str(case.get("input", "")))
                if result.ok and _same_output(result.stdout, str(case.get("output", ""))):
                    passed += 1
                elif status == "ok":
                    # ran, but printed the wrong output
                    status = result.status if not result.ok else "failed"
            if asserts:
                token = secrets.token_hex(16)
                result = self._run(harness(program, asserts), stdin=token + "\n")
                ok, done = _harness_passes(result.stdout, token, len(asserts))
                passed += sum(ok)
                if (not done or not all(ok)) and status == "ok":
                    status = result.status if not result.ok else "failed"
        except SandboxError as e:
            return Outcome(passed, len(cases), "error", str(e))
        return Outcome(passed, len(cases), status)

    def outcomes(self, programs: list[str], cases: list[list[Any]]) -> list[Outcome]:
        workers = self.settings.workers or None
        with ThreadPoolExecutor(max_workers=_pool_size(workers, len(programs))) as pool:
            return list(pool.map(self.outcome, programs, cases))


def _pool_size(workers: int | None, n: int) -> int:
    return max(1, min(workers or (os.cpu_count() or 1), n))


def _cases(value: Any, index: int) -> list[Any]:
    """The row's `tests` as a list of cases (a JSON string of one is accepted too)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [value]  # a single assert-style test
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"row {index}: `tests` must be a non-empty list of cases, got {value!r:.200}"
        )
    for case in value:
        if not (isinstance(case, str) or (isinstance(case, dict) and "output" in case)):
            raise ValueError(
                f"row {index}: a test case is an assert-style string or "
                f"{{'input': ..., 'output': ...}}, got {case!r:.200}"
            )
    return list(value)


_UNINDENTED = re.compile(r"\n(?=\S)")


def function_body(completion: str) -> str:
    """The completion up to its first unindented line after the first: the end of the
    function body it continues, where HumanEval's stop sequences (\\ndef, \\nclass,
    \\nif, \\nprint, \\n#) cut it. A stop string the engine kept is cut with it."""
    match = _UNINDENTED.search(completion)
    return completion[: match.start() + 1] if match else completion


def humaneval_program(prompt: str, completion: str) -> str:
    """prompt + the completion's function body; or prompt + its last fenced block, for chat
    models that rewrite the whole function (the prompt's other definitions stay)."""
    block = extract_program(completion)
    return prompt + (("\n" + block) if block is not None else function_body(completion))


def _text(completion: Any) -> str:
    """A completion's text: a string, or the last message of a conversation that the model
    wrote (a tool's answer is never taken for the model's program)."""
    if isinstance(completion, list):
        written = [m for m in completion if m.get("role") != "tool"]
        return written[-1]["content"] if written else ""
    return completion


# --------------------------------------------------------------------------
# The reward functions
# --------------------------------------------------------------------------


class CodeTests:
    """The `code_tests` reward (see the module docstring)."""

    runs_in_process = True  # its outcomes are counted in this process (sandbox/<status>)
    bounds_itself = (
        True  # each program by the sandbox's timeout: not by rewards.timeout for the batch
    )
    __name__ = "code_tests"

    def __init__(self, settings: SandboxConfig | None = None, reward: str = "fraction"):
        if reward not in CODE_REWARDS:
            raise ConfigError(f"rewards.code_reward: must be one of {CODE_REWARDS}, got {reward!r}")
        self.runner, self.reward = CodeRunner(settings), reward

    def __call__(
        self, prompts, completions, completion_ids=None, *, tests, **columns
    ) -> list[float | None]:
        texts = [_text(c) for c in completions]
        programs = [p if (p := extract_program(t)) is not None else t for t in texts]
        cases = [_cases(t, i) for i, t in enumerate(tests)]
        return [self._reward(o) for o in self.runner.outcomes(programs, cases)]

    def _reward(self, outcome: Outcome) -> float | None:
        if outcome.status == "error":
            return None
        return outcome.fraction if self.reward == "fraction" else float(outcome.passed)


def check_cases(test: str, entry_point: str) -> list[str]:
    """`test` as one case per assertion of its `check` function, for partial credit: each
    case is `test` with check's body cut to its other statements (assignments, imports,
    in order) and one of its assertions (an `assert`, or a loop or block that holds
    some), then check(entry_point). [the whole test] when check has no such shape."""
    whole = [f"{test}\ncheck({entry_point})\n"]
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return whole
    check = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None
    )
    if check is None:
        return whole
    asserting = [
        i
        for i, stmt in enumerate(check.body)
        if any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
    ]
    if len(asserting) < 2:
        return whole
    cases = []
    for keep in asserting:
        body = [stmt for i, stmt in enumerate(check.body) if i == keep or i not in asserting]
        variant = ast.Module(
            body=[
                ast.FunctionDef(**{**{f: getattr(check, f) for f in check._fields}, "body": body})
                if n is check
                else n
                for n in tree.body
            ],
            type_ignores=[],
        )
        cases.append(f"{ast.unparse(ast.fix_missing_locations(variant))}\ncheck({entry_point})\n")
    return cases


class HumanEvalTests:
    """The `humaneval_tests` reward (see the module docstring): with `rewards.code_reward:
    fraction` (the default), the fraction of check's assertions that hold (grpo.rewards.code.
    check_cases); with `all`, 1 when check(entry_point) runs to the end."""

    runs_in_process = True
    bounds_itself = True
    __name__ = "humaneval_tests"

    def __init__(self, settings: SandboxConfig | None = None, reward: str = "fraction"):
        if reward not in CODE_REWARDS:
            raise ConfigError(f"rewards.code_reward: must be one of {CODE_REWARDS}, got {reward!r}")
        self.runner, self.reward = CodeRunner(settings), reward

    def outcomes(
        self,
        prompts: list[str],
        completions: list,
        tests: list[str],
        entry_points: list[str],
        partial: bool = False,
    ) -> list[Outcome]:
        """Per program, how it did: on each assertion of check when `partial`, else on the whole
        check, HumanEval's own measure (pass@1)."""
        programs = [humaneval_program(_text(p), _text(c)) for p, c in zip(prompts, completions)]
        if partial:
            cases = [check_cases(test, entry) for test, entry in zip(tests, entry_points)]
        else:
            cases = [[f"{test}\ncheck({entry})\n"] for test, entry in zip(tests, entry_points)]
        return self.runner.outcomes(programs, cases)

    def __call__(
        self, prompts, completions, completion_ids=None, *, test, entry_point, **columns
    ) -> list[float | None]:
        partial = self.reward == "fraction"
        return [
            None if o.status == "error" else (o.fraction if partial else float(o.passed))
            for o in self.outcomes(prompts, completions, test, entry_point, partial)
        ]


_default_humaneval: HumanEvalTests | None = None


def _humaneval() -> HumanEvalTests:
    global _default_humaneval
    if _default_humaneval is None:
        _default_humaneval = HumanEvalTests()
    return _default_humaneval


def humaneval_tests(
    prompts, completions, completion_ids=None, *, test, entry_point, **columns
) -> list[float | None]:
    """`humaneval_tests` with the default sandbox settings."""
    return _humaneval()(prompts, completions, completion_ids, test=test, entry_point=entry_point)


def humaneval_outcomes(prompts, completions, tests, entry_points) -> list[Outcome]:
    """Per program: passed, and the sandbox status; with the default sandbox settings."""
    return _humaneval().outcomes(prompts, completions, tests, entry_points)


def code_tests(
    prompts, completions, completion_ids=None, *, tests, **columns
) -> list[float | None]:
    """`code_tests` with the default sandbox settings and fractional reward."""
    return CodeTests()(prompts, completions, completion_ids, tests=tests)
