"""rollout's tool settings: each bad value refused with one line naming the key and the fix."""

import pytest

from grpo.config import loading
from grpo.config.errors import ConfigError


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.tools=[calculator]"],
            "rollout.tools: 'calculator' is not a 'module:function' name; write e.g.",
        ),
        (
            ["rollout.environment=Shop"],
            "rollout.environment: 'Shop' is not a 'module:Factory' name",
        ),
        (
            ["rollout.environment={shop: Shop}"],
            "rollout.environment.shop: 'Shop' is not a 'module:Factory' name",
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
        loading.from_dict({}, overrides)
    assert "\n" not in str(refused.value)


def test_too_many_tools_are_refused():
    with pytest.raises(ConfigError, match="rollout.tools: at most 64 tools, got 65"):
        loading.from_dict({"rollout": {"tools": [f"m:f{i}" for i in range(65)]}})


def test_the_defaults_and_a_valid_setting():
    r = loading.from_dict({}).rollout
    assert (r.tools, r.max_tool_calls, r.tool_timeout, r.tool_output_chars, r.tool_isolation) == (
        [],
        5,
        10.0,
        4096,
        "process",
    )
    r = loading.from_dict({}, ["rollout.tools=[python,mytools:calculator]"]).rollout
    assert r.tools == ["python", "mytools:calculator"]


def test_a_tool_file_beside_the_config_is_found_from_anywhere(tmp_path, monkeypatch):
    from grpo.rollout.tools import build_tools

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my_tools.py").write_text(
        "def double(x: int) -> int:\n"
        '    """Doubles.\n\n    Args:\n        x: A number.\n    """\n'
        "    return 2 * x\n"
    )
    (tmp_path / "conf" / "run.yaml").write_text(
        "output_dir: out\nrollout:\n  tools: [my_tools.py:double]\n"
    )
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = loading.load(tmp_path / "conf" / "run.yaml")
    assert cfg.rollout.tools == [f"{tmp_path / 'conf' / 'my_tools.py'}:double"]
    # loaded as reward files are (grpo.registry.load_callable)
    assert build_tools(cfg.rollout.tools)["double"].function(4) == 8
    with pytest.raises(
        ConfigError, match="rollout.tools: 'gone.py:f': file gone.py does not exist"
    ):
        build_tools(["gone.py:f"])
