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


# ------------------------------------------------------------------ vLLM's /inference/v1/generate


def _vllm_choice(index, tokens, reason="stop", label="3", logprobs=True):
    choice = {
        "index": index,
        "token_ids": tokens,
        "finish_reason": reason,
        "weight_versions": [{"version": label, "start": 0, "end": len(tokens)}],
    }
    if logprobs:
        choice["logprobs"] = {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]}
    return choice


def test_a_vllm_answer_is_read_and_its_labels_checked():
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    answer = {"choices": [_vllm_choice(1, [4, 5, 6], "length"), _vllm_choice(0, [7])]}
    assert wire.stale_label(answer, "3") is None
    done = wire.parse_generate_answer(answer, 2, 10, params)
    assert done.token_ids == [[7], [4, 5, 6]] and done.truncated == [False, True]
    assert done.logprobs == [[-0.5], [-0.5] * 3]
    # a token sampled by other weights (a restarted server says "default") is named
    answer["choices"][1]["weight_versions"].append({"version": "default", "start": 3, "end": 3})
    assert wire.stale_label(answer, "3") == "default"
    # greedy: one choice, repeated for the group, no logprobs
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    one = {"choices": [_vllm_choice(0, [2, 2], logprobs=False)]}
    done = wire.parse_generate_answer(one, 3, 10, greedy)
    assert done.token_ids == [[2, 2]] * 3 and done.logprobs is None


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda a: a["choices"][0].pop("weight_versions"), "which weights sampled it"),
        (lambda a: a["choices"][0]["token_ids"].append(99), "not a token id"),
        (
            lambda a: a["choices"][0]["logprobs"]["content"][0].update(token_id=5),
            "another token than the one sampled",
        ),
        (
            lambda a: a["choices"][0]["logprobs"]["content"][0].update(logprob=True),
            "not a finite number",
        ),
        (lambda a: a["choices"].append(_vllm_choice(1, [1])), "2 choices for 1"),
        (lambda a: a["choices"][0].update(finish_reason="abort"), "not stop or length"),
    ],
)
def test_a_vllm_answer_that_breaks_the_request_is_refused(change, why):
    answer = {"choices": [_vllm_choice(0, [4, 6])]}
    change(answer)
    with pytest.raises(wire.WireError, match=why):
        wire.stale_label(answer, "3")
        wire.parse_generate_answer(answer, 1, 10, SamplingParams(max_new_tokens=3, temperature=1))


def test_a_vllm_answer_limit_covers_an_honest_answer():
    """vLLM writes a sampled token's id and logprob twice (as itself and as its top candidate)."""
    import json

    tokens = list(range(100))
    choice = _vllm_choice(0, tokens)
    for entry in choice["logprobs"]["content"]:
        entry.update(logprob=-1.2345678901234567, rank=123456, top_logprobs=[dict(entry)])
    answer = {"request_id": "x" * 64, "choices": [choice] * 8, "usage": {"total_tokens": 10**6}}
    assert len(json.dumps(answer)) < wire.generate_answer_limit(8, 100)
