"""`grpo serve MODEL [overrides] --engine hf|vllm [--host 127.0.0.1] [--port 8000] [--api-key K]`,
and with --engine vllm `[--tensor-parallel-size N] [--data-parallel-size N]
[--gpu-memory-utilization F] [--max-model-len N] [--dtype D] [-- vLLM's own options]`.

MODEL is a grpo config file (its `model` section is served, with the settings that decide how the
engine samples: training.bf16, training.device, cpu.*) or what `model.name` takes. `--engine hf`
serves grpo's own engine (grpo.serve.hf); `--engine vllm` starts vLLM's own server with weight
transfer on (grpo.serve.vllm). The shared secret comes from --api-key or, better (a command line
is visible to every user of the machine), the environment variable GRPO_SERVE_API_KEY.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from grpo.config.errors import ConfigError

API_KEY_ENV = "GRPO_SERVE_API_KEY"


def config_of(model: str, overrides: list[str]):
    """The config a server is built from: MODEL's file, or the defaults with model.name=MODEL."""
    from grpo.config import loading

    path = Path(model)
    if path.suffix in (".yaml", ".yml") or path.is_file() and path.suffix not in (".gguf",):
        return loading.load(path, overrides)
    return loading.from_dict({"model": {"name": model}}, overrides)


def api_key(given: str | None) -> str:
    key = given or os.environ.get(API_KEY_ENV, "")
    if not key:
        raise ConfigError(
            f"grpo serve needs a shared secret for its endpoints: set {API_KEY_ENV}=<secret> (the trainer "
            "reads the same variable), or pass --api-key"
        )
    return key


VLLM_OPTIONS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "data_parallel_size": "--data-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "dtype": "--dtype",
}
"""The options only `--engine vllm` takes (vLLM's server's), by their argparse names."""


def run(
    cfg,
    engine: str,
    host: str,
    port: int,
    key: str,
    say,
    options: dict | None = None,
    extra: list[str] | None = None,
) -> int:
    """Serve until SIGINT or SIGTERM."""
    options, extra = options or {}, extra or []
    if engine == "vllm":
        from grpo.serve import vllm

        return vllm.run(cfg, host, port, key, options, extra, say)
    if engine != "hf":
        raise ConfigError(f"grpo serve --engine {engine}: the engines are hf and vllm")
    given = [VLLM_OPTIONS[k] for k, v in options.items() if v is not None and k in VLLM_OPTIONS]
    if given or extra:
        what = ", ".join(given) or "options after --"
        raise ConfigError(
            f"grpo serve --engine hf: {what} are vLLM's server's; use --engine vllm, or leave them out"
        )
    from grpo.serve import hf

    serving = hf.start(cfg, host, port, key)
    signal.signal(signal.SIGTERM, _stop)
    say(f"grpo serve: {cfg.model.name} (engine hf) at {serving.url}; weights version 0")
    sys.stdout.flush()
    try:
        serving.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        serving.httpd.server_close()
    return 0


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt
