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
      manifest.json    every other file's size and hash (DIGEST); written last

A checkpoint is written into `.checkpoint-N.tmp-PID/`, each file fsynced, the
manifest last, then renamed into place. The weights and the train state, nearly all of its
bytes, are hashed as they are written (`HashedFile`: one pass over the bytes, the hash on a
second thread beside the write); the small files (tokenizer, configs) are read back and hashed
after. A crash at any moment leaves either the
whole checkpoint or a hidden leftover, which `remove_leftovers` deletes at
start-up. A write that fails (a full disk, a quota, a read-only mount) removes
its temporary directory, leaves the previous checkpoint as it was and ends the
run with `SaveFailed`, which names the directory, its free space and the fix.

train_state.pt holds tensors and plain containers (dicts, lists, tuples, numbers,
strings) only, and is read with `torch.load(weights_only=True)`: loading a
checkpoint never runs code from it, whoever wrote its manifest. A train state that
needs more (one written by an older grpo, which pickled NumPy arrays, or a crafted
pickle) is refused, never unpickled.

A checkpoint is usable when its files match its manifest, its train state loads
that way and its weights load and are finite (`problem`). `--resume` alone takes
output_dir's newest usable checkpoint, passing over the others with a warning
that names the file and what is wrong (a disk that lost writes, a copy cut short,
a file replaced with its manifest rewritten, NaN weights); a checkpoint named
explicitly is refused with that reason instead (`load_checkpoint`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
import yaml

from grpo.config import loading as config_module
from grpo.config import safe_yaml
from grpo.config.errors import ConfigError
from grpo.run import faults

log = logging.getLogger(__name__)

MANIFEST, STATE, CONFIG = "manifest.json", "train_state.pt", "config.yaml"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
"""peft's files: a LoRA run's checkpoint holds its adapter, not the base weights."""
FINAL = "final"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_LEFTOVER = re.compile(r"\.(checkpoint-\d+|final)\.(tmp|old)-\d+")

# Keys a resumed run may change: they decide how long to train, what to log or evaluate,
# and which kernels compute a step's values (cpu.*: the same to float tolerance), never the values.
# The CPU layer's keys of earlier versions (config.MOVED_KEYS) are among them, so that their
# checkpoints resume.
RESUMABLE_CHANGES = (
    "output_dir",
    "overwrite_output_dir",
    "training.max_steps",
    "training.save_steps",
    "training.save_total_limit",
    "cpu.",
    "logging.",
    "eval.",
    "health.",  # the checks read the metrics; they change nothing trained (and older runs have none)
    "model.cpu_kernels",
    "training.kernels",
    "rollout.decoding",
    "rollout.cuda_decoding",  # how tokens are decoded on CUDA, not which: the same run
    "rollout.server.",  # where the generation server listens and how long to wait for it
    "health.",  # the checks read the run; they change nothing in it
)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DIGEST = "xxh3_128"
"""The hash a manifest records for each file: XXH3-128, about ten times as fast as sha256 on one
core (docs/checkpoints.md), so that hashing a checkpoint as it is written keeps up with the disk.
It is there to catch a damaged or truncated file, which it does as surely as sha256; it is no
defence against a file crafted on purpose, and neither would sha256 be, since whoever crafts the
file can rewrite the manifest too."""
_DIGESTS = {DIGEST: xxhash.xxh3_128, "sha256": hashlib.sha256}
"""The hashes `verify` accepts: DIGEST, and sha256, which earlier checkpoints recorded."""


def new_digest():
    return _DIGESTS[DIGEST]()


def _file_digest(path: Path, algorithm: str = DIGEST) -> str:
    digest = _DIGESTS[algorithm]()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_BESIDE = 1 << 20
"""Writes of at least this many bytes are hashed on a second thread while they are written."""


class HashedFile:
    """A file written once, front to back, whose size and hash (DIGEST) are taken from the bytes as
    they go to it: a checkpoint's big files are never read back to be hashed. A large write is
    hashed on a second thread while this one writes it (the hash and the file's write both release
    the GIL), and `write` returns once both are done, so the caller's buffer is never read after it.

        with HashedFile(path) as f:
            torch.save(state, f)
        f.size, f.hexdigest()
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = 0
        self._digest = new_digest()
        self._file = open(self.path, "wb")
        self._beside: ThreadPoolExecutor | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _BESIDE:
            if self._beside is None:
                self._beside = ThreadPoolExecutor(1, thread_name_prefix="grpo-hash")
            hashed = self._beside.submit(self._digest.update, view)
            try:
                self._file.write(view)
            finally:
                hashed.result()
        else:
            self._digest.update(view)
            self._file.write(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._file.flush()

    def writable(self) -> bool:
        return True

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def close(self, sync: bool = True) -> None:
        """Flushed, fsynced (unless `sync` is false: a write that failed) and closed."""
        if self._beside is not None:
            self._beside.shutdown()
            self._beside = None
        if not self._file.closed:
            try:
                if sync:
                    self._file.flush()
                    os.fsync(self._file.fileno())
            finally:
                self._file.close()

    def __enter__(self) -> "HashedFile":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self.close(sync=error_type is None)


Hashed = dict[str, tuple[int, str]]
"""{file name relative to the checkpoint: (size, DIGEST)} of files hashed as they were written."""


def _record(hashed: Hashed, root: Path, f: HashedFile) -> None:
    hashed[f.path.relative_to(root).as_posix()] = (f.size, f.hexdigest())


# safetensors' dtype names (its format's header), for the weights grpo writes itself
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(
    tensors: dict[str, torch.Tensor], f, metadata: dict[str, str] | None = None
) -> None:
    """`tensors` in the safetensors format (what `safetensors.torch.save_file` writes: an 8-byte
    little-endian header length, the JSON header padded with spaces to 8 bytes, then each
    tensor's bytes, the widest dtypes first so that every tensor is aligned), streamed to the
    binary file `f` one tensor at a time (a CUDA tensor is copied to the CPU alone)."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name in order:
        tensor = tensors[name].detach()
        if tensor.numel():
            tensor = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(tensor.numpy().data)


def _writes_safetensors(tensors: dict) -> bool:
    return all(
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and t.dtype in _SAFETENSORS_DTYPES
        and t.device.type != "meta"
        for t in tensors.values()
    )


@contextlib.contextmanager
def _weights_hashed_as_written(root: Path, hashed: Hashed):
    """While it lasts, transformers' `save_pretrained` writes each weights file through
    `write_safetensors` into a HashedFile, so the weights are hashed as they are written; all the
    rest of save_pretrained (which weights, tied ones once, their names, shards, config.json) is
    its own. Where transformers no longer writes through `safe_save_file` (or the tensors are of a
    kind write_safetensors does not write), its own writer writes them and the manifest hashes
    them after, as any other file."""
    try:
        from transformers import modeling_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    original = getattr(modeling_utils, "safe_save_file", None)
    if original is None:
        yield
        return

    def save_file(tensors, filename, metadata=None):
        if not _writes_safetensors(tensors):
            return original(tensors, filename, metadata=metadata)
        with HashedFile(filename) as f:
            write_safetensors(tensors, f, metadata)
        _record(hashed, root, f)

    modeling_utils.safe_save_file = save_file
    try:
        yield
    finally:
        modeling_utils.safe_save_file = original


@contextlib.contextmanager
def _no_crc32():
    """torch.save without its zip records' CRC-32 (a pass over the bytes of its own): the
    manifest's hash, taken as they are written, is the check."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class SaveFailed(ConfigError):
    """A checkpoint (or a log) that could not be written: the message names the directory, its
    free space and the fix. Earlier checkpoints are as they were."""


def _free_space(directory: Path) -> int | None:
    for path in (Path(directory), *Path(directory).parents):
        if path.exists():
            try:
                return shutil.disk_usage(path).free
            except OSError:
                return None
    return None


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


# torch.save's zip writer reports a short write as a RuntimeError ("enforce fail ... unexpected
# pos", "file write failed"); safetensors' as a SafetensorError naming the OS error
_WRITE_FAILURE = re.compile(
    r"unexpected pos|enforce fail|file write failed|No space left|StorageFull|[Qq]uota|"
    r"Read-only file system|IoError|Input/output error"
)


def is_write_failure(error: BaseException) -> bool:
    """Whether `error` is the file system refusing a write (rather than a fault in what was written)."""
    return isinstance(error, OSError) or bool(_WRITE_FAILURE.search(str(error)))


def write_failed(what: Path, error: BaseException, kept: str) -> SaveFailed:
    """The error that ends a run whose write of `what` failed; `kept`: what is left as it was."""
    free = _free_space(what.parent)
    text = str(error).strip()
    reason = getattr(error, "strerror", None) or (
        text.splitlines()[0][:200] if text else type(error).__name__
    )
    if free is not None and free < 64 << 20:
        reason = f"{reason}; the disk is full: {format_bytes(free)} free"
    elif free is not None:
        reason = f"{reason}; {format_bytes(free)} free"
    return SaveFailed(
        f"could not write {what} ({reason}); {kept}: free space or point output_dir elsewhere, "
        "then resume with --resume"
    )


def atomic_directory_write(target: Path, write, step: int | None = None) -> Path:
    """Call write(tmp_dir), add the manifest, fsync, and move tmp_dir to `target` in one rename.

    `write` may return the sizes and hashes of the files it wrote through HashedFile (`Hashed`);
    every other file of tmp_dir (or one whose size has changed since) is read back and hashed.
    A previous `target` is kept until the new one is complete. A write the file system refuses
    (`is_write_failure`) removes tmp_dir and raises SaveFailed; other errors are raised as they are,
    after tmp_dir is removed."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        hashed = write(tmp)
        hashed = hashed if isinstance(hashed, dict) else {}
        faults.reached("save")
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name, size = path.relative_to(tmp).as_posix(), path.stat().st_size
            if name in hashed and hashed[name][0] == size:  # fsynced by HashedFile as it closed
                files[name] = {"size": size, DIGEST: hashed[name][1]}
                continue
            _fsync(path)
            files[name] = {"size": size, DIGEST: _file_digest(path)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync(manifest)
        _fsync(tmp)
    except Exception as error:
        # a half-written checkpoint holds space and nothing else
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(error):
            earlier = [p.name for p in checkpoints(target.parent)]
            kept = (
                f"the checkpoints before it ({', '.join(earlier[-3:])}) are intact"
                if earlier
                else "no checkpoint was kept"
            )
            raise write_failed(target, error, kept) from error
        raise
    faults.reached("manifest")
    old = None
    if target.exists():  # a directory cannot be renamed over a non-empty one: move it aside first
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except OSError as error:
        if old is not None:
            os.replace(old, target)
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(target, error, "the checkpoints before it are intact") from error
    _fsync(target.parent)  # the rename itself survives a power cut
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def estimated_size(model: torch.nn.Module) -> int:
    """Rough bytes of one checkpoint of `model`: the weights saved (the adapter only with LoRA)
    and the optimizer's state (AdamW: two moments of each trainable parameter)."""
    from grpo.models import lora

    params = list(model.parameters())  # tied weights once
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    weights = (
        trainable if lora.is_adapted(model) else sum(p.numel() * p.element_size() for p in params)
    )
    return weights + 2 * trainable


def warn_if_short_of_space(directory: Path, needed: int) -> None:
    """A warning at start-up when `directory`'s disk has less free than one checkpoint needs."""
    free = _free_space(Path(directory))
    if free is not None and free < needed:
        log.warning(
            "output_dir %s has %s free, less than one checkpoint needs (about %s: the weights and the optimizer's "
            "state); the first save will fail: free space or point output_dir elsewhere",
            directory,
            format_bytes(free),
            format_bytes(needed),
        )


def save_checkpoint(
    directory: Path,
    model,
    tokenizer,
    state: dict[str, Any] | None = None,
    cfg=None,
    step: int | None = None,
) -> Path:
    """Model + tokenizer (loadable with from_pretrained), the train state (`Trainer.state_dict()`)
    and the resolved config, atomically, with a manifest that records `step`."""

    from grpo.models import lora

    def write(tmp: Path) -> Hashed:
        hashed: Hashed = {}
        wrapper = lora.peft_model(model)
        if wrapper is not None:  # the adapter only: the base model is the one the run started from
            wrapper.save_pretrained(
                tmp, selected_adapters=[lora.POLICY_ADAPTER], safe_serialization=True
            )
        else:
            with _weights_hashed_as_written(tmp, hashed):
                model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if state is not None:
            with HashedFile(tmp / STATE) as f, _no_crc32():
                torch.save(state, f)
            _record(hashed, tmp, f)
        if cfg is not None:
            config_module.save(cfg, tmp / CONFIG)
        return hashed

    if step is None:
        step = (state or {}).get("step")
    return atomic_directory_write(Path(directory), write, step)


_LINKED = 1 << 20
"""Files of at least this many bytes (the weights, the train state, a large tokenizer) are shared
by link_checkpoint; smaller ones, the configs a user may edit in place, are copied."""


def link_checkpoint(source: Path, target: Path) -> Path | None:
    """`target` as a second name for the complete checkpoint `source`, atomically as any
    checkpoint: its big files hard-linked (no byte written or read again, the manifest's sizes and
    hashes taken over), the small ones copied, so that editing final/config.json in place cannot
    change the checkpoint beside it. Pruning `source` later leaves `target` whole. None when the
    file system cannot link them (then nothing is left behind)."""
    files = json.loads((Path(source) / MANIFEST).read_text())["files"]
    step = manifest_step(Path(source))

    def write(tmp: Path) -> Hashed:
        linked: Hashed = {}
        for name, meta in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            if meta["size"] >= _LINKED and DIGEST in meta:
                os.link(Path(source) / name, tmp / name)
                linked[name] = (meta["size"], meta[DIGEST])
            else:  # hashed and fsynced by atomic_directory_write, as any file it was not told of
                shutil.copyfile(Path(source) / name, tmp / name)
        return linked

    try:
        return atomic_directory_write(Path(target), write, step)
    except (SaveFailed, OSError):
        return None


# ---------------------------------------------------------------- reading back


def verify(directory: Path) -> str:
    """ "" when every file in the manifest is there with its size and hash; else what is wrong."""
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
        algorithm = next((a for a in _DIGESTS if a in meta), None)
        if algorithm is None:
            return f"{name} has no hash in the manifest"
        if _file_digest(path, algorithm) != meta[algorithm]:
            return f"{name} does not match its {algorithm} in the manifest"
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


class Unusable(Exception):
    """A checkpoint that cannot be resumed from; the message says which file and why."""

    def __init__(self, why: str, damaged: bool = True):
        super().__init__(why)
        self.damaged = damaged
        """Its files do not match its manifest (rather than: they match, and cannot be loaded)."""


UNSAFE_STATE = (
    "was written by an older grpo whose train state needs unpickling arbitrary objects ({names}); "
    "it cannot be loaded safely: start afresh or resume with the grpo version that wrote it"
)


def read_state(path: Path) -> dict[str, Any]:
    """A train_state.pt as tensors and plain containers, never running code from the file
    (`torch.load(weights_only=True)`); Unusable naming the file and why when it cannot be read so."""
    name = path.name
    if not zipfile.is_zipfile(
        path
    ):  # torch.save writes a zip archive; a bare pickle is nothing grpo wrote
        raise Unusable(f"{name} is unreadable (not a file written by torch.save)", damaged=False)
    try:
        with warnings.catch_warnings():
            # torch's advice to retry with weights_only=False is not taken
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to read it is the reason to pass it over
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001
            unsafe = []
        if unsafe:
            raise Unusable(
                f"{name} " + UNSAFE_STATE.format(names=", ".join(unsafe[:4])), damaged=False
            ) from error
        first = next(
            (line for line in str(error).splitlines() if line.strip()), type(error).__name__
        )
        raise Unusable(f"{name} is unreadable ({first[:200]})", damaged=False) from error
    if not (
        isinstance(state, dict)
        and isinstance(state.get("train"), dict)
        and "step" in state["train"]
    ):
        raise Unusable(f"{name} holds no train state written by grpo train", damaged=False)
    return state


def _config_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the model the checkpoint's own config.json describes, from a
    model built on the meta device (no memory, no weights, no code from the directory); empty
    when there is no config.json (a LoRA checkpoint: peft checks its adapter's shapes)."""
    if not (Path(directory) / "config.json").is_file():
        return {}
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - transformers' own errors for a config it cannot build
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        raise Unusable(f"config.json describes no model grpo can build ({first[:200]})") from error
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_weights(directory: Path) -> None:
    """Every *.safetensors file of `directory` readable, each weight of the shape its config.json's
    model has, and its floating-point tensors finite; Unusable naming the file and the tensor
    otherwise (a checkpoint whose manifest was rewritten around a tensor of another shape is
    passed over like a damaged one, not left to fail inside load_state_dict)."""
    from safetensors import safe_open

    shapes = _config_shapes(directory)
    for file in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    shape = tuple(f.get_slice(key).get_shape())
                    if shapes and shapes.get(key, shape) != shape:
                        raise Unusable(
                            f"{file.name}: {key} has shape {list(shape)}, and the model of its "
                            f"config.json {list(shapes[key])}",
                            damaged=False,
                        )
                    tensor = f.get_tensor(key)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise Unusable(
                            f"{file.name} holds non-finite weights (NaN or infinity in {key})",
                            damaged=False,
                        )
        except Unusable:
            raise
        except Exception as error:  # noqa: BLE001 - safetensors' own errors, OSError, ...
            first = next(
                (line for line in str(error).splitlines() if line.strip()), type(error).__name__
            )
            raise Unusable(f"{file.name} is unreadable ({first[:200]})", damaged=False) from error


# The state `latest_checkpoint` read to check the checkpoint it chose, for `load_checkpoint` to
# take instead of reading it again (an optimizer's state is twice the weights): one entry, kept
# while the checkpoint's manifest and state file are the ones checked.
_checked: dict[str, Any] = {}


def _signature(directory: Path) -> tuple:
    state = os.stat(directory / STATE)
    return (
        str(directory.resolve()),
        (directory / MANIFEST).read_bytes(),
        state.st_ino,
        state.st_size,
        state.st_mtime_ns,
    )


def _usable_state(directory: Path, verified: bool = False) -> dict[str, Any]:
    """The train state of a usable checkpoint (`problem`'s checks; `verified`: its files were
    just checked against the manifest); Unusable otherwise."""
    why = "" if verified else verify(directory)
    if why:
        raise Unusable(why)
    try:
        signature = _signature(directory)
    except OSError as error:
        raise Unusable(f"{STATE} is unreadable ({error})") from error
    if _checked.get("signature") == signature:
        return _checked["state"]
    _checked.clear()
    state = read_state(directory / STATE)
    check_weights(directory)
    _checked.update(signature=signature, state=state)
    return state


def problem(directory: Path) -> str:
    """ "" when `directory` is a checkpoint to resume from: its files match its manifest, its train
    state loads without running code and its weights load and are finite; else what is wrong."""
    try:
        _usable_state(Path(directory))
    except Unusable as why:
        return str(why)
    return ""


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest usable checkpoint of `run_dir` (newer ones that are damaged or cannot be loaded
    are passed over with a warning naming the file and why); None when it has none at all.
    Refused while another process's run holds `run_dir` (grpo.run.run_lock): its checkpoints are
    still being written and pruned."""
    from grpo.run import run_lock

    run_lock.check_not_in_use(run_dir)
    found = checkpoints(run_dir)
    passed = []
    for path in reversed(found):
        try:
            _usable_state(path)
        except Unusable as why:
            passed.append((path, why))
            continue
        for bad, why in passed:
            log.warning(
                "checkpoint %s %s (%s); resuming from %s instead",
                bad,
                "is damaged" if why.damaged else "cannot be loaded",
                why,
                path,
            )
        return path
    if passed:
        listed = "; ".join(f"{p.name}: {why}" for p, why in passed)
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

        from grpo.models import lora

        if self.has_adapter or lora.is_adapted(model):
            if not (self.has_adapter and lora.is_adapted(model)):
                held = "a LoRA adapter" if self.has_adapter else "full weights"
                raise ConfigError(
                    f"--resume {self.path}: the checkpoint holds {held}, the model {'has none' if self.has_adapter else 'has an adapter'}; "
                    "resume with the model and model.lora settings the run started with"
                )
            lora.load_adapter_state(
                model, load_file(self.path / ADAPTER_WEIGHTS), what=f"--resume {self.path}"
            )
            return
        weights = self.weights(model)
        current = model.state_dict()
        wrong = [
            f"{k} is {list(v.shape)} there, {list(current[k].shape)} in the model"
            for k, v in weights.items()
            if k in current and v.shape != current[k].shape
        ]
        if wrong:
            raise ConfigError(
                f"--resume {self.path}: its weights do not fit model.name's model ({'; '.join(wrong[:3])}); "
                "resume with the model the run started from"
            )
        result = model.load_state_dict(weights, strict=False)
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
    """A usable checkpoint (`problem`) whose config differs from `cfg` only in keys a resumed run
    may change; a ConfigError naming the file and why otherwise."""
    path = Path(path)
    why = verify(path)
    if why:
        raise ConfigError(f"--resume {path}: not a checkpoint to resume from: {why}")
    try:  # a shared checkpoint's config is untrusted YAML like any other: bounded, UTF-8, no duplicate keys
        saved = (
            safe_yaml.read(path / CONFIG, "checkpoint config")
            if (path / CONFIG).is_file()
            else None
        )
    except ConfigError as error:
        raise ConfigError(
            f"--resume {path}: its {CONFIG} is unreadable ({error}); resume from another checkpoint"
        ) from None
    if not isinstance(saved, dict):
        raise ConfigError(
            f"--resume {path}: no {CONFIG}; resume from a checkpoint written by grpo train"
        )
    # compared as saved
    differing = config_differences(saved, yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    if differing:
        raise ConfigError(
            f"--resume {path}: the checkpoint was made with another config; these keys differ: "
            + ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, a, b in differing)
            + "; set them back to resume (only training.max_steps, training.save_steps, training.save_total_limit, "
            "cpu.*, logging.*, eval.* and health.* may change), or start a new run in another output_dir"
        )
    try:
        state = _usable_state(path, verified=True)
    except Unusable as why:
        raise ConfigError(f"--resume {path}: cannot resume from it: {why}") from None
    _checked.clear()  # taken: the trainer holds it from here on
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
    """(key, saved value, current value) of each key outside RESUMABLE_CHANGES that differs in
    meaning (grpo.config.loading.as_applied)."""
    a, b = (config_module.as_applied(_flatten(c)) for c in (saved, now))
    return [
        (key, a.get(key), b.get(key))
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key)
        and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_CHANGES)
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
