"""The code rewards: programs from completions, run against tests in the sandbox; what
counts as a pass, and what does not (early exits, tampering with the checks)."""

from __future__ import annotations

import os
import time

import pytest

from grpo import sandbox
from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import RewardsConfig, SandboxConfig
from grpo.rewards.code import (
    CodeTests,
    HumanEvalTests,
    code_tests,
    extract_program,
    humaneval_outcomes,
    humaneval_tests,
)
from grpo.rewards.reward_set import resolve

if sandbox.bwrap_path() is None and not os.environ.get("GRPO_REQUIRE_SANDBOX"):
    pytest.skip("bubblewrap is not installed (make test installs it)", allow_module_level=True)


# --------------------------------------------------------------------------
# The program in a completion
# --------------------------------------------------------------------------


def test_extract_program_takes_the_last_python_block():
    text = (
        "First:\n```python\nx = 1\n```\nthen\n```py\nprint(2)\n```\nand shell:\n```bash\nls\n```\n"
    )
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    # cut off by the length limit
    assert extract_program("Here:\n```python\nprint(4)\n") == "print(4)\n"
    assert extract_program("print(5)") is None
    assert extract_program("```bash\nrm -rf /\n```") is None


# --------------------------------------------------------------------------
# code_tests: stdin/stdout cases
# --------------------------------------------------------------------------

SUM_CASES = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "10 -4\n", "output": "6"},
    {"input": "0 0\n", "output": "0\n"},
]


def test_stdin_stdout_cases_give_the_fraction_passed():
    completions = [
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
        "a, b = map(int, input().split())\nprint(abs(a) + abs(b))",  # right on 2 of 3, no fence
        "print(3)",  # right on 1 of 3
        "```python\nwhile True: pass\n```",
    ]
    reward = CodeTests(SandboxConfig(timeout=0.5))
    rewards = reward(prompts=[""] * 4, completions=completions, tests=[SUM_CASES] * 4)
    assert rewards == [1.0, pytest.approx(2 / 3), pytest.approx(1 / 3), 0.0]


def test_all_or_nothing():
    reward = CodeTests(SandboxConfig(timeout=5), reward="all")
    completions = ["a, b = map(int, input().split())\nprint(a + b)", "print(3)"]
    assert reward(prompts=["", ""], completions=completions, tests=[SUM_CASES] * 2) == [1.0, 0.0]


def test_output_is_compared_up_to_trailing_whitespace():
    cases = [{"input": "", "output": "a b\nc\n"}]
    assert code_tests(
        [""] * 3,
        ["print('a b  ')\nprint('c')\n\n", "print('a  b\\nc')", "print('a b\\nc\\n\\n\\n')"],
        tests=[cases] * 3,
    ) == [1.0, 0.0, 1.0]


def test_early_exit_after_the_right_output_is_a_pass_for_stdout_cases():
    assert code_tests(
        [""],
        ["print(3, flush=True)\nimport os; os._exit(0)"],
        tests=[[{"input": "", "output": "3"}]],
    ) == [1.0]


# --------------------------------------------------------------------------
# code_tests: assert-style tests, and what is not a pass
# --------------------------------------------------------------------------

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]


def test_assert_tests_give_the_fraction_passed():
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "def add(a, b):\n    return a + b if a > 0 else 7",  # fails the second
        "def add(a, b):\n    return 'x'",
        "def ad(a, b):\n    return a + b",  # NameError in every test
        "def add(a, b) return a + b",  # syntax error
    ]
    rewards = code_tests([""] * 5, completions, tests=[ADD_TESTS] * 5)
    assert rewards == [1.0, pytest.approx(2 / 3), 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "exit_call",
    [
        "import sys; sys.exit(0)",
        "import os; os._exit(0)",
        "raise SystemExit",
        "import os; os.abort()",
    ],
)
def test_exiting_before_the_tests_is_not_a_pass(exit_call):
    program = f"def add(a, b):\n    return a + b\n{exit_call}\n"
    assert code_tests([""], [program], tests=[ADD_TESTS]) == [0.0]


def test_exiting_inside_a_test_fails_that_run():
    program = (
        "def add(a, b):\n    import os\n    if a == 10:\n        os._exit(0)\n    return a + b\n"
    )
    assert code_tests([""], [program], tests=[ADD_TESTS]) == [pytest.approx(2 / 3)]


TAMPERING = {
    "prints the harness's lines": "def add(a, b):\n    return 99\nfor i in range(3):\n    print(f'x {i} ok')\nprint('x done')\n",
    "replaces builtins the tests use": "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
    "builtins.len = lambda x: 0\ndef add(a, b):\n    return len(str(a))\n",
    "rebinds exec in the harness module": "import sys\nsys.modules['__main__'].exec = lambda *a: None\n"
    "sys.modules['__main__'].compile = lambda *a: None\ndef add(a, b):\n    return 99\n",
    "defines check and the test names": "def check(candidate):\n    pass\ndef add(a, b):\n    return 99\n",
    "silences stderr and stdout": "import sys, os\nsys.stdout = sys.stderr = None\nos.write = lambda *a: 0\n"
    "def add(a, b):\n    return 99\n",
    "exits from an atexit handler": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 99\n",
}


@pytest.mark.parametrize("how", sorted(TAMPERING))
def test_tampering_with_the_checks_is_not_a_pass(how):
    assert code_tests([""], [TAMPERING[how]], tests=[ADD_TESTS]) == [0.0]


def test_a_correct_program_that_rebinds_output_still_passes():
    program = "import os, sys\nos.write = lambda *a: 0\nsys.stdout = None\ndef add(a, b):\n    return a + b\n"
    assert code_tests([""], [program], tests=[ADD_TESTS]) == [1.0]


def test_main_guard_does_not_run():
    program = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    assert code_tests([""], [program], tests=[ADD_TESTS]) == [1.0]


def test_mixed_cases_and_tests_as_a_json_string():
    tests = '[{"input": "2 3", "output": "5"}, "assert add(1, 1) == 2"]'
    program = "def add(a, b):\n    return a + b\nif __name__ != '__grpo_program__':\n    print(add(*map(int, input().split())))\n"
    assert code_tests([""], [program], tests=[tests]) == [1.0]


def test_bad_tests_column_names_the_row():
    with pytest.raises(ValueError, match="row 1: `tests` must be a non-empty list"):
        code_tests(["", ""], ["print(1)", "print(1)"], tests=[SUM_CASES, []])
    with pytest.raises(ValueError, match="a test case is an assert-style string"):
        code_tests([""], ["print(1)"], tests=[[{"input": "1"}]])


def test_sandbox_failure_is_a_missing_reward(monkeypatch):
    import grpo.rewards.code as code

    def broken(*args, **kwargs):
        raise sandbox.SandboxError("bwrap: cannot mount")

    monkeypatch.setattr(code, "run", broken)
    assert code_tests([""], ["print(1)"], tests=[SUM_CASES]) == [None]


def test_outcomes_are_counted_for_the_step_metrics():
    sandbox.take_counts()
    reward = CodeTests(SandboxConfig(timeout=1))
    reward([""] * 2, ["print(3)", "while True: pass"], tests=[[{"input": "", "output": "3"}]] * 2)
    counts = sandbox.take_counts()
    assert counts.get("ok") == 1 and counts.get("timeout") == 1


# --------------------------------------------------------------------------
# humaneval_tests
# --------------------------------------------------------------------------

PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-2, 2) == 0\n"


def test_humaneval_program_is_prompt_plus_completion():
    completions = [
        "    return a + b\n",
        "    return a - b\n",
        "    pass\n",
        "    import sys\n    sys.exit(0)\n    return a + b\n",
        "Sure:\n```python\ndef add(a, b):\n    return b + a\n```\n",
    ]
    rewards = humaneval_tests([PROMPT] * 5, completions, test=[TEST] * 5, entry_point=["add"] * 5)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    outcomes = humaneval_outcomes([PROMPT] * 2, completions[:2], [TEST] * 2, ["add"] * 2)
    assert [o.passed for o in outcomes] == [True, False] and [o.status for o in outcomes] == [
        "ok",
        "failed",
    ]


def test_configured_code_rewards_check_the_sandbox_at_start_up():
    cfg = RewardsConfig(sandbox=SandboxConfig(timeout=3, workers=2))
    name, fn = resolve("humaneval_tests", cfg)
    assert (
        name == "humaneval_tests"
        and isinstance(fn, HumanEvalTests)
        and fn.runner.limits.timeout == 3
    )
    with pytest.raises(
        ConfigError, match="rewards.sandbox: no Python interpreter runs inside the sandbox"
    ):
        resolve("code_tests", RewardsConfig(sandbox=SandboxConfig(python="/nonexistent/python3")))


def _humaneval_rows():
    from grpo.tasks.humaneval import read_humaneval

    return read_humaneval()


# 328 sandboxed runs (8 s): make test-slow; the graders' verdicts are tested on small cases above
@pytest.mark.slow
def test_all_164_humaneval_canonical_solutions_pass_and_empty_bodies_fail():
    rows = _humaneval_rows()
    assert len(rows) == 164
    reward = HumanEvalTests(SandboxConfig(workers=os.cpu_count() or 1))
    args = (
        [r["prompt"] for r in rows],
        [r["test"] for r in rows],
        [r["entry_point"] for r in rows],
    )
    start = time.monotonic()
    canonical = reward.outcomes(args[0], [r["canonical_solution"] for r in rows], args[1], args[2])
    elapsed = time.monotonic() - start
    failed = [(r["task_id"], o.status) for r, o in zip(rows, canonical) if not o.passed]
    assert failed == []
    assert elapsed < 60, f"164 canonical solutions took {elapsed:.1f} s"
    print(f"\n164 HumanEval canonical solutions: {elapsed:.1f} s with {os.cpu_count()} workers")
    empty = reward.outcomes(args[0], ["    pass\n"] * len(rows), args[1], args[2])
    assert sum(o.passed for o in empty) == 0
    early_exit = reward.outcomes(
        args[0],
        ["    import sys\n    sys.exit(0)\n" + r["canonical_solution"] for r in rows][:40],
        args[1][:40],
        args[2][:40],
    )
    assert sum(o.passed for o in early_exit) == 0


def test_humaneval_completion_ends_with_the_function_body():
    from grpo.rewards.code import function_body

    assert function_body("    return a + b\n\ndef ") == "    return a + b\n\n"
    assert function_body("a + b\nprint(add(1, 2))\n") == "a + b\n"  # continuing `    return `
    assert function_body("    x = 1\n\n    return x\n# done") == "    x = 1\n\n    return x\n"
    completions = [
        "    return a + b\n\nif __name__ == '__main__':\n    import sys; sys.exit(0)\n",
        "    return a + b\nassert False\n",
    ]
    assert humaneval_tests([PROMPT] * 2, completions, test=[TEST] * 2, entry_point=["add"] * 2) == [
        1.0,
        1.0,
    ]


def test_humaneval_partial_credit_counts_the_assertions_of_check():
    from grpo.rewards.code import check_cases

    test = (
        "METADATA = {}\ndef check(candidate):\n    x = 2\n    assert candidate(x) == 4\n"
        "    for i in range(3):\n        assert candidate(i) == 2 * i\n    assert candidate(-1) == -2\n"
    )
    cases = check_cases(test, "double")
    assert len(cases) == 3 and all("x = 2" in c and c.endswith("check(double)\n") for c in cases)
    assert check_cases("def check(candidate):\n    assert candidate(1)\n", "f") == [
        "def check(candidate):\n    assert candidate(1)\n\ncheck(f)\n"
    ]
    prompt = "def double(x):\n    return "
    completions = ["x * 2", "x", "abs(x) * 2", "x +"]
    partial = HumanEvalTests(SandboxConfig(), reward="fraction")
    whole = HumanEvalTests(SandboxConfig(), reward="all")
    args = dict(test=[test] * 4, entry_point=["double"] * 4)
    assert partial([prompt] * 4, completions, **args) == [1.0, 0.0, pytest.approx(2 / 3), 0.0]
    assert whole([prompt] * 4, completions, **args) == [1.0, 0.0, 0.0, 0.0]


def test_a_tools_answer_is_never_taken_for_the_models_program():
    from grpo.rewards.code import _text

    conversation = [
        {"role": "assistant", "content": "```python\nprint(1)\n```"},
        {"role": "tool", "content": "```python\nprint(2)\n```"},
    ]
    # cut after a tool result: the model's last message is its program
    assert _text(conversation) == "```python\nprint(1)\n```"
    assert _text([{"role": "tool", "content": "x"}]) == ""
