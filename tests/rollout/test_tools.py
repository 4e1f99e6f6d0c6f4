"""Tools: schemas from functions, the default call format, and running calls that raise,
hang, print or return megabytes, or end their process, with every failure counted."""

import os
import sys
import time

import pytest

from grpo.config.errors import ConfigError
from grpo.rollout.tools import (
    MAX_CALL_CHARS,
    ToolCall,
    ToolCounts,
    ToolRunner,
    build_tools,
    parse_default,
    tool_metrics,
)


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


async def later(a: int) -> int:
    """Returns its argument, asynchronously.

    Args:
        a: Any number.
    """
    return a


def boom(x: int) -> str:
    """Raises.

    Args:
        x: Anything.
    """
    raise ValueError("no such thing")


def hang(x: int) -> str:
    """Never returns in time.

    Args:
        x: Anything.
    """
    time.sleep(60)
    return "late"


def huge(x: int) -> str:
    """Prints and returns megabytes.

    Args:
        x: Anything.
    """
    print("p" * 3_000_000)
    sys.stderr.write("e" * 3_000_000)
    return "r" * 3_000_000


def leave(x: int) -> str:
    """Ends its process.

    Args:
        x: Anything.
    """
    os._exit(7)


def quit_(x: int) -> str:
    """Raises SystemExit.

    Args:
        x: Anything.
    """
    raise SystemExit(3)


TOOLS = build_tools([add, later, boom, hang, huge, leave, quit_])


def test_schema_comes_from_type_hints_and_docstring():
    schema = TOOLS["add"].schema
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Adds two numbers."
    params = schema["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert params["required"] == ["a", "b"]


def test_bad_tools_are_refused_with_the_fix(tmp_path, monkeypatch):
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="undocumented.*docstring with an Args: section"):
        build_tools([undocumented])
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        build_tools([add, add])
    with pytest.raises(ConfigError, match="expected 'module:function'"):
        build_tools(["nocolon"])
    with pytest.raises(ConfigError, match="cannot import"):
        build_tools(["no_such_module_here:f"])
    (tmp_path / "mytools.py").write_text(
        "def double(x: int) -> int:\n"
        '    """Doubles.\n\n    Args:\n        x: A number.\n    """\n'
        "    return 2 * x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = build_tools(["mytools:double"])
    assert tools["double"].function(4) == 8
    with pytest.raises(ConfigError, match="mytools has no function 'triple'"):
        build_tools(["mytools:triple"])


def test_default_format_parsing():
    text = (
        'I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
        '<tool_call>\n{"name": "later", "arguments": "{\\"a\\": 5}"}\n</tool_call>'
    )
    assert parse_default(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("later", {"a": 5})]
    assert parse_default("no call here") == []
    bad, listed, long = parse_default(
        "<tool_call>{nope</tool_call>"
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
        f'<tool_call>{{"name": "add", "arguments": {{"a": "{"x" * MAX_CALL_CHARS}"}}}}</tool_call>'
    )
    assert bad.arguments is None and "not valid JSON" in bad.error
    assert listed.arguments is None and "not a JSON object" in listed.error
    assert long.arguments is None and "longer than" in long.error


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_failures_are_answered_counted_and_never_stop_the_run(isolation, capfd):
    runner = ToolRunner(TOOLS, timeout=0.5, max_chars=100, isolation=isolation)
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("later", {"a": 9}),
        ToolCall("boom", {"x": 1}),
        ToolCall("hang", {"x": 1}),
        ToolCall("huge", {"x": 1}),
        ToolCall("quit_", {"x": 1}),
        ToolCall("nope", {}),
        ToolCall("add", {"c": 1}),
        ToolCall("", None, "the call is not valid JSON"),
    ]
    if isolation == "process":  # only a separate process survives os._exit
        calls.append(ToolCall("leave", {"x": 1}))
    started = time.monotonic()
    results = runner.run(calls)
    # every call at once: the hung one costs its timeout, not more
    assert time.monotonic() - started < 3.0
    by = {r.name: r for r in results}
    assert (results[0].content, results[0].failed) == ("5", False)
    assert (results[1].content, results[1].failed) == ("9", False)
    assert by["boom"].failed and by["boom"].content == "error: ValueError: no such thing"
    assert (
        by["hang"].timed_out
        and by["hang"].content == "error: the tool did not return within 0.5 seconds"
    )
    assert not by["huge"].failed and by["huge"].content.startswith("r" * 100 + "... [cut at 100")
    assert by["quit_"].failed and "SystemExit" in by["quit_"].content
    assert by["nope"].failed and "no tool named 'nope'" in by["nope"].content
    assert results[7].failed and "a" in results[7].content
    assert results[8].failed and results[8].name == "invalid"
    if isolation == "process":
        assert by["leave"].failed and "exit code 7" in by["leave"].content
        out, err = capfd.readouterr()
        assert "ppp" not in out and "eee" not in err  # a child's output is discarded
    counts = ToolCounts()
    for r in results:
        counts.add(r)
    metrics = tool_metrics({**counts.as_dict(), "completions": 5, "turns": 8})
    failed = 6 + (isolation == "process")  # boom, hang, quit_, nope, add(c), the invalid one; leave
    assert metrics["tools/call_frequency"] == len(calls) / 5
    assert metrics["tools/failure_frequency"] == failed / len(calls)
    assert metrics["tools/timeouts"] == 1
    assert metrics["tools/turns_mean"] == 8 / 5


def test_process_isolation_returns_after_the_timeout_and_kills_the_call():
    runner = ToolRunner(TOOLS, timeout=0.3, max_chars=50)
    started = time.monotonic()
    (result,) = runner.run([ToolCall("hang", {"x": 0})])
    assert result.timed_out and time.monotonic() - started < 1.5


needs_bwrap = pytest.mark.skipif(
    __import__("grpo.sandbox", fromlist=["bwrap_path"]).bwrap_path() is None,
    reason="bubblewrap is not installed (make test installs it)",
)


@needs_bwrap
def test_the_python_tool_runs_code_in_the_sandbox():
    from grpo.sandbox import take_counts

    tools = build_tools(["python"], timeout=1.0)
    assert tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    runner = ToolRunner(
        tools, timeout=1.0, max_chars=200
    )  # process isolation asked: the sandbox is its own
    take_counts()
    results = runner.run(
        [
            ToolCall("python", {"code": "print(6 * 7)"}),
            ToolCall("python", {"code": "import sys\nprint('half')\nsys.exit('bad input')"}),
            ToolCall("python", {"code": "while True:\n    pass"}),
            ToolCall(
                "python", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 80), 1)"}
            ),
            ToolCall("python", {"code": ""}),
        ]
    )
    assert results[0].content == "42" and not results[0].failed
    assert results[1].content == "[failed]\nhalf\n--- stderr ---\nbad input"
    assert results[2].content == "[timeout]" and not results[2].timed_out
    assert results[3].content.startswith("[failed]\n--- stderr ---")  # no network in the sandbox
    assert results[4].content == "(no output)"
    # counted as the code rewards' runs are, in the step's sandbox/<status>
    assert take_counts() == {"ok": 2, "failed": 2, "timeout": 1}


@needs_bwrap
def test_the_tools_example_offers_python_and_its_worked_example_is_what_the_tool_gives():
    """examples/tools_gemma.yaml: the prompt describes the python tool in the default call format
    (Gemma's template renders no tools), and its worked example's call, run, gives its result."""
    from pathlib import Path

    from grpo.config import loading
    from grpo.tasks.data import arithmetic_splits

    cfg = loading.load(Path(__file__).parents[2] / "examples" / "tools_gemma.yaml")
    assert cfg.rollout.tools == ["python"] and cfg.data.chat_template == "never"
    train, held_out = arithmetic_splits(cfg.data.arithmetic, cfg.data.seed)
    prompt = held_out[0]["prompt"][0]["content"]
    assert '<tool_call>{"name": "python", "arguments": {"code": "<program>"}}</tool_call>' in prompt
    offered, call = parse_default(cfg.data.few_shot)  # the instruction's form, then the call
    assert offered == ToolCall("python", {"code": "<program>"}) and call == ToolCall(
        "python", {"code": "print(7 * 3 + 5)"}
    )
    (result,) = ToolRunner(build_tools(["python"], timeout=5.0), timeout=5.0, max_chars=200).run(
        [call]
    )
    assert f"<tool_response>\n{result.content}\n</tool_response>\nAnswer: 26" in cfg.data.few_shot
    # the worked example's problem is none of the task's (its operands are out of their ranges)
    assert all(row["expression"] != "7 * 3 + 5" for row in train + held_out)
