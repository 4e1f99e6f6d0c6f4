"""The `server` rollout engine: generation by a server in another process (`grpo serve --engine
hf`, or vLLM's own server as `grpo serve --engine vllm` starts it), the trainer's weights streamed
to it after every optimizer step. Where the two kinds of server differ (their description, how
generation is asked, the group's size, what surrounds a push) is grpo.rollout.server_dialect's.

    rollout:
      engine: server
      server: {url: http://127.0.0.1:8000, timeout: 240, request_timeout: 600, weight_sync_timeout: 600}

and the server's shared secret in the environment variable GRPO_SERVE_API_KEY.

- At start, before the policy is loaded (`preflight`): the secret is set and the server answers
  within rollout.server.timeout, else one line naming the URL and the `grpo serve` command. Once
  the policy is built: the server's model is the policy's (architecture, vocabulary, every
  tensor's name, dtype and shape; a vLLM server lists no tensors, and its refusal of the first
  push is the refusal), else refused; then the policy's weights are pushed (version 1).
- `generate` sends the prompts as token ids with one seed per prompt and the weights' version
  (grpo.rollout.wire); the completions, their sampler's logprobs and the version come back and are
  checked before they are trusted, and assembled into the Rollout the `hf` engine would give.
- `sync_weights` (after each optimizer step) pushes the policy from rank 0 (a LoRA policy merged:
  grpo.rollout.vllm.policy_weights) through the weight-transfer group (grpo.rollout.weight_transfer),
  one bucket at a time, and counts the version up; under torchrun every rank counts it and waits
  at a barrier until the push has landed. `take_metrics` gives `time/weight_sync` and
  `weight_sync/bytes` to the step's metrics.
- Faults: a server that stops answering mid-run is waited for (rollout.server.timeout); when it
  is back (restarted, holding version 0), rank 0 pushes the step's weights again and the request
  is repeated, so no completion ever comes from weights other than the step's; when it is not, the
  run stops with one line (`ServerError`). An exchange past its timeout (request_timeout,
  weight_sync_timeout) stops it the same way, naming the key.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from grpo.config.errors import ConfigError
from grpo.rollout import server_dialect, server_nccl, weight_transfer, wire
from grpo.rollout.hf import left_pad
from grpo.rollout.server_http import HTTPClient, Refused, ServerError, TimedOut, Unreachable
from grpo.rollout.types import Rollout, SamplingParams, Seeds, prompt_seeds

log = logging.getLogger(__name__)

API_KEY_ENV = "GRPO_SERVE_API_KEY"
"""The environment variable that holds the shared secret, on both sides."""
POLL_SECONDS = 0.5
"""How often a lost server is asked whether it is back."""
CONTROL_SECONDS = 30.0
"""Bound of a question that costs the server nothing (health, its description)."""

__all__ = ["API_KEY_ENV", "ServerEngine", "ServerError"]


def serve_command(cfg) -> str:
    """The command that starts a server for `cfg`'s run, as the messages suggest it."""
    from urllib.parse import urlsplit

    port = urlsplit(cfg.rollout.server.url).port or 8000
    return f"{API_KEY_ENV}=... grpo serve CONFIG --engine hf --port {port} (or MODEL in place of CONFIG: {cfg.model.name})"


def _client(cfg) -> HTTPClient:
    return HTTPClient(cfg.rollout.server.url, os.environ.get(API_KEY_ENV))


def wait_until_up(client: HTTPClient, seconds: float) -> bool:
    """Whether the server answers /health within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            client.call(
                "GET",
                "/health",
                timeout=min(CONTROL_SECONDS, max(deadline - time.monotonic(), 0.1)),
                key="rollout.server.timeout",
            )
            return True
        except ServerError:
            if time.monotonic() + POLL_SECONDS > deadline:
                return False
            time.sleep(POLL_SECONDS)


def _world() -> tuple[int, int]:
    """(rank, world size) of this process's torch.distributed group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class ServerEngine:
    """The `server` rollout engine (see the module's docstring). Settings: rollout.server."""

    @staticmethod
    def preflight(cfg) -> None:
        """Before the policy is loaded: the shared secret is set, and the server answers."""
        s = cfg.rollout.server
        if not os.environ.get(API_KEY_ENV):
            raise ConfigError(
                f"rollout.engine: server needs the server's shared secret in the environment variable "
                f"{API_KEY_ENV} (the one `grpo serve` was started with); set it and train again"
            )
        if not wait_until_up(_client(cfg), s.timeout):
            raise ConfigError(
                f"rollout.engine: server: no generation server answers at {s.url} (waited "
                f"rollout.server.timeout={s.timeout:g} s); start one with `{serve_command(cfg)}`, or set "
                "rollout.server.url to where it listens"
            )

    def __init__(self, model, tokenizer, cfg, decoding=None):  # `decoding`: the server's own
        from grpo.models.loading import generation_token_ids

        self.model = model
        self.eos_token_ids, self.pad_token_id = generation_token_ids(model, tokenizer)
        self.settings = s = cfg.rollout.server
        self.command = serve_command(cfg)
        self.stop_strings = [x for x in cfg.rollout.stop_strings if x]
        self.rank, self.world = _world()
        self.client = _client(cfg)
        self.bucket_bytes = s.bucket_mb << 20
        _check_lora(model)
        output = model.get_output_embeddings()
        self.vocab = int(output.weight.shape[0]) if output is not None else model.config.vocab_size
        self.cfg = cfg
        self.version = 0
        """The version of the weights the server holds for this run (0: none pushed yet)."""
        self.recovers = True
        """Whether a generation request that finds the server lost or restarted waits for it and
        gives it the step's weights again; False (a source generating ahead of training, whose
        weights the trainer no longer holds): the request fails with ServerError instead."""
        self.logprobs_over_kept = False
        """Whether the sampler's logprobs are over the top-k/top-p/min-p kept tokens only (a
        vLLM server reporting processed_logprobs while the run filters): set by `_check_model`."""
        self.group = self.store = self.instance = None
        self.scratch = weight_transfer.Scratch()  # one bucket, kept from push to push
        self.metrics: dict[str, float] = {}
        self.model_id = self._check_model()
        try:
            self._push_and_wait()
        except ServerError as error:
            if isinstance(self.dialect, server_dialect.GrpoServer):
                raise
            raise ConfigError(  # a vLLM server's model is checked by the first push
                f"rollout.engine: server: the server at {s.url} did not take the policy's weights, so it "
                f"serves another model than the policy: {str(error)[:400]}; start it with the run's own "
                "model"
            ) from None
        self.metrics.clear()  # the first push is the start's, not a step's

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ start

    def _describe(self) -> dict:
        tensors = [(m.name, m.dtype, m.shape) for m in self.metas]
        return wire.describe_model(self.model.config, tensors, self.vocab)

    def _check_model(self) -> str:
        """The server's kind (`self.dialect`) and the tensors a push sends (`self.metas`, in the
        server's dtype where it names one); the served model's id, once its model is known to be
        the policy's as far as the server tells (else ConfigError)."""
        info = self._ask("GET", "/server_info?config_format=json", what="its description")
        try:
            self.dialect = server_dialect.dialect_of(info if isinstance(info, dict) else {})
        except wire.WireError as error:
            raise ConfigError(
                f"rollout.engine: server: the server at {self.settings.url} is not a generation server grpo "
                f"speaks to ({error}); start one with `{self.command}`"
            ) from None
        self.push_dtype = (
            weight_transfer.DTYPES.get(self.dialect.push_dtype) if self.dialect.push_dtype else None
        )
        self.metas = [weight_transfer.TensorMeta.of(n, t) for n, t in self._weights()]
        why = self.dialect.model_difference(self._describe(), info)
        if why is not None:
            raise ConfigError(
                f"rollout.engine: server: the server at {self.settings.url} serves another model than the "
                f"policy: {why}; start it with the run's own model (`{self.command}`)"
            )
        if isinstance(self.dialect, server_dialect.VLLMServer):
            self.logprobs_over_kept = self.dialect.check_logprobs(
                self.cfg.rollout, self.settings.url
            )
            if self.dialect.backend == "nccl" and self.rank == 0:
                server_nccl.check_available(self.model)
        return self.dialect.model_id(info)

    def _weights(self):
        """What a push sends: the policy's weights (grpo.rollout.vllm's policy_weights), in the
        server's dtype where it keeps its own."""
        return _weights(self.model, self.push_dtype)

    def _ask(self, method: str, path: str, body=None, *, what: str, limit: int = 64 << 20):
        """A control exchange (health, description, checksum) that costs the server nothing."""
        try:
            return self.client.call(
                method,
                path,
                body,
                timeout=CONTROL_SECONDS,
                key="rollout.server.timeout",
                limit=limit,
            )
        except Refused as error:
            if error.status == 401:
                raise ConfigError(
                    f"rollout.engine: server: the server at {self.settings.url} refused the shared secret in "
                    f"{API_KEY_ENV}; set it to the one the server was started with"
                ) from None
            raise ServerError(f"the generation server refused {what}: {error}") from None

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts, num_generations, params: SamplingParams, seeds: Seeds = None
    ) -> Rollout:
        G = num_generations
        # drawn as the hf engine draws them: only when sampling
        seeds = prompt_seeds(seeds, len(prompts)) if params.temperature > 0 else None
        return self._rollout(prompts, G, self._exchange(prompts, G, params, seeds))

    def _exchange(self, prompts, G: int, params: SamplingParams, seeds) -> wire.Completions:
        """The server's completions, checked; asked again once the server is back when it was
        lost or restarted (and, on rank 0, given the step's weights again)."""
        s = self.settings
        for attempt in range(3):
            try:
                return self.dialect.generate(self, prompts, G, params, seeds)
            except wire.WireError as error:
                raise ServerError(
                    f"the generation server at {s.url} sent an answer grpo cannot trust: {error}"
                ) from None
            except TimedOut as error:
                raise ServerError(
                    f"rollout.server.request_timeout: the generation server at {s.url} did not finish a "
                    f"request within {s.request_timeout:g} s ({error}); raise rollout.server.request_timeout, "
                    "or restart the server, then continue the run with --resume"
                ) from None
            except Refused as error:
                if error.status != 409 or attempt == 2:  # 409: it holds other weights
                    raise ServerError(
                        f"the generation server refused a generation request: {error}"
                    ) from None
                self._recover("generation")
            except Unreachable:
                if attempt == 2:
                    raise
                self._recover("generation")
        raise AssertionError("unreachable")

    def _rollout(self, prompts, G: int, done: wire.Completions) -> Rollout:
        """The Rollout the `hf` engine assembles from the same completions (grpo.rollout.hf's
        completed_rollout): prompts left-padded and repeated per group, completions right-padded
        with the pad token, logprobs 0 past each completion's end."""
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        width = max((len(c) for c in done.token_ids), default=0)
        # one tensor from padded lists, not one per completion: generating ahead, this runs
        # beside the update, on its core, and costs it what it takes
        ids = _padded(done.token_ids, width, self.pad_token_id, torch.long)
        mask = _padded([[1] * len(c) for c in done.token_ids], width, 0, torch.long)
        logprobs = None
        if done.logprobs is not None:
            logprobs = _padded(done.logprobs, width, 0.0, torch.float32)
        device = self.device
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(G, 0).to(device),
            prompt_mask=prompt_mask.repeat_interleave(G, 0).to(device),
            completion_ids=ids.to(device),
            completion_mask=mask.to(device),
            truncated=torch.tensor(done.truncated, dtype=torch.bool, device=device),
            sampling_logprobs=None if logprobs is None else logprobs.to(device),
        )

    # ------------------------------------------------------------------ weights

    def sync_weights(self, policy) -> None:
        """Push `policy`'s weights (rank 0) as the next version; every rank waits until it landed."""
        if policy is not self.model:
            raise ValueError(
                "the server engine pushes the policy module it was built with; build a new engine for another"
            )
        self._push_and_wait()

    def _push_and_wait(self) -> None:
        start = time.perf_counter()
        version = self.version + 1
        sent = 0
        if self.rank == 0:
            sent = self._push(version)
        _barrier()  # no rank generates before the server holds the new weights
        self.version = version
        self.metrics["time/weight_sync"] = (
            self.metrics.get("time/weight_sync", 0.0) + time.perf_counter() - start
        )
        self.metrics["weight_sync/bytes"] = self.metrics.get("weight_sync/bytes", 0.0) + (
            sent or sum(m.nbytes for m in self.metas)
        )

    def take_metrics(self) -> dict[str, float]:
        """`time/weight_sync` (seconds in pushes, waits included) and `weight_sync/bytes` since the
        last call: the step's."""
        metrics, self.metrics = self.metrics, {}
        return metrics

    def _push(self, version: int) -> int:
        """The policy's weights to the server as `version`, waiting for it if it is restarting;
        the bytes sent."""
        s = self.settings
        for attempt in range(3):
            try:
                return self._transfer(version)
            except Unreachable:
                if attempt == 2:
                    raise
                self._drop_group()
                self._wait_for_server("a weight push")
            except TimedOut as error:
                self._drop_group()
                key = (
                    error.key
                    if error.key.startswith("rollout.")
                    else "rollout.server.weight_sync_timeout"
                )
                raise ServerError(
                    f"{key}: a weight push to the generation server at {s.url} did not finish in time "
                    f"({error}); raise {key}, or restart the server, then continue the run with --resume"
                ) from None
            except Refused as error:
                self._drop_group()
                if error.status == 401:
                    raise ConfigError(
                        f"rollout.engine: server: the server at {s.url} refused the shared secret in "
                        f"{API_KEY_ENV}; set it to the one the server was started with"
                    ) from None
                raise ServerError(f"the generation server refused a weight push: {error}") from None
        raise AssertionError("unreachable")

    def _transfer(self, version: int) -> int:
        """One push: the group opened if the server has none with this trainer, the weights
        announced (update_weights) while the buckets are broadcast beside it, then finished."""
        s = self.settings
        if self.group is None or self._server_instance() != self.instance:
            self._open_group()
        self.dialect.before_push(self.client, version, self._post)
        if isinstance(self.group, server_nccl.NCCLPush):  # vLLM's trainer engine runs the sequence
            try:
                sent = self.group.push(version, sum(m.nbytes for m in self.metas))
            except BaseException:
                self._drop_group()
                raise
            self.dialect.after_push(self.client, version, self._post)
            return sent
        self._post("/start_weight_update", {"is_checkpoint_format": True})
        sent: list[int] = []
        failed: list[BaseException] = []

        def broadcast():
            try:
                sent.append(
                    weight_transfer.send(
                        self.group,
                        self._weights(),
                        self.metas,
                        self.bucket_bytes,
                        self.scratch,
                    )
                )
            except BaseException as error:  # noqa: BLE001 (re-raised below, in the caller's thread)
                failed.append(error)

        sender = threading.Thread(target=broadcast, name="grpo-weight-push", daemon=True)
        sender.start()
        info = weight_transfer.update_info(self.metas, self.bucket_bytes, version)
        try:
            self._post("/update_weights", {"update_info": info})
        except BaseException:
            self._drop_group()  # the sender ends at the group's timeout; the group is not used again
            raise
        sender.join(timeout=s.weight_sync_timeout)
        if sender.is_alive() or failed:
            self._drop_group()
            cause = f"{type(failed[0]).__name__}: {failed[0]}" if failed else "still sending"
            raise TimedOut(
                f"the weights' transfer failed within {s.weight_sync_timeout:g} s ({str(cause)[:300]})",
                "rollout.server.weight_sync_timeout",
            )
        # vLLM's name and type for the version, and grpo's
        self._post(
            "/finish_weight_update", {"weight_version": str(version), "weights_version": version}
        )
        self.dialect.after_push(self.client, version, self._post)
        return sent[0]

    def _post(self, path: str, body: dict):
        return self.client.call(
            "POST",
            path,
            body,
            timeout=self.settings.weight_sync_timeout,
            key="rollout.server.weight_sync_timeout",
        )

    def _server_instance(self) -> str | None:
        """The server process's id: a restarted server has another, and none of this trainer's group."""
        try:
            return self.dialect.instance(server_dialect.describe(self.client))
        except wire.WireError:
            return None

    def _open_group(self) -> None:
        """The weight-transfer group with the server: this trainer hosts the store, the server joins."""
        s = self.settings
        self._drop_group()
        self.instance = self._server_instance()
        try:
            world = 1 + self.dialect.world_size(self.client)
        except wire.WireError as error:
            raise ServerError(f"the generation server at {s.url}: {error}") from None
        address = self.client.local_address(CONTROL_SECONDS)
        if getattr(self.dialect, "backend", None) == "nccl":
            self.group = server_nccl.NCCLPush(self, world, address)
            return
        self.store = weight_transfer.open_store(address, s.group_port, s.weight_sync_timeout, world)
        init_info = {
            "master_address": address,
            "master_port": self.store.port,
            "rank_offset": 1,
            "world_size": world,
            "timeout": s.weight_sync_timeout,
        }
        joined: list = []
        failed: list[BaseException] = []

        def join():
            try:
                joined.append(
                    weight_transfer.open_group(self.store, 0, s.weight_sync_timeout, world)
                )
            except BaseException as error:  # noqa: BLE001 (re-raised below)
                failed.append(error)

        opener = threading.Thread(target=join, name="grpo-weight-group", daemon=True)
        opener.start()
        try:
            self._post("/init_weight_transfer_engine", {"init_info": init_info})
        except BaseException:
            self._drop_group()
            raise
        opener.join(timeout=s.weight_sync_timeout)
        if not joined:
            cause = f"{type(failed[0]).__name__}: {failed[0]}" if failed else "no answer"
            raise TimedOut(
                f"the server did not join the weight-transfer group ({str(cause)[:300]})",
                "rollout.server.weight_sync_timeout",
            )
        self.group = joined[0]

    def _drop_group(self) -> None:
        if isinstance(self.group, server_nccl.NCCLPush):
            self.group.close()
        self.group = self.store = None

    # ------------------------------------------------------------------ faults

    def _wait_for_server(self, during: str) -> None:
        """Back within rollout.server.timeout, or ServerError: the run cannot go on."""
        s = self.settings
        log.warning(
            "the generation server at %s stopped answering during %s; waiting up to %g s for it "
            "(rollout.server.timeout)",
            s.url,
            during,
            s.timeout,
        )
        if not wait_until_up(self.client, s.timeout):
            raise ServerError(
                f"the generation server at {s.url} stopped answering during {during} and was not back within "
                f"rollout.server.timeout={s.timeout:g} s; start it again (`{self.command}`), then continue "
                "the run with --resume"
            )

    def _recover(self, during: str) -> None:
        """After a lost or restarted server: once it is back, the weights of this step on it again
        (rank 0 pushes them; the other ranks wait until the server holds them). Without
        `recovers`, ServerError."""
        if not self.recovers:
            raise ServerError(
                f"the generation server at {self.settings.url} was lost or restarted during {during}, and "
                "the weights that generation was sampling from are no longer the trainer's; start it again "
                f"(`{self.command}`), then continue the run with --resume"
            )
        self._wait_for_server(during)
        if self.rank == 0:
            self._drop_group()
            self._push(self.version)
            return
        deadline = time.monotonic() + self.settings.timeout
        while time.monotonic() < deadline:
            try:
                if self.dialect.held_version(self.client) == self.version:
                    return
            except (wire.WireError, Refused):
                pass
            time.sleep(POLL_SECONDS)
        raise ServerError(
            f"the generation server at {self.settings.url} was restarted and rank 0 did not push the step's "
            f"weights within rollout.server.timeout={self.settings.timeout:g} s; continue the run with --resume"
        )

    def sleep(self) -> None:
        pass  # the server's memory is its own

    def wake(self) -> None:
        pass


def _weights(model, dtype: torch.dtype | None = None):
    """The policy's weights as the server loads them: grpo.rollout.vllm's policy_weights (a LoRA
    policy merged, the adapters left out; floating-point ones in `dtype` when given), one tensor
    at a time."""
    from grpo.rollout.vllm import policy_weights

    return policy_weights(model, dtype)


def _check_lora(model) -> None:
    """grpo.rollout.vllm's check: a LoRA policy is pushed merged, which plain LoRA on Linear
    layers allows."""
    from grpo.rollout.vllm import check_lora

    try:
        check_lora(model)
    except ConfigError as error:
        raise ConfigError(
            str(error).replace("rollout.engine: vllm", "rollout.engine: server")
        ) from None


def weights_checksum(model) -> dict:
    """The checksum of what a push sends (grpo.rollout.weight_transfer.checksum), to compare with
    the server's /weights_checksum."""
    return weight_transfer.checksum(_weights(model))


def _padded(rows: list[list], width: int, pad, dtype: torch.dtype) -> torch.Tensor:
    """`rows` right-padded with `pad` to `width`, as one (len(rows), width) tensor on the CPU."""
    padded = [row + [pad] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=dtype, device="cpu").view(len(rows), width)
