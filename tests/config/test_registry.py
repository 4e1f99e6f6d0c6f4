"""grpo.registry: names known before anything is imported, definitions registered where they are."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo.config.errors import ConfigError
from grpo.registry import Registry

DEFINITIONS = """
from grpo import registry_under_test as r

@r.KIND.register("built_in", speed=1)
def built_in():
    return "built-in"
"""


@pytest.fixture
def kind(tmp_path, monkeypatch):
    """A registry whose one built-in name is defined (and registered) in a module not yet imported."""
    import grpo

    (tmp_path / "kind_definitions.py").write_text(DEFINITIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("test.kind", {"built_in": "kind_definitions"})
    holder = type(sys)("grpo.registry_under_test")
    holder.KIND = registry
    monkeypatch.setitem(sys.modules, "grpo.registry_under_test", holder)
    monkeypatch.setattr(grpo, "registry_under_test", holder, raising=False)
    monkeypatch.delitem(sys.modules, "kind_definitions", raising=False)
    return registry


def test_a_name_is_known_before_its_module_is_imported_and_registered_by_importing_it(kind):
    assert kind.names() == ("built_in",) and "built_in" in kind and list(kind) == ["built_in"]
    assert "kind_definitions" not in sys.modules
    fn = kind.get("built_in")
    assert fn() == "built-in" and fn.speed == 1  # register's keywords: the object's attributes
    with pytest.raises(
        ConfigError, match=r"test.kind: 'built' is not one of built_in \(did you mean"
    ):
        kind.get("built")


def test_a_users_entry_under_a_built_in_name_wins_over_the_module_imported_later(kind):
    def mine():
        return "mine"

    kind.register("built_in")(mine)  # imports the built-in's module first
    assert "kind_definitions" in sys.modules
    assert kind.get("built_in") is mine
    kind.unregister("built_in")
    assert "built_in" not in kind


def test_a_module_that_does_not_register_its_name_is_named(tmp_path, monkeypatch):
    (tmp_path / "silent_definitions.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    kind = Registry("test.kind", {"missing": "silent_definitions"})
    with pytest.raises(RuntimeError, match="silent_definitions does not register 'missing'"):
        kind.get("missing")


def test_the_config_check_lists_every_kind_without_importing_torch():
    code = (
        "import sys; from grpo import registry; "
        "names = [r.names() for r in (registry.ADVANTAGE_ESTIMATORS, registry.MULTI_OBJECTIVE_AGGREGATIONS, "
        "registry.POLICY_LOSSES, registry.LOSS_AGGREGATIONS)]; "
        "assert 'gae' in names[0] and 'normalize_then_sum' in names[1], names; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
