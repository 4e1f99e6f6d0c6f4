"""The code stays readable: no function in src/grpo/training/ or src/grpo/trl/ (the loop and
the TRL facade, where a long function used to hide the algorithm) over 80 lines, the loop's
module (trainer.py) under 300, no module in src/grpo over 900."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "grpo"
TRAINING = SRC / "training"
SHORT_FUNCTIONS = (TRAINING, SRC / "trl")
FUNCTION_LINES = 80
TRAINER_LINES = 300
MODULE_LINES = 900


def long_functions(path: Path, limit: int = FUNCTION_LINES) -> list[str]:
    """Every function or method of `path` longer than `limit` lines (its decorators, signature,
    docstring and body)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > limit:
                found.append(f"{path.name}:{first}: {node.name} is {length} lines")
    return found


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_function_in_training_or_the_trl_facade_is_over_80_lines():
    found = [
        line
        for folder in SHORT_FUNCTIONS
        for path in sorted(folder.glob("*.py"))
        for line in long_functions(path)
    ]
    assert not found, "\n".join(found)


def test_the_trainer_is_under_300_lines_and_no_module_over_900():
    assert lines(TRAINING / "trainer.py") < TRAINER_LINES
    too_long = {
        str(p.relative_to(SRC)): lines(p) for p in SRC.rglob("*.py") if lines(p) > MODULE_LINES
    }
    assert not too_long, too_long


def test_the_checks_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))  # with the def: 81 lines
    source = tmp_path / "long.py"
    source.write_text(f"@staticmethod\ndef long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(source) == ["long.py:1: long is 82 lines"]
    assert long_functions(source, limit=82) == []
    source.write_text("\n" * TRAINER_LINES)
    assert lines(source) >= TRAINER_LINES
