"""The device-layer seam (grpo.backends.device_layer): the backend chooses one layer per run by
its device, hands on what the layer provides, and the layers build only on the public interfaces
of grpo.rollout and grpo.models (the names those packages export)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from grpo.backends.device_layer import before_torch_allocates, device_layer
from grpo.config import loading as config
from grpo.config.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo"
LAYERS = ("cpu", "cuda")
PUBLIC = ("grpo.rollout", "grpo.models")


def _imports(folder: str):
    """(file, line, module, names) of every `from grpo... import` in a layer's folder."""
    for path in sorted((SRC / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path.relative_to(SRC), node.lineno, node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield path.relative_to(SRC), node.lineno, alias.name, []


@pytest.mark.parametrize("folder", LAYERS)
def test_a_device_layer_uses_only_what_rollout_and_models_export(folder):
    exported = {name: set(importlib.import_module(name).__all__) for name in PUBLIC}
    wrong = []
    for path, line, module, names in _imports(folder):
        package = next((p for p in PUBLIC if module == p or module.startswith(p + ".")), None)
        if package is None:
            continue
        if module != package:  # a module behind the package's names
            wrong.append(f"{path}:{line}: {module}")
        elif not set(names) <= exported[package]:
            wrong.append(f"{path}:{line}: {sorted(set(names) - exported[package])} from {package}")
    assert not wrong, (
        "device-layer imports of what rollout/ and models/ do not export:\n" + "\n".join(wrong)
    )


def test_every_exported_name_resolves_and_says_what_it_is():
    for package in PUBLIC:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            assert getattr(value, "__doc__", None) or not callable(value), f"{package}.{name}"


def test_only_the_backends_reach_the_device_layers():
    reaching = []
    for path in sorted(SRC.rglob("*.py")):
        folder = path.relative_to(SRC).parts[0]
        if folder in (*LAYERS, "backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for module in modules:
                if any(module == f"grpo.{f}" or module.startswith(f"grpo.{f}.") for f in LAYERS):
                    reaching.append(f"{path.relative_to(SRC)}:{node.lineno}: {module}")
    assert not reaching, "modules outside the backends importing a device layer:\n" + "\n".join(
        reaching
    )


def test_the_layer_is_chosen_by_the_device():
    from grpo.cpu.layer import CPULayer
    from grpo.cuda.layer import CUDALayer

    cfg = config.from_dict({})
    assert isinstance(device_layer(cfg, torch.device("cpu")), CPULayer)
    assert device_layer(config.from_dict({}, ["cpu.enabled=false"]), torch.device("cpu")) is None
    cuda = device_layer(cfg, torch.device("cuda"))  # built without touching a GPU
    assert isinstance(cuda, CUDALayer) and cuda.decoding.mode == "auto"
    eager = device_layer(
        config.from_dict({}, ["rollout.cuda_decoding=eager"]), torch.device("cuda")
    )
    assert eager.decoding.mode == "eager"
    assert device_layer(cfg, torch.device("meta")) is None


def test_graphs_off_cuda_are_refused_naming_the_key():
    cfg = config.from_dict({}, ["rollout.cuda_decoding=graphs"])
    with pytest.raises(ConfigError, match=r"rollout\.cuda_decoding=graphs .* on cpu"):
        device_layer(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"rollout\.cuda_decoding: 'graph' is not one of"):
        config.from_dict({}, ["rollout.cuda_decoding=graph"])


def test_a_cpu_run_hands_out_the_cpu_layer_as_before(monkeypatch):
    """What a CPU backend hands the engine and the logprobs is the CPU layer's own, and nothing
    of grpo.cuda is built (its decoding loop is chosen only on CUDA)."""
    from grpo.backends.single import SingleProcess
    from grpo.cpu.layer import CPULayer

    backend = SingleProcess(config.from_dict({}, ["training.device=cpu"]))
    assert isinstance(backend.layer, CPULayer) and backend.cpu is backend.layer
    assert backend.decoding == backend.layer.decoding  # the layer's decoding steps
    assert backend.output_layer_kernels() == backend.layer.output_layer_kernels(True)
    plain = SingleProcess(config.from_dict({}, ["training.device=cpu", "cpu.enabled=false"]))
    assert plain.layer is None and plain.decoding is None and plain.cpu is None


def test_huge_pages_are_the_cpu_layers_alone(monkeypatch):
    import os

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    before_torch_allocates(config.from_dict({}, ["cpu.enabled=false"]))
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ
    before_torch_allocates(config.from_dict({}))
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
