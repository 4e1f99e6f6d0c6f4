"""What crosses the boundary to a generation server is checked on both sides: a server's answer
is refused unless every count, token id, length, logprob and the weights' version are what the
request allows; a request is refused unless its prompts, sizes and settings are in bounds; the
weight-transfer announcements must name exactly the served model's tensors."""

import math

import pytest

from grpo.rollout import wire
from grpo.rollout.types import SEED_BOUND, SamplingParams

PARAMS = SamplingParams(max_new_tokens=3, temperature=0.9)


def _answer(token_ids, logprobs=None, reasons=None, version=4):
    return {
        "weights_version": version,
        "choices": [
            {
                "index": i,
                "token_ids": ids,
                "logprobs": None if logprobs is None else {"token_logprobs": logprobs[i]},
                "finish_reason": (reasons or ["stop"] * len(token_ids))[i],
            }
            for i, ids in enumerate(token_ids)
        ],
    }


def test_a_good_answer_is_read_in_index_order():
    answer = _answer([[5, 2], [7, 8, 9]], [[-0.5, -1.0], [-0.1, -0.2, -0.3]], ["stop", "length"])
    answer["choices"].reverse()  # prompt-major by index, whatever order the list holds
    got = wire.parse_completion_answer(answer, 1, 2, vocab=10, params=PARAMS, version=4)
    assert got.token_ids == [[5, 2], [7, 8, 9]]
    assert got.truncated == [False, True]
    assert got.logprobs == [[-0.5, -1.0], [-0.1, -0.2, -0.3]]


@pytest.mark.parametrize(
    "answer,why",
    [
        (_answer([[5, 2]], [[-0.5, -1.0]], version=3), "weights version 3, not the step's"),
        (_answer([[5, 2], [1]], [[-0.5, -1.0], [-1.0]]), "2 choices for 1 prompts x 1"),
        (_answer([[5, 10]], [[-0.5, -1.0]]), r"not a token id in \[0, 10\)"),
        (_answer([[5, -1]], [[-0.5, -1.0]]), r"not a token id in \[0, 10\)"),
        (_answer([[1, 2, 3, 4]], [[-1.0] * 4]), "4 tokens, not 1 to max_tokens=3"),
        (_answer([[]], [[]]), "0 tokens"),
        (_answer([[5, 2]], [[-0.5, math.nan]]), "not finite"),
        (_answer([[5, 2]], [[-0.5]]), "one token logprob per token"),
        (_answer([[5, 2]], [[-0.5, "x"]]), "not a number"),
        (_answer([[5, 2]], [[-0.5, -1.0]], ["length"]), "stopped for length after 2 tokens"),
        (_answer([[5, 2]], [[-0.5, -1.0]], ["abort"]), "not stop or length"),
        ({"choices": "x", "weights_version": 4}, "holds no choices"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_an_answer_that_breaks_the_request_is_refused(answer, why):
    with pytest.raises(wire.WireError, match=why):
        wire.parse_completion_answer(answer, 1, 1, vocab=10, params=PARAMS, version=4)


def test_a_greedy_answer_has_no_logprobs_and_a_duplicate_index_is_refused():
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0)
    assert wire.parse_completion_answer(_answer([[1]]), 1, 1, 10, greedy, 4).logprobs is None
    with pytest.raises(wire.WireError, match="logprobs for a greedy request"):
        wire.parse_completion_answer(_answer([[1]], [[-1.0]]), 1, 1, 10, greedy, 4)
    twice = _answer([[1], [2]], [[-1.0], [-1.0]])
    twice["choices"][1]["index"] = 0
    with pytest.raises(wire.WireError, match="indexes are not 0 .. N-1"):
        wire.parse_completion_answer(twice, 1, 2, 10, PARAMS, 4)


def test_strict_json_refuses_nan_and_bad_bytes():
    with pytest.raises(wire.WireError, match="NaN is not a JSON number"):
        wire.loads(b'{"x": NaN}', "the answer")
    with pytest.raises(wire.WireError, match="not JSON"):
        wire.loads(b"\xff\xfe", "the answer")
    with pytest.raises(ValueError):
        wire.dumps({"x": math.inf})


def test_a_request_round_trips_and_its_bounds_hold():
    body = wire.completion_request(
        "tiny", [[1, 2], [3]], 4, PARAMS, [7, SEED_BOUND - 1], [0], ["\n"], 5
    )
    request = wire.parse_completion_request(wire.loads(wire.dumps(body), "r"), 10, 64)
    assert request.prompts == [[1, 2], [3]] and request.n == 4
    assert request.params == PARAMS
    assert request.seeds == [7, SEED_BOUND - 1]
    assert request.eos_token_ids == [0] and request.stop == ["\n"] and request.version == 5
    bad = [
        ({"prompt": [[1, 10]]}, r"not a token id in \[0, 10\)"),
        ({"prompt": []}, "at least one prompt"),
        ({"prompt": [[1]], "max_tokens": 64}, "exceed the model's 64"),
        ({"prompt": [[1]], "n": wire.MAX_N + 1}, "n must be an integer"),
        ({"prompt": [[1]], "temperature": -1}, "temperature must be in"),
        ({"prompt": [[1]], "seeds": [1, 2]}, "2 for 1 prompts"),
        ({"prompt": [[1]], "seeds": [SEED_BOUND]}, "seeds"),
        ({"prompt": [[1]], "stop": ["x" * 300]}, "stop must hold strings"),
        ({"prompt": [[1]], "ignore_eos": "false"}, "ignore_eos must be true or false"),
        ({"prompt": [[1]] * (wire.MAX_PROMPTS + 1)}, "at most"),
        ("x", "JSON object"),
    ]
    for body, why in bad:
        with pytest.raises(wire.WireError, match=why):
            wire.parse_completion_request(body, 10, 64)


def test_an_answer_limit_covers_an_honest_answer():
    prompts, n, params = [[1] * 20] * 3, 4, SamplingParams(max_new_tokens=50, temperature=1.0)
    completions = [[9] * 50] * 12
    answer = wire.completion_answer(
        "tiny",
        prompts,
        completions,
        [True] * 12,
        [[-1.2345678901234567e-05] * 50] * 12,
        ["\u00e9" * 100] * 12,
        1,
    )
    assert len(wire.dumps(answer)) < wire.answer_limit(prompts, n, params.max_new_tokens)


HELD = {"a.weight": ("float32", (2, 3)), "b.bias": ("bfloat16", (3,))}


def _update(**changes):
    info = {
        "names": ["a.weight", "b.bias"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[2, 3], [3]],
        "packed": True,
        "packed_buffer_size_bytes": 1 << 20,
        "weights_version": 2,
    }
    return {"update_info": {**info, **changes}}


def test_a_push_must_announce_exactly_the_served_tensors():
    assert wire.parse_update_info(_update(), HELD)["version"] == 2
    for changes, why in [
        ({"names": ["a.weight", "c"]}, r"missing \['b.bias'\], unknown \['c'\]"),
        ({"names": ["a.weight", "a.weight"]}, "every tensor of the served model once"),
        ({"shapes": [[3, 2], [3]]}, r"a.weight is float32 \[3, 2\]"),
        ({"dtype_names": ["float32", "float32"]}, "b.bias is float32"),
        ({"names": ["a.weight"]}, "differ in length"),
        ({"weights_version": 0}, "weights_version must be an integer in"),
        ({"packed": False}, "packed must be true"),
    ]:
        with pytest.raises(wire.WireError, match=why):
            wire.parse_update_info(_update(**changes), HELD)


def test_init_info_is_the_two_process_group():
    good = {"master_address": "127.0.0.1", "master_port": 4000, "rank_offset": 1, "world_size": 2}
    assert wire.parse_init_info({"init_info": good})["master_port"] == 4000
    for changes in ({"world_size": 3}, {"master_port": 70000}, {"master_address": ""}):
        with pytest.raises(wire.WireError):
            wire.parse_init_info({"init_info": {**good, **changes}})


def test_model_difference_names_what_differs():
    ours = wire.describe_model(
        type("C", (), {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
        [("w", "float32", (2, 2))],
        10,
    )
    assert wire.model_difference(ours, wire.loads(wire.dumps(ours), "x")) is None
    assert "vocab_size is 11" in wire.model_difference(ours, {**ours, "vocab_size": 11})
    other = {**ours, "tensors": [["w", "float32", [2, 3]]]}
    assert "its w is float32 [2, 3]" in wire.model_difference(ours, other)
    renamed = {**ours, "tensors": [["v", "float32", [2, 2]]]}
    assert "differ by name" in wire.model_difference(ours, renamed)
    assert "does not describe" in wire.model_difference(ours, None)
