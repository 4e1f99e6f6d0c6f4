"""A checkpoint as a model to use elsewhere (`grpo export CHECKPOINT --out DIR [--merge]`).

    merge=False   the model files alone: a LoRA checkpoint's adapter (adapter_config.json,
                  adapter_model.safetensors; load it with PeftModel.from_pretrained(base, DIR))
                  or a full checkpoint's weights, and the tokenizer; no train state
    merge=True    a LoRA checkpoint's adapter merged into its base model (peft's
                  merge_and_unload): a plain model + tokenizer that
                  AutoModelForCausalLM.from_pretrained(DIR) loads, with no peft needed

The base model of a merge is the one the run trained on, loaded again from the
checkpoint's config.yaml (`model.name`, in `model.dtype`; a QLoRA run's base is loaded
unquantized, so the merged weights are the dequantized base plus the adapter). The
export is written like a checkpoint: into a hidden temporary directory, with a
manifest, renamed into place when complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from grpo.config import safe_yaml
from grpo.config.errors import ConfigError
from grpo.run import checkpoint as ckpt

_RUN_FILES = (ckpt.STATE, ckpt.CONFIG, ckpt.MANIFEST)
"""What a checkpoint holds besides the model: the run's state, config and manifest."""


def export_checkpoint(checkpoint: Path, out: Path, merge: bool) -> Path:
    """Write the model of `checkpoint` (a checkpoint-N/ or final/ directory of a run) to
    `out`, merged with its base model when `merge`; returns `out`."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir() or not (checkpoint / ckpt.MANIFEST).is_file():
        what = (
            "does not exist"
            if not checkpoint.exists()
            else ("is a file" if not checkpoint.is_dir() else f"has no {ckpt.MANIFEST}")
        )
        raise ConfigError(
            f"grpo export: {checkpoint} is not a checkpoint directory (it {what}); give a checkpoint-N/ or final/ "
            "directory of a run's output_dir"
        )
    problem = ckpt.verify(checkpoint)
    if problem:
        raise ConfigError(
            f"grpo export: checkpoint {checkpoint} is damaged: {problem}; export an earlier checkpoint of the run"
        )
    has_adapter = (checkpoint / ckpt.ADAPTER_CONFIG).is_file()
    if merge and not has_adapter:
        raise ConfigError(
            f"grpo export --merge: {checkpoint} holds full weights, not a LoRA adapter, so it is already a model "
            f"(AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}) loads it); there is nothing to merge: "
            "export it without --merge to copy the model files alone"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"grpo export --out: {out} exists and is not empty; give a new or empty directory"
        )
    write = _merged_writer(checkpoint) if merge else _copier(checkpoint)
    # the export's manifest has no train state: grpo.run.checkpoint.verify calls it a model export
    return ckpt.atomic_directory_write(out, write, ckpt.manifest_step(checkpoint))


def _copier(checkpoint: Path):
    def write(tmp: Path) -> None:
        for path in sorted(checkpoint.iterdir()):
            if path.name in _RUN_FILES:
                continue
            if path.is_dir():
                shutil.copytree(path, tmp / path.name)
            else:
                shutil.copy2(path, tmp / path.name)

    return write


def _merged_writer(checkpoint: Path):
    """Loads the base model and the adapter first, so that a failure leaves nothing behind."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from grpo.config import loading as config_module
    from grpo.models.loading import load_model_and_tokenizer

    saved = (
        safe_yaml.read(checkpoint / ckpt.CONFIG, "checkpoint config")
        if (checkpoint / ckpt.CONFIG).is_file()
        else None
    )
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise ConfigError(
            f"grpo export --merge: {checkpoint} has no {ckpt.CONFIG} with a model section, so its base model is "
            "unknown; load the adapter yourself with PeftModel.from_pretrained(base, checkpoint).merge_and_unload()"
        )
    model_section = dict(saved["model"])
    if model_section.get("trust_remote_code"):  # a checkpoint is data: it never grants running code
        raise ConfigError(
            f"grpo export --merge: {checkpoint}/{ckpt.CONFIG} sets model.trust_remote_code, which a checkpoint's "
            "config cannot grant; load the base model yourself (after reading its code) and merge with "
            "PeftModel.from_pretrained(base, checkpoint).merge_and_unload()"
        )
    # an earlier version's key (now cpu.kernels): loading needs none of it
    model_section.pop("cpu_kernels", None)
    # merge into full-precision weights
    model_section["lora"] = {
        **model_section.get("lora", {}),
        "quantize": "none",
    }
    model_cfg = config_module.from_dict({"model": model_section}).model
    base, _ = load_model_and_tokenizer(model_cfg)
    merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))

    def write(tmp: Path) -> None:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return write
