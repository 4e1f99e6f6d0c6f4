"""What crosses the process boundary between the `server` engine and a generation server, and the
checks on both sides: neither trusts what the other sends.

Generation is OpenAI's `/v1/completions` as vLLM serves it: `prompt` a list of token-id lists,
`n` completions each, vLLM's sampling fields (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `max_tokens`, `min_tokens`, `ignore_eos`, `stop`, `stop_token_ids`,
`seed`, `logprobs: 0` for the sampled token's logprob, `return_token_ids`); the choices come back
prompt-major (prompt i's n completions at i*n .. i*n+n-1) with their `token_ids`,
`logprobs.token_logprobs` and `finish_reason` ("stop" or "length"). grpo adds two fields: `seeds`,
one per prompt (a prompt's completions depend on its seed alone), and `weights_version`, which the
server refuses unless it holds exactly those weights, and which its answer carries back.

Every size is bounded before the work it would cost: a request's bytes (MAX_REQUEST_BYTES), its
prompts, completions, tokens and stop strings; an answer's bytes (`answer_limit`), its count of
choices, each token id inside the vocabulary, each completion within max_tokens, each logprob finite.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from grpo.rollout.types import SEED_BOUND, SamplingParams

MAX_REQUEST_BYTES = 64 << 20
"""Largest request body either side reads (a generation request's prompts, a push's metadata)."""
MAX_PROMPTS = 16_384
"""Most prompts in one generation request."""
MAX_N = 1024
"""Most completions per prompt."""
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKENS = 16, 256, 256
"""Stop strings (and their length) and stop token ids in one request."""
MAX_VERSION = 2**62
"""Weight versions are counted in [0, MAX_VERSION); 0 is a server's own weights (none pushed)."""


class WireError(ValueError):
    """A request or an answer that breaks the protocol; its message says which field and why."""


def _constant(name: str):
    raise WireError(f"{name} is not a JSON number")  # json accepts NaN and Infinity otherwise


def loads(data: bytes, what: str) -> Any:
    """Strict JSON (UTF-8, no NaN or Infinity) of at most what the caller read."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise WireError(f"{what} is not JSON ({type(error).__name__})") from None


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _int(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise WireError(f"{name} must be an integer in [{low}, {high}), got {str(value)[:40]}")
    return value


def _float(value, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"{name} must be a number, got {str(value)[:40]}")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise WireError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise WireError(f"{name} must be true or false, got {str(value)[:40]}")
    return value


def _list(value, name: str, most: int) -> list:
    if not isinstance(value, list) or len(value) > most:
        raise WireError(f"{name} must be a list of at most {most} items")
    return value


def token_ids(value, name: str, vocab: int, most: int) -> list[int]:
    """A list of at most `most` token ids, each in [0, vocab)."""
    ids = _list(value, name, most)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise WireError(f"{name} holds {str(token)[:40]}, not a token id in [0, {vocab})")
    return ids


# ---------------------------------------------------------------------------------- generation


def completion_request(
    model: str,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    seeds: list[int] | None,
    eos_token_ids: list[int],
    stop: list[str],
    version: int,
) -> dict:
    """The body of a `/v1/completions` request for `n` completions of each prompt."""
    sampled = params.temperature > 0
    return {
        "model": model,
        "prompt": [list(map(int, p)) for p in prompts],
        "n": n,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": list(eos_token_ids),
        "stop": list(stop),
        "logprobs": 0 if sampled else None,
        "return_token_ids": True,
        "seeds": seeds if sampled else None,
        "weights_version": version,
    }


@dataclass
class CompletionRequest:
    """A generation request, checked (the server's view)."""

    prompts: list[list[int]]
    n: int
    params: SamplingParams
    seeds: list[int] | None
    eos_token_ids: list[int]
    stop: list[str]
    version: int | None


def parse_completion_request(body: Any, vocab: int, max_model_len: int) -> CompletionRequest:
    """A `/v1/completions` body as a CompletionRequest, or WireError naming the field."""
    if not isinstance(body, dict):
        raise WireError("the request must be a JSON object")
    raw = body.get("prompt")
    if isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
        raw = [raw]  # one prompt as one list of ids
    prompts = _list(raw, "prompt", MAX_PROMPTS)
    if not prompts:
        raise WireError("prompt must hold at least one prompt (a list of token ids)")
    prompts = [token_ids(p, f"prompt[{i}]", vocab, max_model_len) for i, p in enumerate(prompts)]
    n = _int(body.get("n", 1), "n", 1, MAX_N + 1)
    max_tokens = _int(body.get("max_tokens", 16), "max_tokens", 1, max_model_len + 1)
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > max_model_len:
        raise WireError(
            f"a prompt of {longest} tokens and max_tokens {max_tokens} exceed the model's {max_model_len}"
        )
    top_k = body.get("top_k", 0)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_float(body.get("temperature", 1.0), "temperature", 0.0, 1e4),
        top_p=_float(body.get("top_p", 1.0), "top_p", 1e-9, 1.0),
        top_k=0 if top_k == -1 else _int(top_k, "top_k", 0, vocab + 1),
        ignore_eos=_bool(body.get("ignore_eos", False), "ignore_eos"),
        min_p=_float(body.get("min_p", 0.0), "min_p", 0.0, 1.0),
        repetition_penalty=_float(
            body.get("repetition_penalty", 1.0), "repetition_penalty", 1e-6, 1e6
        ),
        min_new_tokens=_int(body.get("min_tokens", 0), "min_tokens", 0, max_tokens + 1),
    )
    seeds = _seeds(body, len(prompts))
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else _list(stop, "stop", MAX_STOP_STRINGS)
    if not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop):
        raise WireError(f"stop must hold strings of at most {MAX_STOP_CHARS} characters")
    eos = token_ids(body.get("stop_token_ids") or [], "stop_token_ids", vocab, MAX_STOP_TOKENS)
    version = body.get("weights_version")
    version = None if version is None else _int(version, "weights_version", 0, MAX_VERSION)
    return CompletionRequest(prompts, n, params, seeds, eos, stop, version)


def _seeds(body: dict, num_prompts: int) -> list[int] | None:
    """grpo's `seeds` (one per prompt), or OpenAI's `seed` (the same for every prompt), or None."""
    if body.get("seeds") is not None:
        seeds = _list(body["seeds"], "seeds", MAX_PROMPTS)
        if len(seeds) != num_prompts:
            raise WireError(f"seeds: {len(seeds)} for {num_prompts} prompts, one per prompt")
        return [_int(s, "seeds[i]", 0, SEED_BOUND) for s in seeds]
    if body.get("seed") is not None:
        return [_int(body["seed"], "seed", 0, SEED_BOUND)] * num_prompts
    return None


def completion_answer(
    model: str,
    prompts: list[list[int]],
    completions: list[list[int]],
    truncated: list[bool],
    logprobs: list[list[float]] | None,
    texts: list[str],
    version: int,
) -> dict:
    """The answer to a generation request: one choice per completion, prompt-major."""
    n = len(completions) // max(len(prompts), 1)
    choices = [
        {
            "index": i,
            "text": texts[i],
            "token_ids": completions[i],
            "prompt_token_ids": prompts[i // n],
            "logprobs": None if logprobs is None else {"token_logprobs": logprobs[i]},
            "finish_reason": "length" if truncated[i] else "stop",
        }
        for i in range(len(completions))
    ]
    tokens = sum(len(c) for c in completions)
    return {
        "object": "text_completion",
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": sum(len(p) for p in prompts),
            "completion_tokens": tokens,
            "total_tokens": tokens + sum(len(p) for p in prompts),
        },
        "weights_version": version,
    }


def answer_limit(prompts: list[list[int]], n: int, max_tokens: int) -> int:
    """Bytes an honest answer to this request fits in: per completion its prompt echoed, its
    tokens with their logprobs, its text (at most 16 bytes a token) and the fields around them."""
    per_token = 8 + 26 + 16  # an id, a float's repr, the text of a token
    echoed = sum(len(p) for p in prompts) * n * 8
    return (1 << 20) + echoed + len(prompts) * n * (max_tokens * per_token + 512)


@dataclass
class Completions:
    """An answer, checked (the client's view): per completion, in request order."""

    token_ids: list[list[int]]
    truncated: list[bool]
    logprobs: list[list[float]] | None


def parse_completion_answer(
    answer: Any,
    num_prompts: int,
    n: int,
    vocab: int,
    params: SamplingParams,
    version: int,
) -> Completions:
    """A server's answer as Completions, or WireError naming what is wrong with it."""
    if not isinstance(answer, dict):
        raise WireError("the answer is not a JSON object")
    if answer.get("weights_version") != version:
        raise WireError(
            f"the answer was generated with weights version {str(answer.get('weights_version'))[:40]}, "
            f"not the step's ({version})"
        )
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != num_prompts * n:
        count = len(choices) if isinstance(choices, list) else "no"
        raise WireError(f"the answer holds {count} choices for {num_prompts} prompts x {n}")
    sampled = params.temperature > 0
    ids, truncated, logprobs = [], [], [] if sampled else None
    for i, choice in enumerate(sorted(choices, key=_index)):
        if _index(choice) != i:
            raise WireError("the answer's choice indexes are not 0 .. N-1")
        tokens = token_ids(choice.get("token_ids"), f"choices[{i}].token_ids", vocab, 1 << 30)
        if not 1 <= len(tokens) <= params.max_new_tokens:
            raise WireError(
                f"choices[{i}] holds {len(tokens)} tokens, not 1 to max_tokens={params.max_new_tokens}"
            )
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise WireError(f"choices[{i}].finish_reason is {str(reason)[:40]}, not stop or length")
        if reason == "length" and len(tokens) != params.max_new_tokens:
            raise WireError(f"choices[{i}] stopped for length after {len(tokens)} tokens")
        ids.append(tokens)
        truncated.append(reason == "length")
        if sampled:
            logprobs.append(_token_logprobs(choice, i, len(tokens)))
        elif choice.get("logprobs") is not None:
            raise WireError(f"choices[{i}] has logprobs for a greedy request")
    return Completions(ids, truncated, logprobs)


def _index(choice) -> int:
    if not isinstance(choice, dict):
        raise WireError("a choice is not a JSON object")
    index = choice.get("index")
    if isinstance(index, bool) or not isinstance(index, int):
        raise WireError("a choice has no integer index")
    return index


def _token_logprobs(choice: dict, i: int, length: int) -> list[float]:
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or len(values) != length:
        raise WireError(f"choices[{i}] needs one token logprob per token")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"choices[{i}] has a token logprob that is not a number")
        if not math.isfinite(value):
            raise WireError(f"choices[{i}] has a token logprob that is not finite")
    return [float(v) for v in values]


# ---------------------------------------------------------------------------------- vLLM's generation

# vLLM's /inference/v1/generate (its server's token-in, token-out route) takes one prompt a request:
# {"token_ids": [...], "sampling_params": {...}}; each choice comes back with its `token_ids`, its
# `logprobs.content` (one {"token_id", "logprob"} a token) and its `weight_versions`: spans of its
# tokens, each with the label of the weights that sampled them.


def generate_answer_limit(n: int, max_tokens: int) -> int:
    """Bytes an honest answer of vLLM's to one prompt's request fits in: per token an id, its
    logprob and the same again as its own top candidate (about 150 bytes as vLLM writes them)."""
    return (1 << 20) + n * (max_tokens * 400 + 2048)


def stale_label(answer: Any, label: str) -> str | None:
    """The label of weights other than `label` that sampled some of the answer's tokens, or None
    when every span of every choice is `label`'s. An answer without the spans is WireError."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        raise WireError("the answer holds no list of choices")
    for choice in choices:
        spans = choice.get("weight_versions") if isinstance(choice, dict) else None
        if not isinstance(spans, list) or not spans:
            raise WireError("a choice does not say which weights sampled it (weight_versions)")
        for span in spans:
            version = span.get("version") if isinstance(span, dict) else None
            if not isinstance(version, str):
                raise WireError("a choice's weight_versions holds a span without a version")
            if version != label:
                return version
    return None


def parse_generate_answer(answer: Any, n: int, vocab: int, params: SamplingParams) -> Completions:
    """vLLM's answer to one prompt's request as Completions (its n completions, or the greedy
    one repeated n times, as the colocated engine repeats it), or WireError naming what is wrong."""
    greedy = params.temperature == 0
    choices = answer.get("choices") if isinstance(answer, dict) else None
    want = 1 if greedy else n
    if not isinstance(choices, list) or len(choices) != want:
        count = len(choices) if isinstance(choices, list) else "no"
        raise WireError(f"the answer holds {count} choices for {want}")
    ids, truncated, logprobs = [], [], None if greedy else []
    for i, choice in enumerate(sorted(choices, key=_index)):
        if _index(choice) != i:
            raise WireError("the answer's choice indexes are not 0 .. n-1")
        tokens = token_ids(choice.get("token_ids"), f"choices[{i}].token_ids", vocab, 1 << 30)
        _finished(choice, i, len(tokens), params.max_new_tokens)
        ids.append(tokens)
        truncated.append(choice.get("finish_reason") == "length")
        if not greedy:
            logprobs.append(_content_logprobs(choice, i, tokens))
    if greedy:
        ids, truncated = ids * n, truncated * n
    return Completions(ids, truncated, logprobs)


def _finished(choice: dict, i: int, length: int, max_tokens: int) -> None:
    if not 1 <= length <= max_tokens:
        raise WireError(f"choices[{i}] holds {length} tokens, not 1 to max_tokens={max_tokens}")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise WireError(f"choices[{i}].finish_reason is {str(reason)[:40]}, not stop or length")
    if reason == "length" and length != max_tokens:
        raise WireError(f"choices[{i}] stopped for length after {length} tokens")


def _content_logprobs(choice: dict, i: int, tokens: list[int]) -> list[float]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(tokens):
        raise WireError(f"choices[{i}] needs one logprob per token")
    values = []
    for token, entry in zip(tokens, content):
        if not isinstance(entry, dict) or entry.get("token_id") != token:
            raise WireError(f"choices[{i}] has a logprob for another token than the one sampled")
        value = entry.get("logprob")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise WireError(f"choices[{i}] has a token logprob that is not a finite number")
        values.append(float(value))
    return values


# ---------------------------------------------------------------------------------- weights


def parse_init_info(body: Any) -> dict:
    """`init_weight_transfer_engine`'s `init_info`: where the trainer's store listens, the
    group's shape (the trainer rank 0, this server rank 1 of 2) and the seconds each collective
    may take."""
    info = body.get("init_info") if isinstance(body, dict) else None
    if not isinstance(info, dict):
        raise WireError("init_weight_transfer_engine takes {'init_info': {...}}")
    address = info.get("master_address")
    if not isinstance(address, str) or not 0 < len(address) <= 255:
        raise WireError("init_info.master_address must be a host name or address")
    port = _int(info.get("master_port"), "init_info.master_port", 1, 65536)
    if info.get("world_size") != 2 or info.get("rank_offset") != 1:
        raise WireError(
            "init_info: this server joins a group of 2 (world_size 2) as rank 1 (rank_offset 1)"
        )
    timeout = _float(info.get("timeout", 600.0), "init_info.timeout", 1e-3, 86_400.0)
    return {"master_address": address, "master_port": port, "timeout": timeout}


def parse_update_info(body: Any, held: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
    """`update_weights`' `update_info`, checked against the tensors the server holds (`held`: name
    -> (dtype name, shape)): the same names, each once, with their dtypes and shapes, so what the
    push will send is bounded by the model's own size."""
    info = body.get("update_info") if isinstance(body, dict) else None
    if not isinstance(info, dict):
        raise WireError("update_weights takes {'update_info': {...}}")
    names = _list(info.get("names"), "update_info.names", len(held))
    dtypes = _list(info.get("dtype_names"), "update_info.dtype_names", len(held))
    shapes = _list(info.get("shapes"), "update_info.shapes", len(held))
    if not len(names) == len(dtypes) == len(shapes):
        raise WireError("update_info: names, dtype_names and shapes differ in length")
    if set(names) != set(held) or len(set(names)) != len(names):
        missing = sorted(set(held) - set(names))[:3]
        unknown = sorted(set(map(str, names)) - set(held))[:3]
        raise WireError(
            f"update_info.names must be every tensor of the served model once (missing {missing}, "
            f"unknown {unknown})"
        )
    for name, dtype, shape in zip(names, dtypes, shapes):
        if (dtype, tuple(shape) if isinstance(shape, list) else shape) != held[name]:
            raise WireError(
                f"update_info: {name} is {dtype} {shape}, the served model's is {held[name][0]} "
                f"{list(held[name][1])}"
            )
    if info.get("packed") is not True:
        raise WireError("update_info.packed must be true: this server receives packed buckets")
    bucket = _int(
        info.get("packed_buffer_size_bytes"), "update_info.packed_buffer_size_bytes", 1, 1 << 33
    )
    version = _int(info.get("weights_version"), "update_info.weights_version", 1, MAX_VERSION)
    return {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "bucket": bucket,
        "version": version,
    }


def describe_model(config, tensors: list[tuple[str, str, tuple[int, ...]]], vocab: int) -> dict:
    """What a trainer compares with its own policy before it trusts a server: the architecture,
    the vocabulary, and every tensor's name, dtype and shape."""
    return {
        "architectures": list(getattr(config, "architectures", None) or []),
        "model_type": getattr(config, "model_type", None),
        "vocab_size": vocab,
        "tensors": [[name, dtype, list(shape)] for name, dtype, shape in tensors],
    }


def model_difference(ours: dict, theirs: Any) -> str | None:
    """Why a server's model (its `describe_model`) is not the trainer's, or None when it is."""
    if not isinstance(theirs, dict):
        return "the server does not describe its model"
    for key in ("model_type", "architectures", "vocab_size"):
        if theirs.get(key) != ours[key]:
            return f"its {key} is {str(theirs.get(key))[:80]}, the policy's {ours[key]}"
    mine = {name: (dtype, shape) for name, dtype, shape in ours["tensors"]}
    held = theirs.get("tensors")
    if not isinstance(held, list):
        return "the server does not list its tensors"
    try:
        served = {str(t[0]): (t[1], t[2]) for t in held}
    except (TypeError, IndexError, KeyError):
        return "the server's tensor list is malformed"
    if set(served) != set(mine):
        only_theirs = sorted(set(served) - set(mine))[:3]
        only_ours = sorted(set(mine) - set(served))[:3]
        return f"its tensors differ by name (only the server's: {only_theirs}; only the policy's: {only_ours})"
    for name, (dtype, shape) in mine.items():
        if served[name] != (dtype, shape):
            return (
                f"its {name} is {served[name][0]} {served[name][1]}, the policy's {dtype} {shape}"
            )
    return None
