"""The GRPO training loop.

One step, top to bottom (DESIGN.md's data flow):

    prompts -> rollout (G completions each) -> rewards -> group advantages
    -> [dynamic sampling: drop groups with no reward spread, refill]
    -> num_iterations optimizer passes over minibatches
    -> [reference sync] -> metrics, checkpoint, evaluation
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from grpo import algorithm, config as config_module
from grpo.checkpoint import save_checkpoint
from grpo.config import Config, ConfigError
from grpo.data import Row, encode_prompts, is_conversational, load_rows, prompt_stream
from grpo.evaluate import Evaluator, check_answers, format_table
from grpo.logprobs import completion_logprobs
from grpo.memory import release_free_memory
from grpo.models import bf16_autocast, generation_token_ids, load_model_and_tokenizer, prepare_for_device, resolve_device
from grpo.progress import ConsoleProgress
from grpo.rewards import RewardSet
from grpo.rollout import Rollout, SamplingParams, StopStrings, generate
from grpo.trackers import Trackers


@dataclass
class GenerationBatch:
    """Everything the update needs about one generation batch (N completions)."""

    rows: list[Row]  # dataset row of each completion (each prompt's row repeated G times)
    prompts: list[Any]  # prompt as given to reward functions
    completions: list[Any]  # completion as given to reward functions
    completion_texts: list[str]
    rollout: Rollout
    rewards_per_func: torch.Tensor  # [N, K], NaN = missing
    rewards: torch.Tensor  # [N] weighted total, NaN = all missing
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] completion tokens that count in the loss
    sampling_rounds: int = 1
    zero_std_groups_kept: int = 0

    def __len__(self) -> int:
        return len(self.rows)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        *,
        model=None,
        tokenizer=None,
        train_rows: list[Row] | None = None,
        eval_rows: list[Row] | None = None,
        reward_funcs: dict[str, Callable] | None = None,
    ):
        """Everything that can fail on bad input fails here, before any generation.

        `model`/`tokenizer`/`train_rows`/`reward_funcs` may be passed directly
        (Python API, tests); otherwise they come from the config.
        """
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        _check_output_dir(self.output_dir, cfg.overwrite_output_dir)
        self.device = resolve_device(cfg.training.device)
        if train_rows is None:
            train_rows, loaded_eval = load_rows(cfg.data)
            eval_rows = loaded_eval if eval_rows is None else eval_rows
        if not train_rows:
            raise ConfigError("no training rows")
        self.train_rows, self.eval_rows = train_rows, eval_rows or []
        columns = set(train_rows[0]) - {"prompt"}
        self.rewards = RewardSet.from_config(cfg.rewards, cfg.rollout.max_completion_length, columns, reward_funcs)
        e = cfg.eval
        wants_eval = e.before or e.after or e.every > 0
        if wants_eval:
            if not self.eval_rows:
                raise ConfigError(
                    "eval.before/after/every need held-out rows: set data.arithmetic.num_eval > 0 (task arithmetic) "
                    "or data.eval_file (task jsonl), or turn evaluation off"
                )
            check_answers(self.eval_rows[: e.num_problems] if e.num_problems else self.eval_rows)

        if model is None:
            model, tokenizer = load_model_and_tokenizer(cfg.model, self.device)  # prepared for the device
        else:
            model = model.to(self.device)
            prepare_for_device(model, cfg.model)
        self.model, self.tokenizer = model, tokenizer
        if cfg.training.gradient_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = True
        _sparse_tied_embedding_gradient(self.model)
        self.reference = self._frozen_copy(self.model) if cfg.algorithm.beta > 0 else None
        self.eos_token_ids, self.pad_token_id = generation_token_ids(self.model, tokenizer)
        self.stop = StopStrings(tokenizer, cfg.rollout.stop_strings) if cfg.rollout.stop_strings else None
        self.use_chat_template = cfg.data.chat_template == "auto"

        t = cfg.training
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon,
            weight_decay=t.weight_decay,
            # one kernel per tensor, no temporaries the size of the model
            fused=self.device.type in ("cpu", "cuda"),
        )
        # gradients live for the whole run and are zeroed in place (no re-allocation each step)
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        total_updates = t.max_steps * cfg.algorithm.num_iterations
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda i: algorithm.lr_multiplier(t.lr_scheduler_type, i, total_updates, t.warmup_steps),
        )
        torch.manual_seed(t.seed)
        self.generator = torch.Generator(device=self.device).manual_seed(t.seed)
        self.prompts = prompt_stream(self.train_rows, cfg.data.seed)
        self.step = 0
        self.tokens_seen = 0
        self.evaluator = (
            Evaluator(cfg, tokenizer, self.eos_token_ids, self.pad_token_id, self.eval_rows, self.rewards)
            if wants_eval
            else None
        )

    # ------------------------------------------------------------------ setup helpers

    @staticmethod
    def _frozen_copy(model):
        ref = copy.deepcopy(model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def autocast(self):
        return bf16_autocast(self.device, self.cfg.training.bf16)

    @property
    def sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k, r.ignore_eos)

    # ------------------------------------------------------------------ one step

    def generate_and_score(self, rows: list[Row]) -> GenerationBatch:
        """Rollout + rewards + advantages for a list of prompts (one group each)."""
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        _, prompt_ids = encode_prompts(
            rows, self.tokenizer, self.use_chat_template, cfg.data.few_shot, cfg.rollout.max_prompt_length
        )
        self.model.eval()
        with self.autocast():
            rollout = generate(
                self.model,
                prompt_ids,
                G,
                self.sampling,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
                generator=self.generator,
                stop=self.stop,
            )
        ids = [c[m.bool()].tolist() for c, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        group_rows = [row for row in rows for _ in range(G)]
        prompts = [row["prompt"] for row in group_rows]
        completions = [
            [{"role": "assistant", "content": text}] if is_conversational(row) else text
            for row, text in zip(group_rows, texts)
        ]
        rewards_per_func = self.rewards.score(prompts, completions, ids, group_rows)
        rewards = algorithm.combine_rewards(rewards_per_func, self.rewards.weights)
        advantages = algorithm.group_advantages(rewards, G, cfg.algorithm.scale_rewards)
        loss_mask = rollout.completion_mask.clone()
        if cfg.algorithm.mask_truncated_completions:
            loss_mask[rollout.truncated] = 0
        return GenerationBatch(
            group_rows, prompts, completions, texts, rollout, rewards_per_func, rewards, advantages, loss_mask
        )

    def collect_batch(self) -> GenerationBatch:
        """One generation batch; with dynamic sampling, only groups whose rewards differ."""
        cfg = self.cfg
        G = cfg.rollout.num_generations
        num_prompts = cfg.generation_batch_size() // G
        if not cfg.algorithm.dynamic_sampling:
            return self.generate_and_score([next(self.prompts) for _ in range(num_prompts)])
        kept: list[GenerationBatch] = []
        spare: list[GenerationBatch] = []
        rounds = 0
        while sum(len(b) for b in kept) < num_prompts * G and rounds < cfg.algorithm.max_sampling_rounds:
            rounds += 1
            batch = self.generate_and_score([next(self.prompts) for _ in range(num_prompts)])
            spread = algorithm.group_reward_std(batch.rewards, G) > 0
            for g, has_spread in enumerate(spread.tolist()):
                group = _select(batch, torch.arange(g * G, (g + 1) * G))
                (kept if has_spread else spare).append(group)
        missing = num_prompts - len(kept)
        zero_std_kept = max(0, missing)
        groups = kept[:num_prompts] + spare[: max(0, missing)]
        merged = _concat(groups, self.pad_token_id)
        # advantages are per group, except "batch" scaling which needs the final batch
        merged.advantages = algorithm.group_advantages(merged.rewards, G, cfg.algorithm.scale_rewards)
        merged.sampling_rounds, merged.zero_std_groups_kept = rounds, zero_std_kept
        return merged

    def _minibatches(self, batch: GenerationBatch) -> list[torch.Tensor]:
        """Row indices of each minibatch, similar lengths together.

        Each minibatch is padded to its longest completion, so groups are
        ordered by their longest completion (and rows within a group by
        length); groups stay together so that their shared prompt is computed
        once. grpo, dr_grpo and dapo losses do not depend on the split.
        """
        size, G = self.cfg.training.per_device_train_batch_size, self.cfg.rollout.num_generations
        lengths = batch.rollout.lengths.tolist()
        group_max = [max(lengths[g : g + G]) for g in range(0, len(lengths), G)]
        order = sorted(range(len(lengths)), key=lambda i: (group_max[i // G], i // G, lengths[i]))
        order = torch.tensor(order, dtype=torch.long)
        return [order[i : i + size] for i in range(0, len(order), size)]

    def _microbatches(self, batch: GenerationBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """Split a minibatch's rows (in `_minibatches` order) into consecutive pieces of at
        most `training.microbatch_tokens` token positions. A piece costs its distinct
        prompts' lengths (each prompt runs once per piece) plus rows x its longest
        completion (the padded width). A row that alone exceeds the budget is its own piece."""
        budget = self.cfg.training.microbatch_tokens
        if budget <= 0:
            return [rows]
        ro = batch.rollout
        prompt_lengths = ro.prompt_mask.sum(-1).tolist()
        lengths = ro.completion_mask.sum(-1).tolist()
        pieces, current, prompts, width = [], [], set(), 0
        for r in rows.tolist():
            key = tuple(ro.prompt_ids[r, -prompt_lengths[r]:].tolist()) if prompt_lengths[r] else ()
            new_prompts = prompts | {key}
            new_width = max(width, lengths[r])
            cost = sum(len(p) for p in new_prompts) + (len(current) + 1) * new_width
            if current and cost > budget:
                pieces.append(current)
                current, new_prompts, new_width = [], {key}, lengths[r]
            current.append(r)
            prompts, width = new_prompts, new_width
        pieces.append(current)
        return [torch.tensor(p, dtype=torch.long) for p in pieces]

    def _logprobs(self, model, batch: GenerationBatch, rows: torch.Tensor, grad: bool):
        ro = batch.rollout
        prompt_ids, prompt_mask = _trim_left(ro.prompt_ids[rows], ro.prompt_mask[rows])
        width = max(1, int(ro.completion_mask[rows].sum(-1).max()))
        context = contextlib.nullcontext() if grad else torch.no_grad()
        # the output layer's weight gradient goes straight into its (preallocated) .grad
        output_weight = model.get_output_embeddings().weight
        sink = output_weight.grad if grad and output_weight.requires_grad else None
        with context, self.autocast():
            return completion_logprobs(
                model,
                prompt_ids,
                prompt_mask,
                ro.completion_ids[rows, :width],
                ro.completion_mask[rows, :width],
                temperature=self.cfg.rollout.temperature,
                chunk_size=self.cfg.training.logprob_chunk_size,
                weight_grad_sink=sink,
            )

    def _logprobs_all(self, model, batch: GenerationBatch) -> torch.Tensor:
        T = batch.rollout.completion_ids.shape[1]
        out = torch.zeros(len(batch), T, device=self.device)
        for minibatch in self._minibatches(batch):
            for rows in self._microbatches(batch, minibatch):
                logp, _ = self._logprobs(model, batch, rows, grad=False)
                out[rows, : logp.shape[1]] = logp
        return out

    def _loss(self, batch: GenerationBatch, rows, old_logp, ref_logp, normalisers: dict):
        """The policy loss of one micro-batch (its share of the batch's loss), the sum of its
        tokens' entropies, and the clipping/KL statistics."""
        cfg, a = self.cfg, self.cfg.algorithm
        logp, entropy = self._logprobs(self.model, batch, rows, grad=True)
        width = logp.shape[1]
        mask = batch.loss_mask[rows, :width]
        loss, stats = algorithm.policy_loss(
            logp,
            old_logp[rows, :width] if old_logp is not None else None,
            batch.advantages[rows].to(self.device),
            mask,
            loss_type=a.loss_type,
            epsilon_low=a.epsilon,
            epsilon_high=cfg.epsilon_high,
            delta=a.delta,
            importance_sampling_level=a.importance_sampling_level,
            beta=a.beta,
            ref_logp=ref_logp[rows, :width] if ref_logp is not None else None,
            kl_estimator=a.kl_estimator,
            max_completion_length=cfg.rollout.max_completion_length,
            **normalisers,
        )
        return loss, algorithm.masked_sum(entropy, mask).item(), stats

    def update(self, batch: GenerationBatch) -> dict[str, float]:
        """num_iterations optimizer steps over the generation batch."""
        cfg, a = self.cfg, self.cfg.algorithm
        N = len(batch)
        minibatches = self._minibatches(batch)
        num_tokens = batch.loss_mask.sum().item()
        old_logp = self._logprobs_all(self.model, batch) if a.num_iterations > 1 else None
        ref_logp = self._logprobs_all(self.reference, batch) if self.reference is not None else None
        sums = {"kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "clip_region": 0.0, "entropy": 0.0, "loss": 0.0}
        grad_norms = []
        self.model.train()
        for _ in range(a.num_iterations):
            # zeroing in place keeps the gradient buffers (no re-allocation each step)
            self.optimizer.zero_grad(set_to_none=False)
            for minibatch in minibatches:
                normalisers = dict(
                    num_sequences=N, num_tokens=num_tokens, num_minibatches=len(minibatches),
                    minibatch_tokens=batch.loss_mask[minibatch].sum().item(),
                )
                for rows in self._microbatches(batch, minibatch):
                    loss, entropy_sum, stats = self._loss(batch, rows, old_logp, ref_logp, normalisers)
                    loss.backward()
                    sums["loss"] += loss.item()
                    sums["entropy"] += entropy_sum
                    for key, value in stats.items():
                        sums[key] += value.item()
            if cfg.training.max_grad_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.training.max_grad_norm)
            else:
                norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in self.model.parameters() if p.grad is not None))
            grad_norms.append(float(norm))
            self.optimizer.step()
            self.scheduler.step()
        if self.device.type == "cpu":
            release_free_memory()  # the update's freed buffers, before the next rollout allocates its own
        passes = a.num_iterations * max(1.0, num_tokens)
        out = {
            "loss": sums["loss"] / a.num_iterations,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "entropy": sums["entropy"] / passes,
            "clip_ratio/low_mean": sums["clip_low"] / passes,
            "clip_ratio/high_mean": sums["clip_high"] / passes,
            "clip_ratio/region_mean": sums["clip_region"] / passes,
        }
        if a.beta > 0:
            out["kl"] = sums["kl"] / passes
        return out

    def sync_reference(self) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref (alpha = 1 replaces it)."""
        alpha = self.cfg.algorithm.ref_sync_alpha
        with torch.no_grad():
            for ref_p, p in zip(self.reference.parameters(), self.model.parameters()):
                ref_p.mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict[str, float]]:
        cfg, e = self.cfg, self.cfg.eval
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name in RUN_LOGS:  # a fresh run (overwrite_output_dir was checked at start-up)
            (self.output_dir / name).unlink(missing_ok=True)
        config_module.save(cfg, self.output_dir / "config.yaml")
        progress = ConsoleProgress(cfg.training.max_steps, every=cfg.logging.log_every)
        trackers = Trackers.from_config(cfg)
        history: list[dict[str, float]] = []
        before = self.evaluate("before", trackers) if e.before else None
        with trackers, open(self.output_dir / "metrics.jsonl", "a") as metrics_file:
            while self.step < cfg.training.max_steps:
                metrics, batch = self.train_step()
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                trackers.log(metrics, self.step)
                history.append(metrics)
                progress.update(self.step, metrics)
                if cfg.logging.sample_every and (self.step == 1 or self.step % cfg.logging.sample_every == 0):
                    self.write_samples(batch, progress)
                if cfg.training.save_steps and self.step % cfg.training.save_steps == 0:
                    self.save(self.output_dir / f"checkpoint-{self.step}")
                if e.every and self.step % e.every == 0 and self.step < cfg.training.max_steps:
                    self.evaluate(f"step {self.step}", trackers)
            self.save(self.output_dir / "final")
            if e.after:
                after = self.evaluate("after", trackers)
                if before is not None:
                    print("\nheld-out evaluation, before and after training:\n" + format_table(before, after), flush=True)
        self.write_report()
        return history

    def train_step(self) -> tuple[dict[str, float], GenerationBatch]:
        """One GRPO step: generate and score a batch, update the policy, maybe refresh the reference."""
        t0 = time.perf_counter()
        batch = self.collect_batch()
        t1 = time.perf_counter()
        update_stats = self.update(batch)
        t2 = time.perf_counter()
        self.step += 1
        if self.cfg.algorithm.ref_sync_steps and self.step % self.cfg.algorithm.ref_sync_steps == 0:
            self.sync_reference()
        return self.step_metrics(batch, update_stats, generate_s=t1 - t0, update_s=t2 - t1), batch

    def evaluate(self, label: str, trackers: Trackers | None = None):
        """Held-out evaluation (greedy and sampled, as configured); results go to eval.jsonl."""
        if self.evaluator is None:
            raise ConfigError("evaluation needs held-out rows (data.arithmetic.num_eval > 0 or data.eval_file)")
        print(f"evaluating ({label}) on {len(self.evaluator.rows)} held-out problems...", flush=True)
        results = self.evaluator(self.model, label, self.step)
        print(format_table(results), flush=True)
        if trackers is not None:
            trackers.log({f"eval/{r.decoding}/accuracy": r.accuracy for r in results}, self.step)
        return results

    def write_report(self) -> None:
        try:
            from grpo.report import build_report

            path = build_report(self.output_dir)
            print(f"report: {path}", flush=True)
        except ImportError as err:  # matplotlib is optional
            print(f"no report written ({err})", flush=True)

    def write_samples(self, batch: GenerationBatch, progress: ConsoleProgress, per_step: int = 4) -> None:
        """A few (prompt, completion, reward) examples, one per group, to samples.jsonl and the console."""
        G = self.cfg.rollout.num_generations
        with open(self.output_dir / "samples.jsonl", "a") as f:
            for i in range(0, min(len(batch), per_step * G), G):
                prompt = batch.prompts[i]
                prompt = prompt[-1]["content"] if isinstance(prompt, list) else prompt
                record = {"step": self.step, "prompt": prompt, "completion": batch.completion_texts[i], "reward": _float(batch.rewards[i])}
                f.write(json.dumps(record) + "\n")
        progress.sample(batch.completion_texts[0], _float(batch.rewards[0]))

    def save(self, directory: Path) -> None:
        state = {"step": self.step, "generator": self.generator.get_state().tolist()}
        save_checkpoint(directory, self.model, self.tokenizer, self.optimizer, self.scheduler, state)

    def step_metrics(self, batch: GenerationBatch, update_stats: dict, generate_s: float, update_s: float) -> dict:
        tokens = int(batch.rollout.completion_mask.sum() + batch.rollout.prompt_mask.sum())
        self.tokens_seen += tokens
        return {
            "step": self.step,
            **self.batch_metrics(batch),
            **update_stats,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "num_tokens": self.tokens_seen,
            "time/step": generate_s + update_s,
            "time/generate": generate_s,
            "time/update": update_s,
            "tokens_per_second": tokens / max(generate_s + update_s, 1e-9),
        }

    def batch_metrics(self, batch: GenerationBatch) -> dict[str, float]:
        G = self.cfg.rollout.num_generations
        lengths = batch.rollout.lengths.float()
        truncated = batch.rollout.truncated
        group_std = algorithm.group_reward_std(batch.rewards, G)
        m = {
            "reward": _nanmean(batch.rewards),
            "reward_std": float(group_std.mean()),
            "frac_reward_zero_std": float((group_std == 0).float().mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(lengths[~truncated].mean()) if (~truncated).any() else 0.0,
        }
        for k, name in enumerate(self.rewards.names):
            column = batch.rewards_per_func[:, k]
            m[f"rewards/{name}/mean"] = _nanmean(column)
            m[f"rewards/{name}/std"] = float(algorithm.nan_std(column, dim=0))
            m[f"rewards/{name}/failures"] = self.rewards.failures[name]
        if self.cfg.algorithm.dynamic_sampling:
            m["sampling/rounds"] = batch.sampling_rounds
            m["sampling/zero_std_groups_kept"] = batch.zero_std_groups_kept
        return m


RUN_LOGS = ("metrics.jsonl", "samples.jsonl", "eval.jsonl")


def _check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Never write over another run's logs unless asked to."""
    if (output_dir / "metrics.jsonl").exists() and not overwrite:
        raise ConfigError(
            f"output_dir: {output_dir} already holds a run (metrics.jsonl); choose another output_dir "
            "or set overwrite_output_dir=true to replace its logs"
        )


def _sparse_tied_embedding_gradient(model) -> None:
    """Let the input embedding send a sparse gradient when it shares its weight with the output layer.

    The lookup's dense gradient is vocabulary x hidden (670 MB for Gemma-3-270M)
    and almost all zeros: only the rows of tokens in the batch are non-zero. With
    a tied output layer the weight's gradient is dense anyway, so the sparse rows
    are simply added to it; an untied embedding keeps its dense gradient, which
    AdamW needs.
    """
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    if isinstance(embedding, torch.nn.Embedding) and output is not None and embedding.weight is output.weight:
        embedding.sparse = True


def _float(x: torch.Tensor) -> float | None:
    """JSON-friendly float: NaN (missing) becomes None."""
    value = float(x)
    return None if math.isnan(value) else value


def _nanmean(x: torch.Tensor) -> float:
    present = ~torch.isnan(x)
    return float(x[present].mean()) if present.any() else math.nan


def _trim_left(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop leading columns that are padding in every row."""
    first = int((mask.sum(0) > 0).nonzero()[0]) if mask.any() else mask.shape[1] - 1
    return ids[:, first:], mask[:, first:]


def _select(batch: GenerationBatch, rows: torch.Tensor) -> GenerationBatch:
    idx = rows.tolist()
    return GenerationBatch(
        [batch.rows[i] for i in idx],
        [batch.prompts[i] for i in idx],
        [batch.completions[i] for i in idx],
        [batch.completion_texts[i] for i in idx],
        batch.rollout.select(rows),
        batch.rewards_per_func[rows],
        batch.rewards[rows],
        batch.advantages[rows],
        batch.loss_mask[rows],
    )


def _concat(parts: list[GenerationBatch], pad_token_id: int) -> GenerationBatch:
    rollout = Rollout.concat([p.rollout for p in parts], pad_token_id)
    T = rollout.completion_ids.shape[1]
    return GenerationBatch(
        [r for p in parts for r in p.rows],
        [x for p in parts for x in p.prompts],
        [x for p in parts for x in p.completions],
        [x for p in parts for x in p.completion_texts],
        rollout,
        torch.cat([p.rewards_per_func for p in parts]),
        torch.cat([p.rewards for p in parts]),
        torch.cat([p.advantages for p in parts]),
        torch.cat([torch.nn.functional.pad(p.loss_mask, (0, T - p.loss_mask.shape[1])) for p in parts]),
    )
