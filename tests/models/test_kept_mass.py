"""The mass top-k / top-p / min-p sampling keeps (grpo.models.kept_mass), against a row-by-row
transcription of how vLLM's sampler filters (temperature, min_p on probabilities, top_k on the
logits, top_p on what is left, renormalised, by an ascending cumulative sum); and in a run whose
engine reports its logprobs over the kept tokens only, the update puts them back on the whole
vocabulary: the engine's and the update's logprobs agree (rollout/logprob_diff ~ 0), where
without it they differ by log(kept mass)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.models.kept_mass import kept_logmass, kept_logmass_of_logits
from grpo.models.logprobs import completion_hidden_states
from grpo.rollout import SamplingParams
from grpo.rollout.hf import TransformersEngine


def _vllm_kept(row: torch.Tensor, filters: SamplingParams) -> torch.Tensor:
    """One row's kept tokens, step by step as vLLM's sampler does it (float64, by sorting)."""
    logits = row.double() / filters.temperature
    keep = torch.ones_like(logits, dtype=torch.bool)
    if filters.min_p > 0:
        probs = torch.softmax(logits, -1)
        keep &= probs >= filters.min_p * probs.max()
    masked = logits.masked_fill(~keep, -math.inf)
    if filters.top_k:
        ordered = masked.sort(descending=True).values
        keep &= masked >= ordered[filters.top_k - 1]
        masked = logits.masked_fill(~keep, -math.inf)
    if filters.top_p < 1:
        ascending, order = masked.sort()
        cumulative = torch.softmax(ascending, -1).cumsum(-1)
        dropped = cumulative <= 1 - filters.top_p
        dropped[-1] = False  # the most likely always stays
        keep &= ~torch.zeros_like(keep).scatter(0, order, dropped)
    return keep


def _filters(temperature: float, **kept) -> SamplingParams:
    return SamplingParams(max_new_tokens=4, temperature=temperature, **kept)


FILTERS = [
    _filters(0.7, top_k=5),
    _filters(0.7, top_p=0.8),
    _filters(1.3, min_p=0.05),
    _filters(0.7, top_k=20, top_p=0.9, min_p=0.02),
    _filters(0.5, top_k=3, top_p=0.5),
    _filters(0.9, top_k=1),
]


@pytest.mark.parametrize(
    "filters", FILTERS, ids=lambda f: f"t{f.temperature}-k{f.top_k}-p{f.top_p}-min{f.min_p}"
)
def test_the_kept_mass_is_the_one_vllms_filters_keep(filters):
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 300, generator=generator)
    probs = torch.softmax(logits / filters.temperature, -1)
    # a sampled token from each row's kept set, and in two rows one the filters drop (the sampler
    # kept it: the trainer's rounding may put it a hair outside)
    kept = torch.stack([_vllm_kept(row, filters) for row in logits])
    tokens = torch.multinomial(probs * kept, 1, generator=generator).squeeze(-1)
    tokens[:2] = (probs * ~kept)[:2].argmax(-1)
    assert not kept[0, tokens[0]]
    got = kept_logmass_of_logits(logits, tokens, filters)
    kept[torch.arange(64), tokens] = True
    want = torch.log((probs.double() * kept).sum(-1))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    assert bool((got <= 1e-6).all()) and bool((got < -1e-3).any())
    # processed = log p - log M: back on the whole vocabulary with it
    processed = torch.log(probs.double() / (probs.double() * kept).sum(-1, keepdim=True))
    rows = torch.arange(64)
    back = processed[rows, tokens] + got.double()
    torch.testing.assert_close(back, torch.log(probs.double())[rows, tokens], atol=1e-5, rtol=0)


def test_through_the_output_layer_in_bounded_blocks(tokenizer, monkeypatch):
    """From hidden states through the output layer (and a soft cap), block after block: the same
    as from the whole logits at once."""
    from grpo.models import kept_mass
    from grpo.models.tiny import tiny_model

    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
    hidden = torch.randn(37, 32, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, len(tokenizer), (37,), generator=torch.Generator().manual_seed(2))
    filters = _filters(0.7, top_k=4, top_p=0.9)
    layer = model.get_output_embeddings()
    with torch.no_grad():
        whole = kept_logmass_of_logits(30 * torch.tanh(layer(hidden) / 30), tokens, filters)
        monkeypatch.setattr(kept_mass, "ROW_ELEMENTS", 5 * layer.weight.shape[0])  # 5 rows a block
        blocks = kept_logmass(hidden, layer, tokens, filters, softcap=30.0)
    torch.testing.assert_close(blocks, whole, atol=1e-6, rtol=0)
    assert kept_logmass(hidden[:0], layer, tokens[:0], filters).shape == (0,)


def _over_kept_engine(monkeypatch, filters: SamplingParams):
    """The hf engine made to report its logprobs as vLLM's processed ones are: over the kept
    tokens only (its own, over the whole vocabulary, minus log M under the weights it sampled
    with), and to say so."""
    original = TransformersEngine.generate

    def generate(self, prompts, num_generations, params, seeds=None):
        rollout = original(self, prompts, num_generations, params, seeds)
        if rollout.sampling_logprobs is None:
            return rollout
        keep = rollout.completion_mask.bool()
        with torch.no_grad():
            hidden = completion_hidden_states(
                self.model,
                rollout.prompt_ids,
                rollout.prompt_mask,
                rollout.completion_ids,
                rollout.completion_mask,
            )
            mass = kept_logmass(
                hidden[keep],
                self.model.get_output_embeddings(),
                rollout.completion_ids[keep],
                filters,
            )
        processed = rollout.sampling_logprobs.clone()
        processed[keep] -= mass
        rollout.sampling_logprobs = processed
        return rollout

    monkeypatch.setattr(TransformersEngine, "generate", generate)
    monkeypatch.setattr(TransformersEngine, "logprobs_over_kept", True, raising=False)


@pytest.mark.parametrize("corrected", [True, False], ids=["kept mass added", "without"])
def test_the_update_puts_kept_only_logprobs_on_the_whole_vocabulary(
    tokenizer, tmp_path, make_trainer, monkeypatch, corrected
):
    filters = _filters(0.7, top_k=4, top_p=0.9)
    _over_kept_engine(monkeypatch, filters)
    if not corrected:  # the update as it was: the engine's logprobs taken as they come
        monkeypatch.setattr("grpo.training.build._kept_filters", lambda *a: None)
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=2",
            "rollout.max_completion_length=4",
            "rollout.temperature=0.7",
            "rollout.top_k=4",
            "rollout.top_p=0.9",
            "cpu.decoding=plain",
            "training.per_device_train_batch_size=32",
        ],
    )
    assert (trainer.parts.phases.update.kept is not None) is corrected
    m = trainer.train()[-1]
    if corrected:
        assert m["rollout/logprob_diff_mean"] < 1e-5 and m["rollout/logprob_diff_max"] < 1e-4
    else:  # the gap is log(kept mass): what the correction would see as a policy change
        assert m["rollout/logprob_diff_max"] > 1e-2
