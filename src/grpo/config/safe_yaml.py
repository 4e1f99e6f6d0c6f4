"""Reading YAML that a user wrote (a config file, an override, a checkpoint's config.yaml), bounded.

A YAML file is untrusted input. `yaml.safe_load` already refuses to build
Python objects, but three things about it still reach the trainer:

- aliases: `&a [...]` used nine times nine levels deep is a 700-byte file whose
  value has 9^9 elements once anything walks it ("billion laughs"); every value
  is therefore counted with its aliases expanded, and a value of more than
  MAX_NODES elements is refused;
- nesting: the composer recurses per level, so `[[[[...]]]]` thousands deep is a
  RecursionError; more than MAX_DEPTH levels are refused while composing;
- duplicate keys: YAML's last one silently wins, so `max_steps: 1` written twice
  in a section hides one of them; a mapping that repeats a key is refused.

Files are read as UTF-8 and at most MAX_BYTES long. Every refusal is a
ConfigError naming the file (or override) and, where there is one, the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from grpo.config.errors import ConfigError

MAX_BYTES = 1 << 20
"""A config file is a few kilobytes; a megabyte leaves room for long few-shot texts."""
MAX_DEPTH = 32
"""Levels of nesting: a config is sections, keys, lists of lists at most."""
MAX_NODES = 100_000
"""Elements of a value with its aliases expanded: far more than any config, far below what hurts."""


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, mark=None):
        super().__init__(problem)
        self.problem, self.mark = problem, mark


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting while composing and repeated keys while constructing."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(
                    f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # SafeLoader's own error names an unhashable key
                if key in seen:
                    raise _Refused(
                        f"the key {shown(key)} appears twice in one mapping (first on line "
                        f"{seen[key].line + 1}); keep one of them",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def escaped(text: str) -> str:
    """`text` with every character that is not printable (but newlines and tabs) written as Python
    writes it in a string literal: a terminal's escape sequences (ESC[2J clears the screen) and
    bidirectional controls (U+202E reverses what follows) shown, not run. What grpo prints to the
    console goes through it: names, paths and texts a user or a model wrote reach it."""
    if all(line.isprintable() for line in text.split("\n")):
        return text
    return "".join(
        c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def not_a_file(path: Path) -> str | None:
    """Why `path` cannot be read as a file the user wrote, in words for an error (None: it can):
    it does not exist, is a directory, or is something else, such as /dev/zero or a FIFO, which
    reads without end or blocks."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    return "is not a regular file (a device, FIFO or socket)"


def expanded_size(value: Any, limit: int = MAX_NODES) -> int:
    """Elements of `value` counting each alias as the copy it stands for; stops counting past
    `limit` (so a bomb is measured in at most `limit` steps)."""
    count, stack = 0, [value]
    while stack and count <= limit:
        node = stack.pop()
        count += 1
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return count


def shown(value: Any, width: int = 120) -> str:
    """repr(value) cut to `width` characters, for messages (a value may be megabytes)."""
    if isinstance(value, (list, tuple, dict)) and expanded_size(value, 1000) > 1000:
        return f"<a {type(value).__name__} too large to show>"
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


def parse(text: str, where: str) -> Any:
    """The YAML document `text` as plain data, bounded as the module says; `where` names it in errors."""
    try:
        value = yaml.load(text, Loader=_BoundedLoader)
    except _Refused as e:
        line = f" (line {e.mark.line + 1})" if e.mark is not None else ""
        raise ConfigError(f"{where}{line}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({_first_lines(str(e))})") from None
    except ValueError as e:  # a constructor's own limit, e.g. an integer of more than 4,300 digits
        raise ConfigError(
            f"{where}: a value cannot be read ({_first_lines(str(e), 1, 160)})"
        ) from None
    except RecursionError:  # a structure the depth count does not see (a flow scalar's parser, say)
        raise ConfigError(f"{where}: nested too deeply to read; write it flatter") from None
    if expanded_size(value) > MAX_NODES:
        raise ConfigError(
            f"{where}: its aliases expand to more than {MAX_NODES:,} values (a YAML 'billion laughs'?); "
            "write the values out instead of nesting aliases"
        )
    return value


def read(path: str | Path, what: str = "config file") -> Any:
    """The YAML file at `path`, read as UTF-8, at most MAX_BYTES, parsed by `parse`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(
                f"{what} {path}: {size:,} bytes, more than a config's {MAX_BYTES:,}; is it the right file?"
            )
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} (line {line}): not UTF-8 text (byte {data[e.start]:#04x}); save it as UTF-8"
        ) from None
    return parse(text, str(path))


def _first_lines(message: str, lines: int = 4, width: int = 300) -> str:
    text = " ".join(line.strip() for line in message.splitlines()[:lines] if line.strip())
    return text if len(text) <= width else text[:width] + "..."
