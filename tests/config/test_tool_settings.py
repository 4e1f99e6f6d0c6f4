"""rollout's tool settings: each bad value refused with one line naming the key and the fix."""

import pytest

from grpo.config import schema
from grpo.registry import ConfigError


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.tools=[calculator]"],
            "rollout.tools: 'calculator' is not a 'module:function' name; write e.g.",
        ),
        (
            ["rollout.tools=[m:f]", "rollout.engine=vllm"],
            "rollout.tools: tools with rollout.engine=vllm are not",
        ),
        (
            ["rollout.environment=envs:Shop"],
            "rollout.environment: environments .* are not implemented yet",
        ),
        (["rollout.max_tool_calls=0"], r"rollout.max_tool_calls: must be in \[1, 64\], got 0"),
        (["rollout.max_tool_calls=1000"], r"rollout.max_tool_calls: must be in \[1, 64\]"),
        (["rollout.tool_timeout=0"], r"rollout.tool_timeout: seconds in \(0, 3600\], got 0"),
        (
            ["rollout.tool_output_chars=0"],
            r"rollout.tool_output_chars: must be in \[1, 1,000,000\]",
        ),
        (
            ["rollout.tool_isolation=docker"],
            "rollout.tool_isolation: process or thread, got 'docker'",
        ),
    ],
)
def test_bad_tool_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        schema.from_dict({}, overrides)
    assert "\n" not in str(refused.value)


def test_too_many_tools_are_refused():
    with pytest.raises(ConfigError, match="rollout.tools: at most 64 tools, got 65"):
        schema.from_dict({"rollout": {"tools": [f"m:f{i}" for i in range(65)]}})


def test_the_defaults_and_a_valid_setting():
    r = schema.from_dict({}).rollout
    assert (r.tools, r.max_tool_calls, r.tool_timeout, r.tool_output_chars, r.tool_isolation) == (
        [],
        5,
        10.0,
        4096,
        "process",
    )
    r = schema.from_dict({}, ["rollout.tools=[python,mytools:calculator]"]).rollout
    assert r.tools == ["python", "mytools:calculator"]
