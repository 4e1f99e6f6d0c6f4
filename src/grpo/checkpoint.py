"""Checkpoint directories: written atomically, verified when read, pruned, resumed from.

    output_dir/checkpoint-N/  (and final/)
      model.safetensors, config.json   the policy (loadable with from_pretrained)
        or, with LoRA (model.lora.r > 0):
      adapter_model.safetensors, adapter_config.json   the adapter only (peft's files;
                       load with PeftModel.from_pretrained(base model, this directory),
                       or write a merged model with `grpo export DIR --out OUT --merge`)
      tokenizer files
      train_state.pt   Trainer.state_dict(): step and token counters, optimizer, scheduler,
                       every RNG, the prompt sampler, reward failure counts, and the
                       reference's weights once ref_sync_steps has changed it
      config.yaml      the run's resolved config
      manifest.json    every other file's size and sha256; written last

A checkpoint is written into `.checkpoint-N.tmp-PID/`, each file fsynced, the
manifest last, then renamed into place: a crash at any moment leaves either the
whole checkpoint or a hidden leftover, which `remove_leftovers` deletes at
start-up. A checkpoint whose files do not match its manifest (a disk that lost
writes, a copy cut short) is passed over for the one before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from grpo import config as config_module
from grpo import faults
from grpo.config import ConfigError

log = logging.getLogger(__name__)

MANIFEST, STATE, CONFIG = "manifest.json", "train_state.pt", "config.yaml"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
"""peft's files: a LoRA run's checkpoint holds its adapter, not the base weights."""
FINAL = "final"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_LEFTOVER = re.compile(r"\.(checkpoint-\d+|final)\.(tmp|old)-\d+")

# Keys a resumed run may change: they decide how long to train, what to log or evaluate,
# and which kernels compute a step's values (the same to float tolerance), never the values.
RESUMABLE_CHANGES = ("output_dir", "overwrite_output_dir", "training.max_steps", "training.save_steps",
                     "training.save_total_limit", "training.kernels", "logging.", "eval.")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_directory_write(target: Path, write, step: int | None = None) -> Path:
    """Call write(tmp_dir), add the manifest, fsync, and move tmp_dir to `target` in one rename.

    A previous `target` is kept until the new one is complete."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp)
    faults.reached("save")
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(path)
        files[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync(manifest)
    _fsync(tmp)
    faults.reached("manifest")
    old = None
    if target.exists():  # a directory cannot be renamed over a non-empty one: move it aside first
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync(target.parent)  # the rename itself survives a power cut
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def save_checkpoint(directory: Path, model, tokenizer, state: dict[str, Any] | None = None, cfg=None,
                    step: int | None = None) -> Path:
    """Model + tokenizer (loadable with from_pretrained), the train state (`Trainer.state_dict()`)
    and the resolved config, atomically, with a manifest that records `step`."""

    from grpo import lora

    def write(tmp: Path) -> None:
        wrapper = lora.peft_model(model)
        if wrapper is not None:  # the adapter only: the base model is the one the run started from
            wrapper.save_pretrained(tmp, selected_adapters=[lora.POLICY_ADAPTER], safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if state is not None:
            torch.save(state, tmp / STATE)
        if cfg is not None:
            config_module.save(cfg, tmp / CONFIG)

    if step is None:
        step = (state or {}).get("step")
    return atomic_directory_write(Path(directory), write, step)


# ---------------------------------------------------------------- reading back


def verify(directory: Path) -> str:
    """"" when every file in the manifest is there with its size and hash; else what is wrong."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (it was not finished)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    if STATE not in files:
        return f"no {STATE} (a model export, not a checkpoint to resume from)"
    for name, meta in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(path) != meta["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return ""


def manifest_step(directory: Path) -> int | None:
    try:
        return int(json.loads((Path(directory) / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoints(run_dir: Path) -> list[Path]:
    """checkpoint-N/ and final/ in `run_dir`, oldest first (final after a checkpoint of its step)."""
    found = []
    if Path(run_dir).is_dir():
        for path in Path(run_dir).iterdir():
            match = _CHECKPOINT.fullmatch(path.name)
            if match and path.is_dir():
                found.append(((int(match[1]), 0), path))
            elif path.name == FINAL and path.is_dir():
                step = manifest_step(path)
                found.append(((step if step is not None else -1, 1), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact checkpoint of `run_dir` (damaged newer ones are passed over with a
    warning); None when it has none at all."""
    found = checkpoints(run_dir)
    damaged = []
    for path in reversed(found):
        problem = verify(path)
        if not problem:
            for bad, why in damaged:
                log.warning("checkpoint %s is damaged (%s); resuming from %s instead", bad, why, path)
            return path
        damaged.append((path, problem))
    if damaged:
        listed = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        raise ConfigError(
            f"output_dir: no intact checkpoint in {run_dir} ({listed}); set overwrite_output_dir=true to start afresh"
        )
    return None


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]
    """`Trainer.state_dict()` as it was saved."""
    config: dict[str, Any]

    @property
    def step(self) -> int:
        return self.state["train"]["step"]

    @property
    def has_adapter(self) -> bool:
        return (self.path / ADAPTER_CONFIG).is_file()

    def load_weights(self, model: torch.nn.Module) -> None:
        """The policy's saved weights into `model` (of the same architecture), in place; a LoRA
        checkpoint's adapter into the adapter of `model` (adapted the same way)."""
        from safetensors.torch import load_file

        from grpo import lora

        if self.has_adapter or lora.is_adapted(model):
            if not (self.has_adapter and lora.is_adapted(model)):
                held = "a LoRA adapter" if self.has_adapter else "full weights"
                raise ConfigError(
                    f"--resume {self.path}: the checkpoint holds {held}, the model {'has none' if self.has_adapter else 'has an adapter'}; "
                    "resume with the model and model.lora settings the run started with"
                )
            lora.load_adapter_state(model, load_file(self.path / ADAPTER_WEIGHTS), what=f"--resume {self.path}")
            return
        weights = self.weights(model)
        result = model.load_state_dict(weights, strict=False)
        current = model.state_dict()
        loaded = {current[k].data_ptr() for k in weights if k in current}
        # save_pretrained leaves out tied weights (the output layer that is the embedding)
        missing = [k for k in result.missing_keys if current[k].data_ptr() not in loaded]
        if result.unexpected_keys or missing:
            raise ConfigError(
                f"--resume {self.path}: its weights do not fit model.name's model (missing {missing[:3]}, "
                f"unexpected {result.unexpected_keys[:3]}); resume with the model the run started from"
            )


    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The checkpoint's full weights by name (a weights checkpoint, not an adapter), each a name of `model`'s."""
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for file in sorted(self.path.glob("*.safetensors")):
            weights.update(load_file(file))
        unexpected = sorted(set(weights) - set(model.state_dict()))
        if unexpected:
            raise ConfigError(
                f"--resume {self.path}: its weights do not fit model.name's model (unexpected {unexpected[:3]}); "
                "resume with the model the run started from"
            )
        return weights


def load_checkpoint(path: Path, cfg) -> Checkpoint:
    """A verified checkpoint whose config differs from `cfg` only in keys a resumed run may change."""
    path = Path(path)
    problem = verify(path)
    if problem:
        raise ConfigError(f"--resume {path}: not a checkpoint to resume from: {problem}")
    saved = yaml.safe_load((path / CONFIG).read_text()) if (path / CONFIG).is_file() else None
    if saved is None:
        raise ConfigError(f"--resume {path}: no {CONFIG}; resume from a checkpoint written by grpo train")
    differing = config_differences(saved, yaml.safe_load(yaml.safe_dump(cfg.to_dict())))  # compared as saved
    if differing:
        raise ConfigError(
            f"--resume {path}: the checkpoint was made with another config; these keys differ: "
            + ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, a, b in differing)
            + "; set them back to resume (only training.max_steps, training.save_steps, training.save_total_limit, "
            "training.kernels, logging.* and eval.* may change), or start a new run in another output_dir"
        )
    # our own file, written by torch.save: it holds Python and NumPy RNG states, not only tensors
    state = torch.load(path / STATE, map_location="cpu", weights_only=False)
    return Checkpoint(path, state, saved)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) of each key outside RESUMABLE_CHANGES that differs."""
    a, b = _flatten(saved), _flatten(now)
    return [
        (key, a.get(key), b.get(key))
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key) and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_CHANGES)
    ]


# ---------------------------------------------------------------- housekeeping


def remove_leftovers(run_dir: Path) -> None:
    """Half-written checkpoints (`.checkpoint-N.tmp-PID/`) and replaced ones a crash left behind."""
    if Path(run_dir).is_dir():
        for path in Path(run_dir).iterdir():
            if _LEFTOVER.fullmatch(path.name) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def remove_checkpoints(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def prune(run_dir: Path, keep: int) -> None:
    """Keeps the newest `keep` checkpoint-N/ (final/ is never pruned); 0 keeps all."""
    if keep > 0:
        numbered = [p for p in checkpoints(run_dir) if p.name != FINAL]
        remove_checkpoints(numbered[:-keep])
