import pytest
import torch
import torch

from grpo.models.tiny import char_tokenizer, tiny_model


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    return tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=3)


@pytest.fixture
def gemma3_tiny(tokenizer):
    """Builds a tiny random Gemma 3 (a sliding-window layer of 4 tokens, then a full one),
    the same weights for the same head counts."""

    def build(num_attention_heads: int = 2, num_key_value_heads: int = 1):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=16,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256,
        )
        torch.manual_seed(0)
        return Gemma3ForCausalLM(config)

    return build


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny models: thread hand-offs cost more than the arithmetic, and the 2 cores are shared.
    torch.set_num_threads(1)


def _completion_rows(completions) -> list[list[int]]:
    """Each row's completion tokens: a Rollout's up to its mask, or lists of token ids as given."""
    if isinstance(completions, (list, tuple)):
        return [list(map(int, row)) for row in completions]
    return [row[: int(n)].tolist() for row, n in zip(completions.completion_ids, completions.completion_mask.sum(-1))]


def _assert_same_greedy(model, got, expected, atol: float, autocast_dtype=None, msg: str = "") -> list[int]:
    """Greedy completions of the same prompts decoded through two different code paths (other
    kernels, attention implementations, batch shapes, cache layouts) are the same tokens, except
    where the model's two candidates for a token are tied to within `atol`: the paths' logits
    differ in their last bits (how much depends on the CPU: oneDNN and MKL block each shape
    their own way), so at a tie either may be picked, and that row is compared no further.

    `got` is a Rollout; `expected` a Rollout of the same prompts in the same row order, or
    each row's completion tokens as lists. The tie is judged on `model`'s logits for the
    prompt and the tokens both agree on (under bf16 autocast with `autocast_dtype`): any
    other difference, a token that is not a tie or one row ending where the other goes on,
    fails. A wrong path differs by far more than rounding. Returns the rows that took the
    other side of a tie (usually none)."""
    prompts = [row[m.bool()].tolist() for row, m in zip(got.prompt_ids, got.prompt_mask)]
    diverged = []
    for i, (a, b) in enumerate(zip(_completion_rows(got), _completion_rows(expected), strict=True)):
        if a == b:
            continue
        t = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert t is not None, f"{msg} row {i}: {a} vs {b}: one completion ends where the other goes on"
        with torch.no_grad(), torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logits = model(input_ids=torch.tensor([prompts[i] + a[:t]])).logits[0, -1].float()
        behind = (logits.max() - logits[[a[t], b[t]]]).tolist()
        assert max(behind) <= atol, (
            f"{msg} row {i} token {t}: {a[t]} vs {b[t]}, {behind} below the best logit: not a tie within {atol}")
        diverged.append(i)
    return diverged


@pytest.fixture
def assert_same_greedy():
    """_assert_same_greedy: greedy tokens from two code paths, equal but for ties within rounding."""
    return _assert_same_greedy
