"""The loop never branches on which estimator, aggregation or loss a run chose: each is a
registered entry (grpo.registry) that says what it needs, so src/grpo/training/ holds no
comparison against their names nor against the config keys that choose them."""

from __future__ import annotations

import ast
from pathlib import Path

from grpo import registry

TRAINING = Path(__file__).resolve().parents[2] / "src" / "grpo" / "training"

CHOOSING_KEYS = {"advantage_estimator", "policy_loss", "loss_type", "multi_objective_aggregation"}
"""The config keys whose values are registered names."""


def _registered_names() -> set[str]:
    kinds = (
        registry.ADVANTAGE_ESTIMATORS,
        registry.MULTI_OBJECTIVE_AGGREGATIONS,
        registry.POLICY_LOSSES,
        registry.LOSS_AGGREGATIONS,
    )
    return {name for kind in kinds for name in kind.names()}


def _names_in(node: ast.AST) -> set[str]:
    """The string constants of an operand: itself, or the elements of a tuple, list or set."""
    elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _choosing_key(node: ast.AST) -> str | None:
    """`a.loss_type`, `cfg.algorithm.policy_loss`, a variable named advantage_estimator, ..."""
    if isinstance(node, ast.Attribute) and node.attr in CHOOSING_KEYS:
        return node.attr
    if isinstance(node, ast.Name) and node.id in CHOOSING_KEYS:
        return node.id
    return None


def name_branches(path: Path, names: set[str]) -> list[str]:
    """Each comparison (if, elif, a conditional expression, a match, any `==`/`in`) in `path`
    against a registered name or a choosing key, and each dict keyed by registered names: where,
    and what."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                hit = _names_in(operand) & names or _choosing_key(operand)
                if hit:
                    found.append(f"{path.name}:{node.lineno}: compares with {hit}")
        elif isinstance(node, ast.Match):
            cases = {
                p.value.value
                for case in node.cases
                for p in ast.walk(case.pattern)
                if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant)
            }
            if cases & names or _choosing_key(node.subject):
                found.append(f"{path.name}:{node.lineno}: matches on a registered name")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)} & names
            if keys:
                found.append(f"{path.name}:{node.lineno}: a table keyed by {keys}")
    return found


def test_the_training_loop_has_no_branch_on_a_registered_name():
    names = _registered_names()
    assert {"gae", "normalize_then_sum", "vespo", "luspo", "grpo"} <= names
    found = [line for path in sorted(TRAINING.glob("*.py")) for line in name_branches(path, names)]
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind_of_branch(tmp_path):
    names = _registered_names()
    source = tmp_path / "branches.py"
    source.write_text(
        "def f(cfg, a, estimator_name):\n"
        "    if a.advantage_estimator == 'grpo':\n"  # a choosing key
        "        pass\n"
        "    elif estimator_name in ('gae', 'other'):\n"  # a registered name in a tuple
        "        pass\n"
        "    x = 1 if cfg.algorithm.loss_type != 'x' else 2\n"
        "    match a.policy_loss:\n"
        "        case 'vespo':\n"
        "            pass\n"
        "    table = {'normalize_then_sum': 1}\n"
        "    return 'dapo' == estimator_name\n"
    )
    found = name_branches(source, names)
    assert sorted({int(line.split(":")[1]) for line in found}) == [2, 4, 6, 7, 10, 11], found
    clean = tmp_path / "clean.py"
    clean.write_text("def f(run):\n    return run.aggregation(run.inputs, run.estimator)\n")
    assert name_branches(clean, names) == []
