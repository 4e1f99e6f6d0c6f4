"""`grpo serve MODEL --engine hf`: grpo's `hf` engine behind vLLM's endpoints.

The model is loaded and prepared as a trainer prepares it for the same config (grpo.backends'
one-process backend: the device, the device layer, and the engine's decoding), so that with the
trainer's weights it samples the very tokens the trainer's own `hf` engine would. Endpoints (the
names and bodies of vLLM's OpenAI-compatible server and its weight-transfer routes):

    GET  /health, /version                          open
    GET  /v1/models, /server_info, /get_world_size   the served model; /server_info's "grpo" block
                                                     describes it (architecture, vocabulary, every
                                                     tensor) with the weights' version and this
                                                     process's instance id
    POST /v1/completions                            token-id prompts -> token-id completions with
                                                     their sampler's logprobs (grpo.rollout.wire)
    POST /init_weight_transfer_engine               join the trainer's gloo group (init_info)
    POST /start_weight_update, /update_weights,     a push: announced, received bucket by bucket
         /finish_weight_update                      into the weights, then its version held
    GET  /weights_checksum                          sha256 of every tensor (to compare bitwise)
    POST /pause, /resume, /reset_prefix_cache       accepted; nothing to do here

The version: 0 for the weights the server loaded, then the one each push announced. A generation
request that names another version, or arrives while a push is under way or after one failed half
way, is refused (409) with the version held, so that nothing is sampled from other weights.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

import torch

from grpo.config.errors import ConfigError
from grpo.rollout import StopStrings, TransformersEngine, weight_transfer, wire
from grpo.serve.http import HTTPFailure, Serving, listen, make_handler

MAX_GROUP_SECONDS = 3600.0
"""Most seconds a collective of the weight-transfer group may wait (whatever the trainer asks)."""
UNKNOWN_LENGTH = 1 << 15
"""max_model_len of a model whose config does not say its context (positions per sequence)."""


@dataclass
class ServedModel:
    """A model as the trainer's backend prepares it, with the `hf` engine on it."""

    cfg: object
    model: torch.nn.Module
    tokenizer: object
    engine: TransformersEngine
    name: str

    @property
    def vocab(self) -> int:
        output = self.model.get_output_embeddings()
        return int(output.weight.shape[0]) if output is not None else self.model.config.vocab_size

    @property
    def max_model_len(self) -> int:
        from grpo.models.loading import context_length

        return context_length(self.model) or UNKNOWN_LENGTH


def load_served_model(cfg) -> ServedModel:
    """cfg's policy as a one-process trainer would build it (no LoRA: pushes arrive merged)."""
    from grpo.backends import world_size
    from grpo.backends.single import SingleProcess
    from grpo.models.loading import load_model_and_tokenizer

    if world_size() > 1:
        raise ConfigError("grpo serve runs in one process: start it without torchrun")
    if cfg.model.lora.quantize != "none":
        raise ConfigError(
            f"grpo serve: a quantized base (model.lora.quantize={cfg.model.lora.quantize}) cannot take "
            "merged weights; serve the config with model.lora.quantize=none"
        )
    backend = SingleProcess(cfg)
    model, tokenizer = load_model_and_tokenizer(cfg.model, backend.device)
    model = backend.prepare_model(model)
    model.requires_grad_(False)
    engine = TransformersEngine(model, tokenizer, cfg, backend.decoding)
    return ServedModel(cfg, model, tokenizer, engine, str(cfg.model.name))


class HFServer:
    """The state behind the endpoints: the served model, the weights' version, the transfer group."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.instance = uuid.uuid4().hex
        self.version: int | None = 0
        """The version of the weights held; None when a push failed half way (none to serve)."""
        self.pending: int | None = None
        """The version a push under way will hold once finished."""
        self.updating = False
        self.group = None
        self.scratch = weight_transfer.Scratch()  # one bucket, kept from push to push
        self.lock = threading.Lock()
        """Held by a generation or a push: one at a time touches the weights."""
        self.tensors = dict(served.model.state_dict(keep_vars=True))
        self.held = {
            name: (weight_transfer.dtype_name(t.dtype), tuple(t.shape))
            for name, t in self.tensors.items()
        }

    def routes(self) -> dict:
        return {
            ("GET", "/health"): lambda body, headers: (200, {}),
            ("GET", "/version"): lambda body, headers: (200, {"version": _version()}),
            ("GET", "/v1/models"): self.models,
            ("GET", "/server_info"): self.server_info,
            ("GET", "/get_world_size"): lambda body, headers: (200, {"world_size": 1}),
            ("GET", "/weights_checksum"): self.weights_checksum,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/init_weight_transfer_engine"): self.init_weight_transfer,
            ("POST", "/start_weight_update"): self.start_weight_update,
            ("POST", "/update_weights"): self.update_weights,
            ("POST", "/finish_weight_update"): self.finish_weight_update,
            ("POST", "/pause"): lambda body, headers: (200, {}),
            ("POST", "/resume"): lambda body, headers: (200, {}),
            ("POST", "/reset_prefix_cache"): lambda body, headers: (200, {}),
        }

    # ------------------------------------------------------------------ description

    def models(self, body, headers):
        s = self.served
        card = {
            "id": s.name,
            "object": "model",
            "owned_by": "grpo",
            "max_model_len": s.max_model_len,
        }
        return 200, {"object": "list", "data": [card]}

    def server_info(self, body, headers):
        s = self.served
        tensors = [(name, dtype, shape) for name, (dtype, shape) in self.held.items()]
        dtype = next(iter(self.held.values()))[0] if self.held else "float32"
        return 200, {
            "vllm_config": {
                "model_config": {"dtype": f"torch.{dtype}", "max_model_len": s.max_model_len},
                "weight_transfer_config": {"backend": "gloo"},
            },
            "grpo": {
                "engine": "hf",
                "model_id": s.name,
                "instance": self.instance,
                "weights_version": self.version,
                "per_prompt_seeds": True,
                "model": wire.describe_model(s.model.config, tensors, s.vocab),
            },
        }

    def weights_checksum(self, body, headers):
        with self.lock:
            return 200, {
                "weights_version": self.version,
                **weight_transfer.checksum(self.tensors.items()),
            }

    # ------------------------------------------------------------------ generation

    def completions(self, body, headers):
        s = self.served
        try:
            request = wire.parse_completion_request(body, s.vocab, s.max_model_len)
        except wire.WireError as error:
            raise HTTPFailure(400, str(error)) from None
        if body.get("model") not in (None, s.name):
            raise HTTPFailure(
                404, f"this server serves {s.name!r}, not {str(body['model'])[:80]!r}"
            )
        with self.lock:
            if self.updating or self.version is None:
                raise HTTPFailure(
                    409,
                    "no whole weights to serve: a push is under way or failed half way",
                    weights_version=self.version,
                )
            if request.version is not None and request.version != self.version:
                raise HTTPFailure(
                    409,
                    f"this server holds weights version {self.version}, not {request.version}",
                    weights_version=self.version,
                )
            rollout = self._generate(request)
            version = self.version
        return 200, _answer(s, request, rollout, version)

    def _generate(self, request: wire.CompletionRequest):
        engine = self.served.engine
        default_eos = engine.eos_token_ids
        engine.eos_token_ids = request.eos_token_ids or default_eos
        engine.stop = StopStrings(self.served.tokenizer, request.stop) if request.stop else None
        try:
            return engine.generate(request.prompts, request.n, request.params, request.seeds)
        finally:
            engine.eos_token_ids = default_eos

    # ------------------------------------------------------------------ weights

    def init_weight_transfer(self, body, headers):
        try:
            info = wire.parse_init_info(body)
        except wire.WireError as error:
            raise HTTPFailure(400, str(error)) from None
        timeout = min(info["timeout"], MAX_GROUP_SECONDS)
        with self.lock:
            self.group = None
            try:
                store = weight_transfer.join_store(
                    info["master_address"], info["master_port"], timeout
                )
                self.group = weight_transfer.open_group(store, 1, timeout)
            except Exception as error:  # the trainer's store unreachable, or it never joined
                raise HTTPFailure(
                    502, f"could not join the trainer's weight-transfer group: {error}"
                ) from None
        return 200, {}

    def start_weight_update(self, body, headers):
        with self.lock:
            self.updating = True
        return 200, {}

    def update_weights(self, body, headers):
        try:
            info = wire.parse_update_info(body, self.held)
        except wire.WireError as error:
            raise HTTPFailure(400, str(error)) from None
        with self.lock:
            if self.group is None:
                raise HTTPFailure(409, "no weight-transfer group: call init_weight_transfer_engine")
            self.updating = True
            metas = [
                weight_transfer.TensorMeta(n, d, tuple(s))
                for n, d, s in zip(info["names"], info["dtypes"], info["shapes"])
            ]
            self.version, self.pending = None, None  # torn until every tensor has landed
            try:
                with torch.no_grad():
                    received = weight_transfer.receive(
                        self.group, metas, info["bucket"], self._load, self.scratch
                    )
            except Exception as error:
                self.group = None  # a failed collective leaves the group unusable
                raise HTTPFailure(502, f"the weights' transfer failed: {error}") from None
            self.pending = info["version"]
        return 200, {"received_bytes": received}

    def _load(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name].data.copy_(tensor)

    def finish_weight_update(self, body, headers):
        version = body.get("weights_version") if isinstance(body, dict) else None
        with self.lock:
            if self.pending is None:
                raise HTTPFailure(409, "no push has landed to finish", weights_version=self.version)
            if version is not None and version != self.pending:
                raise HTTPFailure(
                    409, f"the push that landed is version {self.pending}, not {version}"
                )
            self.version, self.pending, self.updating = self.pending, None, False
        return 200, {"weights_version": self.version}


def _answer(served: ServedModel, request: wire.CompletionRequest, rollout, version: int) -> dict:
    lengths = rollout.completion_mask.sum(-1).tolist()
    ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths)]
    logprobs = None
    if request.params.temperature > 0 and rollout.sampling_logprobs is not None:
        logprobs = [row[:n] for row, n in zip(rollout.sampling_logprobs.tolist(), lengths)]
    texts = served.tokenizer.batch_decode(ids, skip_special_tokens=True)
    return wire.completion_answer(
        served.name,
        request.prompts,
        ids,
        rollout.truncated.tolist(),
        logprobs,
        texts,
        version,
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpo")
    except PackageNotFoundError:
        return "unknown"


def start(cfg, host: str, port: int, api_key: str) -> Serving:
    """The server for `cfg`'s model, listening on (host, port) (0: a free port), not yet serving:
    call `serve_forever()` or `start_thread()` on it."""
    if not api_key:
        raise ConfigError(
            "grpo serve needs a shared secret for its endpoints: set GRPO_SERVE_API_KEY (or --api-key)"
        )
    app = HFServer(load_served_model(cfg))
    serving = listen(host, port, make_handler(app.routes(), api_key))
    serving.app = app
    return serving
