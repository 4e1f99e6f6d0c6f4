"""torch.compile for cpu.compile: compile once, fall back to eager, and decide where.

The update's element-wise work (the output layer's tiles, grpo.cpu.tile_math; the
decoder's RMS norms, grpo.cpu.compiled_norms) is written as plain functions of
tensors and compiled by torch.compile (inductor: vectorised C++ with OpenMP on
the CPU) with dynamic shapes, so one compile serves every size, and with
`emulate_precision_casts`, so a value the eager code rounds to bf16 midway is
rounded in the kernel too (inductor would otherwise keep it in float32). Inductor caches
what it builds on disk (TORCHINDUCTOR_CACHE_DIR, by default under /tmp): the
first run on a machine compiles for about 20 s, later runs load in a few
seconds.

`call(fn, *args)` runs `fn` compiled, and eagerly for the rest of the process
once a compile has failed (a full disk, an inductor error at a new shape), with
one warning, so a run never stops for it. `use_compiled(setting, model)`
resolves cpu.compile for a model, probing once per process that the
compiler works (`compile_works`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch
import torch._functorch.config  # its settings are set below; torch does not import it for us

from grpo.config.errors import ConfigError

log = logging.getLogger(__name__)


def _reason(error: Exception) -> str:
    """An exception on one line, short enough for a log line (inductor's run to pages)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


@functools.cache
def compiled(fn):
    # a function run under autograd (the norms) gets its backward built with its forward, so that a
    # failing compile fails inside `call`'s fallback, not in the middle of a backward pass (an
    # AOTAutograd setting for the process: it moves when a backward is built, not what it computes)
    torch._functorch.config.force_non_lazy_backward_lowering = True
    return torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})


broken: list[str] = []
"""Set when a compile failed during the run (after the probe): from then on every compiled
function runs eagerly, so the run goes on."""


def call(fn, *args):
    """fn(*args) compiled, or eagerly once compiling has failed in this process."""
    if not broken:
        try:
            return compiled(fn)(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            broken.append(_reason(e))
            log.warning(
                "compiling a kernel of cpu.compile failed (%s); the rest of the run computes it eagerly, "
                "slower (cpu.compile=eager avoids compiling)",
                broken[0],
            )
    return fn(*args)


def _probe(x):
    """A small softmax chain: a reduction, an exponential and a broadcast, like the real kernels."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


@functools.cache
def compile_works(device_type: str) -> str | None:
    """None when torch.compile builds a kernel on `device_type` that agrees with eager (probed once
    per process), else why not: the reason to show the user."""
    if os.environ.get("RANK", "0") == "0":  # said once, not by every rank of a torchrun job
        print(
            "building the update's compiled kernels (cpu.compile; torch.compile: about 20 s the first "
            "time on a machine, then loaded from its cache)",
            file=sys.stderr,
            flush=True,
        )
    try:
        x = torch.randn(3, 70, generator=torch.Generator().manual_seed(0)).to(device_type)
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            got = compiled(_probe)(x)
        if not torch.allclose(got, _probe(x), rtol=1e-5, atol=1e-6):
            return "a compiled kernel disagrees with eager"
        return None
    except Exception as e:  # a missing C++ compiler, an unsupported device, an inductor error
        return _reason(e)


AUTO_COMPILE_MIN_WEIGHTS = 1 << 24
"""cpu.compile=auto compiles for models whose output layer has at least this many weights
(Gemma-3-270M's has 168M): below it, the element-wise work costs less than the seconds a process
takes to load the compiled kernels."""


def use_compiled(setting: str, model) -> bool:
    """cpu.compile resolved for `model`: whether its update runs compiled kernels. `auto`
    compiles for large models on the CPU where the compiler works (probed once per process), and
    says why not when it does not; `compiled` where it does not is a config error."""
    weight = model.get_output_embeddings().weight
    device = weight.device
    if setting == "eager":
        return False
    if setting == "auto" and (device.type != "cpu" or weight.numel() < AUTO_COMPILE_MIN_WEIGHTS):
        return False
    reason = compile_works(device.type)
    if reason is None:
        return True
    if setting == "compiled":
        raise ConfigError(
            f"cpu.compile=compiled, but torch.compile cannot build kernels on {device.type} ({reason}); "
            "install a C++ compiler (the CPU) or set cpu.compile=eager"
        )
    log.warning(
        "the update's element-wise work runs eagerly: torch.compile cannot build kernels here (%s)",
        reason,
    )
    return False
