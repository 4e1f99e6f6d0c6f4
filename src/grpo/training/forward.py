"""The policy's (or the reference's, or the critic's) forward passes over a generation batch.

A batch is walked in minibatches of whole groups (per_device_train_batch_size completions,
similar lengths together), each computed in micro-batches bounded by a token budget
(grpo.training.batching), so activation memory stays bounded whatever the batch size. Under a
sharded backend (FSDP) every rank runs as many passes as the busiest one: the missing ones are
empty micro-batches (`NO_ROWS`) that run the backend's `idle_pass`.

`Forward` holds what every such pass reads, resolved once at build: the backend (device,
autocast, the output layer's kernels), the sampling temperature the log-probabilities are
taken at, the chunk size of the output layer and the split.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from grpo.models.kept_mass import Filters, kept_logmass
from grpo.models.logprobs import completion_hidden_states, completion_logprobs
from grpo.training.batching import GenerationBatch, microbatches, minibatches

NO_ROWS = torch.zeros(0, dtype=torch.long, device="cpu")


def trim_left(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop leading columns that are padding in every row."""
    first = int((mask.sum(0) > 0).nonzero()[0]) if mask.any() else mask.shape[1] - 1
    return ids[:, first:], mask[:, first:]


@dataclass(frozen=True)
class Split:
    """How a batch is cut: minibatches of `batch_size` completions (whole groups of
    `num_generations`), each in micro-batches of at most `microbatch_tokens` tokens."""

    batch_size: int
    num_generations: int
    microbatch_tokens: int | None

    def __call__(self, batch: GenerationBatch) -> list[list[torch.Tensor]]:
        """The batch's minibatches, each as its micro-batches (row indices)."""
        return [
            microbatches(batch.rollout, rows, self.microbatch_tokens)
            for rows in minibatches(
                batch.rollout.lengths.tolist(), self.num_generations, self.batch_size
            )
        ]


def evened(pieces: list[list[torch.Tensor]], backend) -> list[list[torch.Tensor]]:
    """`pieces` and, when the backend needs every rank to run as many forward/backward passes
    (FSDP: each is a collective), one more minibatch of empty micro-batches (NO_ROWS) to make
    up this rank's difference to the busiest rank; an empty one runs `backend.idle_pass`."""
    count = sum(len(m) for m in pieces)
    missing = backend.passes_needed(count) - count
    return pieces + [[NO_ROWS] * missing] if missing else pieces


@dataclass(frozen=True)
class Forward:
    """Log-probabilities of a batch's completion tokens under a model (see the module's docstring)."""

    backend: object
    split: Split
    temperature: float
    chunk_size: int | None

    def rows(self, model, batch: GenerationBatch, rows: torch.Tensor, grad: bool):
        """(logp, entropy) [len(rows), width] of the completions `rows`, width = their longest."""
        ro = batch.rollout
        prompt_ids, prompt_mask = trim_left(ro.prompt_ids[rows], ro.prompt_mask[rows])
        width = max(1, int(ro.completion_mask[rows].sum(-1).max()))
        context = contextlib.nullcontext() if grad else torch.no_grad()
        with context, self.backend.autocast():
            return completion_logprobs(
                model,
                prompt_ids,
                prompt_mask,
                ro.completion_ids[rows, :width],
                ro.completion_mask[rows, :width],
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                kernels=self.backend.output_layer_kernels(),
            )

    def batch(self, model, batch: GenerationBatch) -> torch.Tensor:
        """log pi [N, T] of every completion token under `model`, without gradients (in eval
        mode: the sampling policy and the reference are scored, not trained)."""
        backend = self.backend
        was_training = model.training
        model.eval()
        out = torch.zeros(len(batch), batch.rollout.completion_ids.shape[1], device=backend.device)
        try:
            for pieces in evened(self.split(batch), backend):
                for rows in pieces:
                    if not len(rows):
                        backend.idle_pass(model, grad=False)
                        continue
                    logp, _ = self.rows(model, batch, rows, grad=False)
                    out[rows, : logp.shape[1]] = logp
        finally:
            model.train(was_training)
        return out

    def kept_logmass(self, model, batch: GenerationBatch, filters: Filters) -> torch.Tensor:
        """log M [N, T]: per completion token, the log of the probability mass the sampling
        filters keep under `model` (grpo.models.kept_mass), 0 at padding; without gradients, in
        eval mode, as `batch` scores the policy the update starts from. Not under FSDP, whose
        shards are whole only inside its own forward passes (the caller leaves it out there)."""
        was_training = model.training
        model.eval()
        ro = batch.rollout
        out = torch.zeros(ro.completion_ids.shape, device=self.backend.device)
        softcap = getattr(model.config, "final_logit_softcapping", None)
        try:
            for rows in (r for pieces in self.split(batch) for r in pieces):
                prompt_ids, prompt_mask = trim_left(ro.prompt_ids[rows], ro.prompt_mask[rows])
                width = max(1, int(ro.completion_mask[rows].sum(-1).max()))
                ids, mask = ro.completion_ids[rows, :width], ro.completion_mask[rows, :width]
                with torch.no_grad(), self.backend.autocast():
                    hidden = completion_hidden_states(model, prompt_ids, prompt_mask, ids, mask)
                    keep = mask.bool()
                    mass = kept_logmass(
                        hidden[keep], model.get_output_embeddings(), ids[keep], filters, softcap
                    )
                block = torch.zeros(ids.shape, device=out.device).masked_scatter(keep, mass)
                out[rows, :width] = block
        finally:
            model.train(was_training)
        return out
