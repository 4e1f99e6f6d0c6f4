"""grpo's plugin for vLLM (the `vllm.general_plugins` entry point in pyproject.toml, which vLLM
loads in each of its processes): `gloo` in vLLM's weight-transfer factory, by module path, so that
nothing of grpo's is imported until a server started with `--weight-transfer-config
'{"backend": "gloo"}'` builds its engine (grpo.serve.vllm_gloo). It imports nothing but vLLM's
factory."""

BACKEND = "gloo"


def register() -> None:
    """`gloo` in vLLM's weight-transfer factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "grpo.serve.vllm_gloo", "GlooWeightTransferEngine"
        )
    except ValueError:  # registered already in this process
        pass
