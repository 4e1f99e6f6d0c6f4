"""A config read and written: YAML (through grpo.config.safe_yaml) and `section.key=value`
overrides, each value checked against its field's type with an error that names the key
(`from_dict`, `load`), and the resolved config a run saves (`save`)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from grpo.config import safe_yaml
from grpo.config.algorithm import resolved_rollout_correction
from grpo.config.errors import ConfigError
from grpo.config.presets import apply_preset, apply_task_rewards
from grpo.config.schema import Config, validate

MAX_INT = 2**63 - 1
"""The largest integer setting: what torch and NumPy hold in an int64 (a seed, a step count)."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; int is accepted for float."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(
                f"{key}: expected a list, got {safe_yaml.shown(value)}; write it as [a, b, ...]"
            )
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        return _plain_mapping(value, key)
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-5 (no dot) as a string; accept what Python reads as a number
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {safe_yaml.shown(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {safe_yaml.shown(value)}")
        if not -MAX_INT <= value <= MAX_INT:
            raise ConfigError(
                f"{key}: an integer of {value.bit_length()} bits is beyond any setting (at most 63 bits)"
            )
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {safe_yaml.shown(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(
                f"{key}: expected a string, got {safe_yaml.shown(value)}; quote it in YAML"
            )
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


PLAIN_MAPPING_ENTRIES = 64
PLAIN_VALUE_CHARS = 4096


def _plain_mapping(value: Any, key: str) -> dict[str, Any]:
    """A mapping of names to plain values (string, number, bool, null), bounded in size: what a
    config may hand to code it does not own (a chat template's variables)."""
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key}: expected a mapping of names to values (e.g. {{enable_thinking: false}}), "
            f"got {safe_yaml.shown(value)}"
        )
    if len(value) > PLAIN_MAPPING_ENTRIES:
        raise ConfigError(
            f"{key}: {len(value)} entries; at most {PLAIN_MAPPING_ENTRIES} are taken, keep those the template reads"
        )
    for name, item in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(
                f"{key}: {safe_yaml.shown(name)} is not a variable name; use letters, digits, _"
            )
        if item is not None and not isinstance(item, (str, int, float, bool)):
            raise ConfigError(
                f"{key}.{name}: expected a string, number, true/false or null, got {safe_yaml.shown(item)}"
            )
        if isinstance(item, str) and len(item) > PLAIN_VALUE_CHARS:
            raise ConfigError(
                f"{key}.{name}: a string of {len(item)} characters; at most {PLAIN_VALUE_CHARS}"
            )
    return dict(value)


MOVED_KEYS = {
    "model.cpu_kernels": "cpu.kernels",
    "training.kernels": "cpu.compile",
    "rollout.decoding": "cpu.decoding",
}
"""Keys of earlier versions and where they live now."""
ADDED_KEYS = {"rollout.max_staleness": 0, "rollout.weight_sync_steps": 1}
"""Keys added after checkpoints were first written, and what a saved config without them meant."""


def as_applied(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened config (dotted keys) as a run applies it: the keys added since filled with what
    their absence meant, and algorithm.rollout_correction `auto` resolved (so a checkpoint saved
    with `none` before `auto` existed is the same run as one with `auto` today)."""
    out = {**ADDED_KEYS, **flat}
    key, staleness = "algorithm.rollout_correction", out["rollout.max_staleness"]
    if isinstance(out.get(key), str) and isinstance(staleness, int):
        out[key] = resolved_rollout_correction(out[key], staleness)
    return out


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(
            f"{where}: expected a mapping of keys (e.g. {where}:\n  key: value), got {safe_yaml.shown(data)}"
        )
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if full in MOVED_KEYS:
            shown = (
                str(value).lower() if isinstance(value, bool) else safe_yaml.shown(value).strip("'")
            )
            raise ConfigError(
                f"{full} is now {MOVED_KEYS[full]} (the CPU layer's settings live under cpu:); "
                f"write {MOVED_KEYS[full]}: {shown}"
            )
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = (
                f"; did you mean '{prefix}{close[0]}'?"
                if close
                else f"; known keys: {', '.join(sorted(known))}"
            )
            raise ConfigError(f"unknown config key '{full}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """`data["a"]["b"]["c"] = value` for `a.b.c`, making the sections on the way; a key on the
    way that holds a value rather than a section is refused."""
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`algorithm.beta=0.04` -> ("algorithm.beta", 0.04); values are read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. training.max_steps=50")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    value = safe_yaml.parse(raw, f"override {key}") if raw.strip() else None
    return key, value


def from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated Config of `data` (a config as read; the caller's dict is not changed) with
    `overrides` (`section.key=value`) applied, then the preset and the task's reward filled in."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"config: expected a mapping of sections (model:, data:, training: ...), got "
            f"{type(data).__name__} {safe_yaml.shown(data, 60)}; see examples/ for the form"
        )
    if safe_yaml.expanded_size(data) > safe_yaml.MAX_NODES:
        raise ConfigError(
            f"config: more than {safe_yaml.MAX_NODES:,} values; a config is sections of settings"
        )
    data = copy.deepcopy(data or {})  # overrides must not change the caller's nested dicts
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    apply_preset(data)
    apply_task_rewards(data)
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or start from defaults when path is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        problem = safe_yaml.not_a_file(path)
        if problem:
            raise ConfigError(
                f"config file {path} {problem}; pass the path of a YAML file (see examples/)"
            )
        data = safe_yaml.read(path)
        if data is None:
            data = {}
    cfg = from_dict(data, overrides)
    if path is not None:
        _user_files_beside(cfg, path.parent)
    return cfg


def _user_files_beside(cfg: Config, base: Path) -> None:
    """A `file.py:function` reward or tool not found from the working directory is looked for
    beside the config file, so a config and its files can be moved together and run from anywhere."""

    def beside(spec: str) -> str:
        target, sep, name = spec.rpartition(":")
        if (
            sep
            and target.endswith(".py")
            and not Path(target).expanduser().is_file()
            and (base / target).is_file()
        ):
            return f"{base / target}:{name}"
        return spec

    cfg.rewards.funcs = [beside(spec) for spec in cfg.rewards.funcs]
    cfg.rollout.tools = [beside(spec) for spec in cfg.rollout.tools]
    environment = cfg.rollout.environment
    if isinstance(environment, dict):
        cfg.rollout.environment = {name: beside(spec) for name, spec in environment.items()}
    elif environment is not None:
        cfg.rollout.environment = beside(environment)


RESOLVED_HEADER = (
    "# written by grpo: the resolved config of a run, every key (edit your own config, not this)"
)
"""The first line of every config grpo writes, by which a run directory's config.yaml is known to
be grpo's (grpo.run.runlog.resolved_config_path); YAML reads it as a comment."""


def dumps(cfg: Config) -> str:
    """Every key of `cfg` as YAML, under RESOLVED_HEADER; `load` reads it back."""
    return RESOLVED_HEADER + "\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save(cfg: Config, path: str | Path) -> None:
    """`dumps(cfg)` at `path` (a run directory's copy is written by grpo.run.run_writes)."""
    Path(path).write_text(dumps(cfg))
