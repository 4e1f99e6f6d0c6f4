"""A tiny random-weight causal LM with a character tokenizer.

Built in memory from a seed, with no download: the `tiny` model of the
examples and the model of the tests. Every printable ASCII character is one
token, so any text round-trips exactly.
"""

from __future__ import annotations

import string

import torch

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))


def char_tokenizer():
    """A PreTrainedTokenizerFast with one token per printable character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
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


def tiny_model(
    tokenizer,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    dtype=torch.float32,
    head_size: int = 16,
):
    """A small Llama-architecture model with random weights, deterministic in `seed`: attention
    heads of `head_size`, a key/value head for every two query heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // head_size),
        num_key_value_heads=max(1, hidden_size // (2 * head_size)),
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype)
