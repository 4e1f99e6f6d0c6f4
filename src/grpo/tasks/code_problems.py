"""The built-in `code` task's problems, written for this project (HumanEval's conventions).

Each problem is a short function whose body is one `return` expression; the
prompt ends with `    return ` so a completion is just that expression
(`x + 1`), a few characters long. Few argument names recur (`x`; `a, b`;
`xs`; `s`) so that the same short expressions answer many problems: a tiny
character-level model can stumble on a passing completion by chance and
learn from it, and a real model reads the docstring and the type hints.

`test` defines `check(candidate)` with several asserts; the program run is
prompt + completion + "\\n" + test + "\\ncheck(<entry_point>)\\n".
`canonical_solution` is the expression alone (not a whole body, as the
prompt already holds the `return`).

HELD_OUT names the problems kept for evaluation: two per argument family,
each a sibling of a training problem (`triple` next to `double`), so a model
that learned the training problems has a fair chance on them.
"""

from __future__ import annotations

from typing import Any

HINTS = {"x": "x: int", "a, b": "a: int, b: int", "xs": "xs: list[int]", "s": "s: str"}


def _problem(
    name: str, args: str, returns: str, doc: str, solution: str, cases: list[tuple[str, Any]]
) -> dict[str, str]:
    prompt = f'def {name}({HINTS[args]}) -> {returns}:\n    """{doc}"""\n    return '
    asserts = "".join(f"    assert candidate({call}) == {expected!r}\n" for call, expected in cases)
    return {
        "task_id": f"code/{name}",
        "prompt": prompt,
        "test": f"def check(candidate):\n{asserts}",
        "entry_point": name,
        "canonical_solution": solution,
    }


PROBLEMS: list[dict[str, str]] = [
    # one integer x
    _problem("identity", "x", "int", "Return x unchanged.", "x", [("3", 3), ("-7", -7), ("0", 0)]),
    _problem(
        "add_one", "x", "int", "Return x plus one.", "x + 1", [("3", 4), ("-1", 0), ("10", 11)]
    ),
    _problem(
        "subtract_one", "x", "int", "Return x minus one.", "x - 1", [("3", 2), ("0", -1), ("10", 9)]
    ),
    _problem(
        "double", "x", "int", "Return x times two.", "x * 2", [("3", 6), ("-4", -8), ("0", 0)]
    ),
    _problem(
        "triple", "x", "int", "Return x times three.", "x * 3", [("3", 9), ("-2", -6), ("1", 3)]
    ),
    _problem("square", "x", "int", "Return x squared.", "x * x", [("3", 9), ("-4", 16), ("1", 1)]),
    _problem("cube", "x", "int", "Return x cubed.", "x ** 3", [("2", 8), ("-3", -27), ("1", 1)]),
    _problem(
        "negate",
        "x",
        "int",
        "Return x with its sign flipped.",
        "-x",
        [("3", -3), ("-5", 5), ("0", 0)],
    ),
    _problem(
        "absolute",
        "x",
        "int",
        "Return the absolute value of x.",
        "abs(x)",
        [("3", 3), ("-5", 5), ("0", 0)],
    ),
    _problem(
        "half",
        "x",
        "int",
        "Return x divided by two, rounded down.",
        "x // 2",
        [("7", 3), ("8", 4), ("-3", -2)],
    ),
    _problem(
        "last_digit",
        "x",
        "int",
        "Return the last decimal digit of x, for x >= 0.",
        "x % 10",
        [("123", 3), ("7", 7), ("40", 0)],
    ),
    _problem(
        "is_even",
        "x",
        "bool",
        "Return True when x is even.",
        "x % 2 == 0",
        [("4", True), ("7", False), ("0", True), ("-3", False)],
    ),
    _problem(
        "is_odd",
        "x",
        "bool",
        "Return True when x is odd.",
        "x % 2 == 1",
        [("4", False), ("7", True), ("0", False), ("-3", True)],
    ),
    _problem(
        "is_positive",
        "x",
        "bool",
        "Return True when x is greater than zero.",
        "x > 0",
        [("4", True), ("0", False), ("-2", False)],
    ),
    # two integers a, b
    _problem(
        "first",
        "a, b",
        "int",
        "Return the first of the two numbers.",
        "a",
        [("1, 2", 1), ("5, -3", 5), ("0, 9", 0)],
    ),
    _problem(
        "second",
        "a, b",
        "int",
        "Return the second of the two numbers.",
        "b",
        [("1, 2", 2), ("5, -3", -3), ("0, 9", 9)],
    ),
    _problem(
        "add",
        "a, b",
        "int",
        "Return the sum of a and b.",
        "a + b",
        [("1, 2", 3), ("5, -3", 2), ("0, 0", 0)],
    ),
    _problem(
        "subtract",
        "a, b",
        "int",
        "Return a minus b.",
        "a - b",
        [("5, 2", 3), ("1, 4", -3), ("0, 0", 0)],
    ),
    _problem(
        "multiply",
        "a, b",
        "int",
        "Return the product of a and b.",
        "a * b",
        [("3, 4", 12), ("-2, 5", -10), ("7, 0", 0)],
    ),
    _problem(
        "larger",
        "a, b",
        "int",
        "Return the larger of a and b.",
        "max(a, b)",
        [("3, 4", 4), ("9, -1", 9), ("2, 2", 2)],
    ),
    _problem(
        "smaller",
        "a, b",
        "int",
        "Return the smaller of a and b.",
        "min(a, b)",
        [("3, 4", 3), ("9, -1", -1), ("2, 2", 2)],
    ),
    _problem(
        "is_equal",
        "a, b",
        "bool",
        "Return True when a equals b.",
        "a == b",
        [("3, 3", True), ("3, 4", False), ("-1, 1", False)],
    ),
    _problem(
        "divides",
        "a, b",
        "bool",
        "Return True when a is divisible by b.",
        "a % b == 0",
        [("6, 3", True), ("7, 2", False), ("0, 5", True)],
    ),
    _problem(
        "distance",
        "a, b",
        "int",
        "Return how far apart a and b are.",
        "abs(a - b)",
        [("3, 8", 5), ("8, 3", 5), ("-2, 2", 4)],
    ),
    # a list of integers xs
    _problem(
        "total",
        "xs",
        "int",
        "Return the sum of the numbers in xs.",
        "sum(xs)",
        [("[1, 2, 3]", 6), ("[]", 0), ("[-4, 4, 5]", 5)],
    ),
    _problem(
        "count",
        "xs",
        "int",
        "Return how many numbers xs holds.",
        "len(xs)",
        [("[1, 2, 3]", 3), ("[]", 0), ("[7]", 1)],
    ),
    _problem(
        "first_item",
        "xs",
        "int",
        "Return the first number in xs.",
        "xs[0]",
        [("[4, 2, 3]", 4), ("[7]", 7), ("[-1, 0]", -1)],
    ),
    _problem(
        "last_item",
        "xs",
        "int",
        "Return the last number in xs.",
        "xs[-1]",
        [("[4, 2, 3]", 3), ("[7]", 7), ("[-1, 0]", 0)],
    ),
    _problem(
        "largest",
        "xs",
        "int",
        "Return the largest number in xs.",
        "max(xs)",
        [("[4, 9, 3]", 9), ("[7]", 7), ("[-1, -5]", -1)],
    ),
    _problem(
        "sorted_copy",
        "xs",
        "list[int]",
        "Return the numbers of xs in increasing order.",
        "sorted(xs)",
        [("[3, 1, 2]", [1, 2, 3]), ("[]", []), ("[5, -5]", [-5, 5])],
    ),
    _problem(
        "reversed_items",
        "xs",
        "list[int]",
        "Return the numbers of xs in reverse order.",
        "xs[::-1]",
        [("[3, 1, 2]", [2, 1, 3]), ("[]", []), ("[5]", [5])],
    ),
    _problem(
        "doubled",
        "xs",
        "list[int]",
        "Return a list of each number in xs times two.",
        "[x * 2 for x in xs]",
        [("[1, 2, 3]", [2, 4, 6]), ("[]", []), ("[-1]", [-2])],
    ),
    # a string s
    _problem(
        "length",
        "s",
        "int",
        "Return the number of characters in s.",
        "len(s)",
        [("'abc'", 3), ("''", 0), ("'a b'", 3)],
    ),
    _problem(
        "reverse",
        "s",
        "str",
        "Return s backwards.",
        "s[::-1]",
        [("'abc'", "cba"), ("''", ""), ("'ab c'", "c ba")],
    ),
    _problem(
        "shout",
        "s",
        "str",
        "Return s in upper case.",
        "s.upper()",
        [("'abc'", "ABC"), ("'Hi!'", "HI!"), ("''", "")],
    ),
    _problem(
        "whisper",
        "s",
        "str",
        "Return s in lower case.",
        "s.lower()",
        [("'ABC'", "abc"), ("'Hi!'", "hi!"), ("''", "")],
    ),
    _problem(
        "first_char",
        "s",
        "str",
        "Return the first character of s.",
        "s[0]",
        [("'abc'", "a"), ("'z'", "z"), ("' x'", " ")],
    ),
    _problem(
        "twice",
        "s",
        "str",
        "Return s repeated two times.",
        "s * 2",
        [("'ab'", "abab"), ("''", ""), ("'x'", "xx")],
    ),
    _problem(
        "is_empty",
        "s",
        "bool",
        "Return True when s has no characters.",
        's == ""',
        [("''", True), ("'a'", False), ("' '", False)],
    ),
    _problem(
        "trim",
        "s",
        "str",
        "Return s without spaces at either end.",
        "s.strip()",
        [("'  ab '", "ab"), ("'ab'", "ab"), ("' '", "")],
    ),
]

HELD_OUT = frozenset(
    f"code/{name}"
    for name in (
        "subtract_one",
        "triple",
        "is_odd",
        "smaller",
        "distance",
        "last_item",
        "whisper",
        "trim",
    )
)
"""task_ids evaluated, never trained on."""
