"""The two kinds of generation server the `server` engine speaks to, and where they differ.

`grpo serve --engine hf` (grpo.serve.hf) and `grpo serve --engine vllm` (vLLM's own server, with
grpo's gloo weight-transfer engine on CPUs) share vLLM's weight-transfer routes and payloads
(/init_weight_transfer_engine's init_info, /start_weight_update, /update_weights' update_info,
/finish_weight_update's weight_version). They differ in four places, each a method here:

- what describes them (`/server_info`): grpo's server adds a `grpo` block (the model's every
  tensor, the weights' version, the process's instance id); vLLM's has its config, whose
  `instance_id` is the process's and whose model_config holds the dtype the weights are kept in
  (a push is sent in it, as the colocated engine sends it), the context and the logprobs mode.
  vLLM describes no tensors: its model is checked by the first push, which a server whose model
  is not the policy's refuses (a name it has no parameter for, a shape that differs);
- generation: grpo's server takes one `/v1/completions` request with one seed per prompt and the
  weights' version, and refuses another version (409) before it generates; vLLM's takes one
  prompt a request (`/inference/v1/generate`, sent concurrently, each with its prompt's seed, as the
  colocated engine sends them) and labels every token with the weights' version it was sampled
  from, which is checked: an answer with another label (a restarted server says `default`) is
  treated as grpo's 409;
- the group: grpo's server is one process (a group of 2), vLLM's is its world size + 1, over
  gloo (grpo's engine on CPUs) or NCCL (vLLM's own on GPUs, grpo.rollout.server_nccl);
- around a push: vLLM's server is paused (waiting for what runs) and its version label set to
  `pushing-N` until the push finishes, so nothing sampled from half-pushed weights passes.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from grpo.rollout import wire
from grpo.rollout.server_http import HTTPClient, Refused
from grpo.rollout.types import SamplingParams

log = logging.getLogger(__name__)

CONTROL_SECONDS = 30.0
"""Bound of a question that costs the server nothing (its description, its version)."""
MAX_CONCURRENT = 64
"""Most generation requests in flight at once to a vLLM server (one per prompt)."""
DESCRIPTION_BYTES = 64 << 20
"""Bound of a server's description (grpo's lists every tensor)."""


def describe(client: HTTPClient) -> dict:
    """The server's /server_info, as JSON (vLLM's config as a tree, not a repr)."""
    info = client.call(
        "GET",
        "/server_info?config_format=json",
        timeout=CONTROL_SECONDS,
        key="rollout.server.timeout",
        limit=DESCRIPTION_BYTES,
    )
    if not isinstance(info, dict):
        raise wire.WireError("the server's /server_info is not a JSON object")
    return info


def dialect_of(info: dict):
    """GrpoServer or VLLMServer for a server's description; WireError for neither."""
    if isinstance(info.get("grpo"), dict):
        return GrpoServer()
    if isinstance(info.get("vllm_config"), dict):
        return VLLMServer(info["vllm_config"])
    raise wire.WireError("its /server_info describes neither grpo serve nor a vLLM server")


class GrpoServer:
    """`grpo serve --engine hf`."""

    name = "grpo serve --engine hf"
    push_dtype = None
    """The dtype a push is sent in (None: the policy's own)."""

    def instance(self, info: dict) -> str | None:
        grpo = info.get("grpo")
        return grpo.get("instance") if isinstance(grpo, dict) else None

    def model_difference(self, ours: dict, info: dict) -> str | None:
        grpo = info.get("grpo")
        return wire.model_difference(ours, grpo.get("model") if isinstance(grpo, dict) else None)

    def model_id(self, info: dict) -> str:
        return str(info["grpo"].get("model_id", ""))[:512]

    def world_size(self, client: HTTPClient) -> int:
        return 1

    def held_version(self, client: HTTPClient) -> int | None:
        grpo = describe(client).get("grpo")
        version = grpo.get("weights_version") if isinstance(grpo, dict) else None
        return version if isinstance(version, int) else None

    def generate(self, engine, prompts, G: int, params: SamplingParams, seeds) -> wire.Completions:
        body = wire.completion_request(
            engine.model_id,
            prompts,
            G,
            params,
            seeds,
            engine.eos_token_ids,
            engine.stop_strings,
            engine.version,
        )
        answer = engine.client.call(
            "POST",
            "/v1/completions",
            body,
            timeout=engine.settings.request_timeout,
            key="rollout.server.request_timeout",
            limit=wire.answer_limit(prompts, G, params.max_new_tokens),
        )
        return wire.parse_completion_answer(
            answer, len(prompts), G, engine.vocab, params, engine.version
        )

    def before_push(self, client: HTTPClient, version: int, post) -> None:
        pass

    def after_push(self, client: HTTPClient, version: int, post) -> None:
        pass


class VLLMServer:
    """vLLM's own server (`grpo serve --engine vllm`, or `vllm serve` started as it starts it)."""

    name = "a vLLM server"

    def __init__(self, config: dict):
        model = config.get("model_config") if isinstance(config.get("model_config"), dict) else {}
        transfer = config.get("weight_transfer_config")
        self.backend = transfer.get("backend") if isinstance(transfer, dict) else None
        self.dtype = str(model.get("dtype", "")).removeprefix("torch.")
        self.max_model_len = model.get("max_model_len")
        self.logprobs_mode = model.get("logprobs_mode")
        self.served = model.get("served_model_name") or model.get("model")
        if isinstance(self.served, list):
            self.served = self.served[0] if self.served else None
        self.push_dtype = self.dtype or None

    def instance(self, info: dict) -> str | None:
        config = info.get("vllm_config")
        value = config.get("instance_id") if isinstance(config, dict) else None
        return str(value) if value is not None else None

    def model_difference(self, ours: dict, info: dict) -> str | None:
        """What can be told before a push: none of the tensors (vLLM does not list them); the
        first push checks them."""
        if self.backend not in ("gloo", "nccl"):
            return (
                f"it transfers weights with {self.backend!r}, and grpo's server engine pushes over gloo "
                "or NCCL; start it with `grpo serve MODEL --engine vllm`"
            )
        from grpo.rollout.weight_transfer import DTYPES

        if self.dtype not in DTYPES:
            return f"it holds its weights in {self.dtype or 'an unnamed dtype'}, which grpo cannot push"
        return None

    def model_id(self, info: dict) -> str:
        return str(self.served or "")[:512]

    def check_logprobs(self, rollout, url: str) -> bool:
        """The server's logprobs mode gives the sampler's logprobs the update compares with
        (grpo.rollout.vllm's sampling_logprob_mode for the run's settings), else ConfigError;
        whether they are over the filters' kept tokens only (the update then adds the kept
        mass: grpo.rollout.vllm's logprobs_over_kept), with the colocated engine's warning
        where a repetition penalty makes that mass not the sampler's."""
        from grpo.rollout.vllm import PENALISED_KEPT_MASS, logprobs_over_kept, sampling_logprob_mode

        r = rollout
        wanted = sampling_logprob_mode(
            r.temperature, r.top_p, r.top_k, r.min_p, r.repetition_penalty
        )
        held = self.logprobs_mode
        if held != wanted and not (held == "processed_logprobs" and wanted == "raw_logprobs"):
            from grpo.config.errors import ConfigError

            raise ConfigError(
                f"rollout.engine: server: the vLLM server at {url} reports {held!r} logprobs, which are "
                f"not the sampler's at rollout.temperature={r.temperature}; start it with `--logprobs-mode "
                f"{wanted}` (grpo serve --engine vllm starts it with processed_logprobs)"
            )
        over_kept = logprobs_over_kept(held, r)
        if over_kept and r.repetition_penalty != 1.0:
            log.warning(PENALISED_KEPT_MASS, "rollout.engine: server", r.repetition_penalty)
        return over_kept

    def world_size(self, client: HTTPClient) -> int:
        answer = client.call(
            "GET", "/get_world_size", timeout=CONTROL_SECONDS, key="rollout.server.timeout"
        )
        size = answer.get("world_size") if isinstance(answer, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 4096:
            raise wire.WireError(f"/get_world_size answered {str(answer)[:80]}")
        return size

    def held_version(self, client: HTTPClient) -> int | None:
        answer = client.call(
            "GET", "/weight_info", timeout=CONTROL_SECONDS, key="rollout.server.timeout"
        )
        label = answer.get("weight_version") if isinstance(answer, dict) else None
        return int(label) if isinstance(label, str) and label.isdigit() else None

    # ------------------------------------------------------------------ generation

    def request(self, engine, prompt: list[int], G: int, params: SamplingParams, seed) -> dict:
        """/inference/v1/generate's body for one prompt's group: the colocated engine's request
        (grpo.rollout.vllm's request_params) as JSON."""
        greedy = params.temperature == 0
        ends = not params.ignore_eos
        return {
            "model": engine.model_id or None,
            "token_ids": [int(t) for t in prompt],
            "output_mode": "tokens",
            "sampling_params": {
                "n": 1 if greedy else G,  # vLLM refuses n > 1 without sampling
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "min_p": params.min_p,
                "repetition_penalty": params.repetition_penalty,
                "max_tokens": params.max_new_tokens,
                "min_tokens": params.min_new_tokens,
                "ignore_eos": params.ignore_eos,
                "stop_token_ids": list(engine.eos_token_ids) if ends else None,
                "stop": list(engine.stop_strings) if ends and engine.stop_strings else None,
                "detokenize": bool(ends and engine.stop_strings),
                "seed": None if greedy else seed,
                "logprobs": None if greedy else 0,
            },
        }

    def generate(self, engine, prompts, G: int, params: SamplingParams, seeds) -> wire.Completions:
        seeds = seeds or [None] * len(prompts)
        label = str(engine.version)
        limit = wire.generate_answer_limit(G, params.max_new_tokens)

        def one(i: int) -> wire.Completions:
            answer = engine.client.call(
                "POST",
                "/inference/v1/generate",
                self.request(engine, prompts[i], G, params, seeds[i]),
                timeout=engine.settings.request_timeout,
                key="rollout.server.request_timeout",
                limit=limit,
            )
            stale = wire.stale_label(answer, label)
            if stale is not None:  # as grpo's server refuses a request for other weights
                raise Refused(
                    f"the answer was sampled from weights labelled {stale[:40]!r}, not {label!r}",
                    409,
                )
            return wire.parse_generate_answer(answer, G, engine.vocab, params)

        workers = max(1, min(MAX_CONCURRENT, len(prompts)))
        with ThreadPoolExecutor(workers, thread_name_prefix="grpo-generate") as pool:
            parts = list(pool.map(one, range(len(prompts))))
        return wire.Completions(
            [ids for part in parts for ids in part.token_ids],
            [t for part in parts for t in part.truncated],
            None if params.temperature == 0 else [lp for part in parts for lp in part.logprobs],
        )

    # ------------------------------------------------------------------ around a push

    def before_push(self, client: HTTPClient, version: int, post) -> None:
        """What runs finishes on the old weights; what comes next waits; the label says that the
        weights are being replaced."""
        post("/pause?mode=wait", {})
        post("/update_weight_version", {"new_version": f"pushing-{version}"})

    def after_push(self, client: HTTPClient, version: int, post) -> None:
        post("/resume", {})
