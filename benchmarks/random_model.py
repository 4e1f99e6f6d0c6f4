"""A random-initialised model of a real model's shape, built in memory (random_model) or written
as a save_pretrained directory, for benchmarks on machines with no model hub
(benchmarks/gpu_check.sh, benchmarks/trl_style_script.py).

    python benchmarks/random_model.py --shape qwen2.5-0.5b --out /tmp/qwen-shape

The weights are random (seeded), so the timings and memory are the real model's and the
completions are noise. The tokenizer is a word-level one with exactly the model's vocabulary
size: every printable character is a token, the rest are placeholder tokens, so any id the
model samples decodes.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

# Qwen2.5-0.5B-Instruct's config.json (the seeds' reference model): 494M parameters, tied embeddings.
SHAPES = {
    "qwen2.5-0.5b": dict(
        architecture="Qwen2ForCausalLM",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-1.5B-Instruct's config.json: 1.54B parameters, tied embeddings.
    "qwen2.5-1.5b": dict(
        architecture="Qwen2ForCausalLM",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-7B-Instruct's config.json: 7.62B parameters, separate input and output embeddings.
    "qwen2.5-7b": dict(
        architecture="Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # a small model of the same family, for trying the scripts on a CPU
    "qwen-tiny": dict(
        architecture="Qwen2ForCausalLM",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def tokenizer_of_size(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tokens = SPECIAL + characters
    tokens += [f"<t{i}>" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(
        models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def random_model(shape: str, seed: int = 0, device: str = "cpu", dtype=None):
    """(model, tokenizer) of `shape`, its weights drawn from `seed` on `device` in `dtype`
    (default float32): built where it will run, so a 7B shape takes seconds on a GPU and never
    passes through host memory. The same seed, device and dtype give the same weights."""
    import torch
    import transformers

    spec = dict(SHAPES[shape])
    architecture = spec.pop("architecture")
    tokenizer = tokenizer_of_size(spec["vocab_size"])
    config_class = transformers.AutoConfig.for_model("qwen2").__class__
    config = config_class(**spec, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device):
            model = getattr(transformers, architecture)(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval(), tokenizer


def write_random_model(shape: str, out: Path, seed: int = 0) -> Path:
    model, tokenizer = random_model(shape, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_random_model(args.shape, args.out, args.seed))


if __name__ == "__main__":
    main()
