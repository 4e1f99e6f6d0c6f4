"""math_answer (grpo.rewards.math_answer): every final-answer form, the gold forms, exact numbers,
math-verify's equivalences, bounded time on adversarial input; the built-in math and format
reward names resolve."""

import threading
import time

import pytest

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.rewards.math_answer import MathAnswer, as_number, extract_answer, normalise_gold
from grpo.rewards.reward_set import RewardSet


@pytest.fixture(scope="module")
def math_answer():
    reward = MathAnswer(timeout=5.0)
    yield reward
    reward.close()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{x^{2} + \\frac{a}{b_{1}}} done", "x^{2} + \\frac{a}{b_{1}}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),  # the last box
        ("\\fbox{7}", "7"),
        ("unclosed \\boxed{3 and more", None),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,000\n", "1,000"),
        ("Answer: -5", "-5"),
        ("Answer: 3\nno, Answer: $4$.", "4"),  # dollar signs and the full stop dropped
        ("\\boxed{9} and later #### 10", "10"),  # whichever form comes last
        ("Answer: 5 ... \\boxed{6}", "6"),
        ("no final answer here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_forms_are_configurable():
    text = "\\boxed{1}\nAnswer: 2"
    assert extract_answer(text, ["boxed"]) == "1"
    assert extract_answer(text, ["answer"]) == "2"
    assert extract_answer("#### 3", ["boxed", "answer"]) is None
    cfg = config.from_dict({"rewards": {"funcs": ["math_answer"], "math_forms": ["boxed"]}})
    (reward,) = RewardSet.from_config(cfg.rewards, 16, {"answer"}).funcs
    assert reward(["Answer: 2", "\\boxed{2}"], answer=[2, 2]) == [0.0, 1.0]
    with pytest.raises(ConfigError, match="rewards.math_forms"):
        config.from_dict({"rewards": {"math_forms": ["latex"]}})


@pytest.mark.parametrize(
    "gold, expected",
    [
        (42, "42"),
        (-3, "-3"),
        (0.5, "0.5"),
        ("$\\frac{3}{4}$", "\\frac{3}{4}"),
        ("\\boxed{12}", "12"),
        ("The answer follows.\n#### 1,234", "1,234"),
        ("  7 ", "7"),
        ("", None),
        (None, None),
    ],
)
def test_gold_answers_in_every_form(gold, expected):
    assert normalise_gold(gold) == expected


def test_exact_numbers():
    assert as_number("1,000") == as_number("1000") == 1000
    assert as_number("0.5") == as_number("1/2") == as_number(".5")
    assert as_number("+3") == 3 and as_number("-3") == -3
    assert as_number("50%") == as_number("50\\%") == 50
    assert as_number("x+1") is None and as_number("1/0") is None


@pytest.mark.parametrize(
    "completion, gold, reward",
    [
        ("\\boxed{72}", "72", 1.0),
        ("#### 1,000", 1000, 1.0),  # commas in numbers
        ("Answer: -5", "-5", 1.0),
        ("Answer: 5", "-5", 0.0),  # negatives are not dropped
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # math-verify: LaTeX fraction = decimal
        ("\\boxed{\\frac{1}{2}}", 0.5, 1.0),
        ("\\boxed{1+x^2}", "$x^2+1$", 1.0),  # commutativity
        ("\\boxed{\\sqrt{4}}", "2", 1.0),
        ("\\boxed{x^2-1}", "(x-1)(x+1)", 1.0),
        ("\\boxed{x^2+2}", "x^2+1", 0.0),
        ("\\boxed{1}\n\\boxed{2}", "1", 0.0),  # the last answer counts, not any answer
        ("the answer is 72", "72", 0.0),  # no final-answer form: not read
        ("\\boxed{}", "0", 0.0),
        ("\\boxed{\\frac{1}{2} ]] }{ garbage $$ \\\\}", "1", 0.0),  # garbage is 0, not an error
    ],
)
def test_math_answer_rewards(math_answer, completion, gold, reward):
    assert math_answer([completion], answer=[gold]) == [reward]


def test_chat_completions_and_missing_gold(math_answer):
    chat = [[{"role": "assistant", "content": "\\boxed{4}"}]]
    assert math_answer(chat, answer=["4"]) == [1.0]
    # missing, not 0
    assert math_answer(["\\boxed{4}", "\\boxed{4}"], answer=[None, ""]) == [
        None,
        None,
    ]
    assert math_answer(["\\boxed{4}"]) == [None]  # no answer column at all


def test_adversarial_input_returns_promptly(math_answer):
    huge = "x" * 5_000_000 + "\\boxed{7}"
    deep = "\\boxed{" * 20_000 + "1" + "}" * 20_000
    unclosed = "\\boxed{" * 200_000
    start = time.perf_counter()
    assert math_answer([huge, deep, unclosed], answer=["7", "1", "1"]) == [1.0, 0.0, 0.0]
    assert time.perf_counter() - start < 5.0
    # too long to compare
    assert math_answer(["\\boxed{" + "1+" * 5000 + "1}"], answer=["2"]) == [0.0]


def test_a_comparison_that_does_not_finish_is_bounded():
    reward = MathAnswer(timeout=1.0)
    try:
        reward(["\\boxed{1}"], answer=["x"])  # starts the worker (not timed)
        start = time.perf_counter()
        # sympy expands this power tower for far longer than the bound
        assert reward(["\\boxed{9^{9^{9^{9}}}}"], answer=["2^{2^{2^{2^{2^{2}}}}}"]) == [0.0]
        elapsed = time.perf_counter() - start
        assert reward.timeouts == 1 and elapsed < 10.0  # it did overrun, and was cut at the bound
        # after a timeout the next comparison gets a fresh worker and still works
        assert reward(["\\boxed{\\frac{2}{4}}"], answer=["0.5"]) == [1.0]
    finally:
        reward.close()


def test_works_outside_the_main_thread(math_answer):
    """math-verify's own timeout needs the main thread; the bounded worker does not."""
    out = []
    thread = threading.Thread(
        target=lambda: out.append(math_answer(["\\boxed{\\frac{1}{4}}"], answer=["0.25"]))
    )
    thread.start()
    thread.join(60)
    assert out == [[1.0]]


def test_builtin_names_resolve():
    cfg = config.from_dict(
        {
            "rewards": {
                "funcs": ["math_answer", "think_format", "think_format_lenient", "think_tag_count"]
            }
        }
    )
    rewards = RewardSet.from_config(cfg.rewards, 16, {"answer"})
    assert rewards.names == [
        "math_answer",
        "think_format",
        "think_format_lenient",
        "think_tag_count",
    ]
    rewards.funcs[0].close()
