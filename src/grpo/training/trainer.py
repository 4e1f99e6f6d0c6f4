"""The GRPO training loop.

`Trainer.train_step` is one step: its phases in the order of GRPO's data flow, each
timed under its name in metrics.jsonl (time/<phase>; docs/architecture.md is the map):

    generate    G completions of each of the step's prompts         Trainer.sample (grpo.training.sampling)
    rewards     each completion scored; the loss mask                 Trainer.score (grpo.rewards)
    filter      DAPO: more rounds until enough groups vary            dynamic_sampling only
    reference   pi_old (num_iterations > 1) and pi_ref logprobs       update.batch_logprobs
    values      the critic's values                                   gae only
    advantages  once, over the final batch                            Trainer.advantages
    update      num_iterations optimizer passes                       update.policy_update
    critic      the critic's own passes                               gae only
    sync        the engine takes the new weights; the reference refresh

The algorithmic choices (algorithm.*, with TRL's names and defaults where TRL has them):

    advantage_estimator   grpo (reward minus its group's mean, over `scale_rewards`' std), dr_grpo
                          (no std), rloo (leave-one-out), reinforce_pp (batch-normalised), gae (critic)
    multi_objective_aggregation  sum_then_normalize (the weighted sum of the reward functions goes to
                          the estimator) or normalize_then_sum (GDPO: each function in its group first)
    policy_loss           clipped (the PPO/GRPO surrogate; `importance_sampling_level` sequence: GSPO),
                          cispo (the clipped ratio as a detached weight), sapo (a soft gate), vespo
                          (a gamma weight of the sequence ratio)
    loss_type             grpo, bnpo, dr_grpo, dapo, luspo: how per-token losses become one scalar,
                          with normalisers counted over the whole generation batch
    beta, kl_estimator    the KL penalty against the reference (beta 0: no reference model), optionally
                          weighted by the importance ratio (kl_bias_correction)
    entropy_coef          an entropy bonus, optionally with an adaptive coefficient
    off_policy_mask_threshold  drop negative-advantage sequences that drifted too far from the sampler
    num_iterations        optimizer passes per generation batch (1: pi_old is pi_theta, no extra pass)
    dynamic_sampling, mask_truncated_completions, top_entropy_quantile, rollout_correction,
    ref_sync_steps        DAPO's filter and truncation mask, the entropy mask, the correction for an
                          engine that samples differently, TR-DPO's reference refresh

The parts live in their own modules: the rollout engine (grpo.rollout), rewards
(grpo.rewards.reward_set), the math (grpo.algorithm), batching and the update
(grpo.training.batching, grpo.training.update), the reference (grpo.training.reference),
the device and processes (grpo.backends), the train state (grpo.training.state), the run
directory and console (grpo.run.runlog).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from grpo import algorithm
from grpo.backends import create_backend
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.models.loading import context_length, load_model_and_tokenizer
from grpo.models.lora import apply_lora
from grpo.registry import ADVANTAGE_ESTIMATORS
from grpo.rewards.reward_set import RewardSet
from grpo.rollout import SamplingParams, create_engine
from grpo.rollout.hf import NonFiniteProbabilities
from grpo.rollout.types import prompt_seeds
from grpo.run import checkpoint, faults, run_lock
from grpo.run.eval_results import EvalResult
from grpo.run.run_lock import RunLock
from grpo.run.runlog import RunLog
from grpo.run.stop_signals import StopSignals
from grpo.sandbox import take_counts
from grpo.tasks import Task, load_task
from grpo.tasks.data import PromptEncoder, Row, check_columns, is_conversational
from grpo.tasks.scorers import AnswerScorer, RewardScorer, has_integer_answers
from grpo.training import sampling
from grpo.training.batching import GenerationBatch, groups_with_spread, keep_groups_with_spread
from grpo.training.callbacks import Callbacks
from grpo.training.critic import Critic
from grpo.training.evaluate import Evaluator
from grpo.training.metrics import Outcome, PhaseTimer, batch_metrics, sum_counts
from grpo.training.reference import create_reference
from grpo.training.state import TrainState
from grpo.training.update import (
    Skips,
    TrainingDiverged,
    batch_logprobs,
    batch_values,
    check_finite_weights,
    critic_update,
    gae_batch_advantages,
    policy_update,
)

log = logging.getLogger(__name__)


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
        restore: dict[str, Any] | None = None,
        resume: str | Path | None = None,
        callbacks: Callbacks | list | None = None,
        eval_generations: int | None = None,
        tools: list | None = None,
        environment_factory=None,
        rollout_func=None,
        check_environment_rows: bool = True,
    ):
        """Everything that can fail on bad input fails here, before any generation.

        `model`/`tokenizer`/`train_rows`/`reward_funcs` may be passed directly
        (Python API, tests); otherwise they come from the config. `restore` is a
        `state_dict()` of a trainer of the same config, whose run this one continues
        (the model passed in then holds that trainer's weights). `resume` is a checkpoint
        directory (grpo.run.checkpoint) to continue from: its config must match `cfg` but for
        the keys a resumed run may change, and the model (given, or from the config) is the
        one the run started from; the checkpoint's weights replace its own.

        The output directory is claimed first (grpo.run.run_lock): created, checked writable and
        locked against another run, before anything in it is read or changed; a start that
        fails gives it up again, removing it if it was created here and holds nothing.

        `callbacks` (grpo.training.callbacks: a Callbacks, or a list of callback objects called
        with this config as `args`) are called at the loop's events; `eval_generations`, when
        set, adds TRL's group evaluation (grpo.training.evaluate.group_evaluation: that many
        sampled completions per held-out prompt, their rewards and loss) to every evaluation's
        `eval_...` row. `tools`: functions the model may call (with rollout.tools': multi-turn
        rollouts, grpo.rollout.multiturn). `environment_factory`: TRL's, a factory of environments
        or factories by name, in place of rollout.environment (grpo.rollout.environments).
        `rollout_func`: TRL's, a rollout the user writes, called as rollout_func(prompts, self)
        (grpo.rollout.custom). `check_environment_rows=False` leaves the check that every row
        names one of several environments to the caller (`check_environment_rows()`: TRL's API
        makes it when train() starts, where TRL's own trainer raises).
        """
        self.cfg = cfg
        self.tool_functions = list(tools or [])
        self.environment_factory = environment_factory
        self.rollout_func = rollout_func
        self._check_rows_now = check_environment_rows
        self.callbacks = (
            callbacks if isinstance(callbacks, Callbacks) else Callbacks(callbacks or (), args=cfg)
        )
        self.eval_generations = eval_generations
        self.backend = create_backend(cfg)
        self.run_lock: RunLock | None = None
        """This process's claim on output_dir (rank 0's only): held from here to the end of `train`."""
        self.claimed = False
        """Whether the run holds output_dir (on every rank)."""
        self._claim_output_dir()
        try:
            self._set_up(model, tokenizer, train_rows, eval_rows, reward_funcs, restore, resume)
        except BaseException:
            if self.run_lock is not None:
                self.run_lock.abandon()
            raise

    def _claim_output_dir(self) -> None:
        """Rank 0 claims output_dir (grpo.run.run_lock); every rank fails with its refusal, if any."""
        refusal = None
        if self.backend.is_main:
            try:
                # nothing is written into a directory that is not a run unless asked to
                run_lock.check_claimable(self.cfg.output_dir, self.cfg.overwrite_output_dir)
                self.run_lock = run_lock.claim(self.cfg.output_dir)
            except ConfigError as error:
                refusal = error
        # no rank waits on another
        said = self.backend.all_gather_object(None if refusal is None else str(refusal))[0]
        if refusal is not None:
            raise refusal
        if said is not None:
            raise ConfigError(said)
        self.claimed = True

    def _release_output_dir(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
        self.claimed = False

    def _set_up(
        self, model, tokenizer, train_rows, eval_rows, reward_funcs, restore, resume
    ) -> None:
        """`__init__`'s work once output_dir is claimed."""
        cfg = self.cfg
        self.resumed = checkpoint.load_checkpoint(Path(resume), cfg) if resume is not None else None
        if self.resumed is not None:
            restore = self.resumed.state
        if restore is not None:
            _check_same_world_size(restore.get("world_size", 1), self.backend.world_size)
        self.log = RunLog(cfg, self.backend.is_main, resume=self.resumed)
        self.stopped_by: int | None = None
        """The signal (SIGINT, SIGTERM) that stopped `train` early, after a checkpoint."""
        self.saved: Path | None = None
        """The last checkpoint this trainer wrote."""
        self.trained_steps = self.rewarded_steps = 0
        """Steps `train` ran, and those in which some completion got a reward (none: every reward call failed)."""
        self.task = _task(cfg, train_rows, eval_rows)
        if not self.task.train_rows:
            raise ConfigError("no training rows")
        columns = check_columns(self.task.train_rows, "training rows") - {"prompt"}
        check_columns(self.task.eval_rows, "held-out rows")
        tools = sampling.configured_tools(cfg, self.tool_functions)
        self.environments = sampling.configured_environments(cfg, self.environment_factory, tools)
        """The rollouts' environments (grpo.rollout.environments), or None."""
        self.episodes: list = []
        """The last batch's episodes: each completion's environment (TRL's trainer.environments)."""
        if self.environments is not None:
            if self._check_rows_now:
                self.check_environment_rows()
            columns = columns | {"environments"}
        if self.rollout_func is not None and (tools or self.environments is not None):
            raise ConfigError(
                "rollout_func with tools or environments: a rollout_func runs its own loop (its tool calls "
                "too, marked by env_mask); give it alone, or drop it and use tools/environment_factory"
            )
        if self.rollout_func is not None:
            columns = None  # it may return more, known at its first batch
        self.rewards = RewardSet.from_config(
            cfg.rewards,
            cfg.rollout.max_completion_length,
            columns,
            reward_funcs,
            # saved as the run's totals over every rank: rank 0 carries them on, the others count anew
            failures=restore["reward_failures"] if restore and self.backend.is_main else None,
            environment_rewards=self.environments.reward_functions() if self.environments else None,
        )
        e = cfg.eval
        wants_eval = e.before or e.after or e.every > 0
        if wants_eval and not self.task.eval_rows:
            raise ConfigError(
                "eval.before/after/every need held-out rows: set data.arithmetic.num_eval > 0 (task arithmetic) "
                "or data.eval_file (task jsonl), or turn evaluation off"
            )
        if wants_eval and self.environments is not None:
            raise ConfigError(
                "eval.before/after/every: the held-out accuracy evaluation does not run environments yet; turn it "
                "off (eval.before=false eval.after=false eval.every=0); TRL's group evaluation (GRPOTrainer."
                "evaluate) does run them"
            )
        self.rewards.start()  # a reward function that its worker processes cannot load fails here
        if model is None:
            model, tokenizer = load_model_and_tokenizer(cfg.model, self.backend.device)
        if getattr(getattr(model, "config", None), "output_router_logits", False):
            log.warning(
                "the model's config sets output_router_logits (a mixture of experts): grpo does not add the "
                "routers' load-balancing loss to the objective (TRL does), so expert use is not balanced here"
            )
        # the backend prepares the model as it will train: with its LoRA adapters (model.lora.r > 0)
        model = apply_lora(model, cfg.model.lora, cfg.training.seed)
        self.model, self.tokenizer = self.backend.prepare_model(model), tokenizer
        self.reference = create_reference(
            cfg.algorithm, self.model, restore["reference"] if restore else None
        )
        if (
            self.resumed is not None
        ):  # after the reference: unless saved, it is a copy of the starting model
            self.backend.load_weights(self.resumed, self.model)
        self.critic = self._critic(restore)
        d, r = cfg.data, cfg.rollout
        template_kwargs = d.chat_template_kwargs
        if tools or self.environments is not None:
            self.engine = sampling.tool_engine(
                cfg, tools, self.model, tokenizer, self.backend.decoding
            )
        if tools and self.environments is None:
            # the prompt offers the tools, as the chat template writes them (an environment's
            # prompts offer its own: Trainer.sample)
            template_kwargs = {**(template_kwargs or {}), "tools": self.engine.schemas}
        if not tools and self.environments is None:
            self.engine = create_engine(
                cfg.rollout.engine, self.model, tokenizer, cfg, self.backend.decoding
            )
        self.prompts = PromptEncoder(
            tokenizer,
            d.chat_template == "auto",
            d.few_shot,
            r.max_prompt_length,
            template_kwargs,
        )
        self.prompts.check_fits(
            self.task.train_rows,
            r.max_completion_length,
            context_length(self.model),
            "training rows",
        )
        if wants_eval:
            eval_length = e.max_completion_length or r.max_completion_length
            self.prompts.check_fits(
                self.task.eval_rows, eval_length, context_length(self.model), "held-out rows"
            )
        skips = restore.get("skips", {}) if restore else {}
        # skipped non-finite updates, in a row and in all
        self.skips = Skips(cfg.training.max_consecutive_skips, **skips)
        optimizer = self.backend.make_optimizer(self.model)
        if self.backend.is_main:  # before hours of training whose first save could not be written
            checkpoint.warn_if_short_of_space(
                Path(cfg.output_dir), checkpoint.estimated_size(self.model)
            )
        self.state = TrainState.create(
            cfg,
            optimizer,
            len(self.task.train_rows),
            restore=_this_ranks_state(restore["train"], self.backend) if restore else None,
            optimizer_state=self.backend.optimizer_state(self.model, optimizer),
        )
        self.evaluator = (
            Evaluator(
                cfg,
                self.engine,
                tokenizer,
                self.task.eval_rows,
                self.task.scorer,
                self.rewards,
                self.backend,
            )
            if wants_eval
            else None
        )
        world, rank = self.backend.world_size, self.backend.rank
        self.num_prompts = cfg.generation_batch_size(world) // cfg.rollout.num_generations
        """Groups per step, over all ranks."""
        # a whole number of groups each (config.TrainingConfig.check)
        share = self.num_prompts // world
        self.shard = slice(rank * share, (rank + 1) * share)
        """This rank's groups of each round: every rank draws the same prompts and seeds, and keeps these."""
        r = cfg.rollout
        self.sampling = SamplingParams(
            r.max_completion_length,
            r.temperature,
            r.top_p,
            r.top_k,
            r.ignore_eos,
            min_p=r.min_p,
            repetition_penalty=r.repetition_penalty,
            min_new_tokens=r.min_new_tokens,
        )
        from grpo.health.monitor import HealthMonitor  # the health checks' state across steps

        self.health = HealthMonitor(
            cfg, is_main=self.backend.is_main, world_size=self.backend.world_size
        )
        self._set_up_callbacks()

    def _set_up_callbacks(self) -> None:
        """The callbacks' state in TRL's units, the objects they are given, then on_init_end."""
        cfg, mu, s = self.cfg, self.cfg.algorithm.num_iterations, self.callbacks.state
        s.max_steps = cfg.training.max_steps * mu
        s.logging_steps = cfg.logging.log_every * mu
        s.eval_steps = cfg.eval.every * mu
        s.save_steps = cfg.training.save_steps * mu
        s.train_batch_size = cfg.training.per_device_train_batch_size
        s.num_train_epochs = math.ceil(
            cfg.training.max_steps * self.num_prompts / len(self.task.train_rows)
        )
        s.is_world_process_zero = s.is_local_process_zero = self.backend.is_main
        self._sync_run_state()
        self.callbacks.objects.update(
            model=self.model,
            processing_class=self.tokenizer,
            optimizer=self.state.optimizer,
            lr_scheduler=self.state.scheduler,
        )
        if not self.callbacks.init_ended:
            self.callbacks.init_ended = True
            self.callbacks.fire("on_init_end")

    def _sync_run_state(self) -> None:
        """The callbacks' view of where training is (TRL's units)."""
        s, state = self.callbacks.state, self.trainer_state()
        s.global_step, s.epoch = state.global_step, state.epoch
        s.num_input_tokens_seen = self.state.tokens_seen

    # ------------------------------------------------------------------ one step

    def train_step(self) -> tuple[dict[str, float], GenerationBatch]:
        """One GRPO step; returns its metrics and its generation batch."""
        a, timer = self.cfg.algorithm, PhaseTimer()
        take_counts()  # the step's sandbox and reward-failure counts are its own, not those of
        self.rewards.step_failures()  # the set-up's checks or an evaluation between steps
        self.rewards.take_logged_metrics()  # and so is what its reward functions log
        take_tool_counts = getattr(self.engine, "take_counts", None)
        if take_tool_counts is not None:  # and so are its tool calls: an evaluation's are not its
            take_tool_counts()
        # generate -> rewards (-> filter: dynamic sampling's rounds)
        batch = self.collect_batch(timer)
        faults.reached("step")
        self.engine.sleep()  # the engine's memory (vLLM's weights and KV cache on CUDA) is the update's now
        # reference -> (values) -> advantages -> update (-> critic)
        stats = self.update(batch, timer)
        with timer("sync"):
            # the new weights, into an engine woken by it if asleep
            self.engine.sync_weights(self.model)
            self.state.step += 1
            if a.ref_sync_steps and self.state.step % a.ref_sync_steps == 0:
                self.reference.sync(self.model, a.ref_sync_alpha)
        return self.step_metrics(batch, stats, timer), batch

    def collect_batch(self, timer: PhaseTimer | None = None) -> GenerationBatch:
        """A scored generation batch: the next prompts' rollouts and rewards; with dynamic
        sampling (DAPO), more rounds until enough groups have reward spread."""
        a, G, timer = self.cfg.algorithm, self.cfg.rollout.num_generations, timer or PhaseTimer()
        rounds: list[GenerationBatch] = []
        while not rounds or (
            a.dynamic_sampling
            and self.backend.sum(sum(int(groups_with_spread(b, G).sum()) for b in rounds))
            < self.num_prompts
            and len(rounds) < a.max_sampling_rounds
        ):
            rows = self.state.sampler.take(self.task.train_rows, self.num_prompts)[self.shard]
            seeds = prompt_seeds(self.state.generator, self.num_prompts)[self.shard]
            with timer("generate"), self.backend.generation(self.model):
                try:
                    rollout, context = self.sample(rows, G, self.sampling, seeds)
                except (
                    NonFiniteProbabilities
                ) as error:  # e.g. a learning rate so high the weights blew up
                    raise TrainingDiverged(
                        f"generation at step {self.state.step}: {error}"
                    ) from error
            with timer("rewards"):
                rounds.append(self.score(rows, rollout, **context))
        if not a.dynamic_sampling:
            return rounds[0]
        with timer("filter"):
            # every rank's flags, so that the groups kept are those one process would keep
            spread = [
                [
                    flag
                    for flags in self.backend.all_gather_object(groups_with_spread(b, G).tolist())
                    for flag in flags
                ]
                for b in rounds
            ]
            batch = keep_groups_with_spread(
                rounds, self.num_prompts, G, self.engine.pad_token_id, spread, self.shard.start
            )
        return batch

    def update(self, batch: GenerationBatch, timer: PhaseTimer | None = None) -> dict[str, float]:
        """Old and reference logprobs, (with a critic: its values), the batch's advantages, then
        num_iterations optimizer passes over `batch` (with a critic: its own passes after)."""
        cfg, timer = self.cfg, timer or PhaseTimer()
        with timer("reference"):
            old_logp = (
                batch_logprobs(self.model, batch, cfg, self.backend)
                if cfg.algorithm.num_iterations > 1
                else None
            )
            ref_logp = None
            if self.reference.enabled:
                with self.reference.module() as reference:
                    ref_logp = batch_logprobs(reference, batch, cfg, self.backend)
        old_values = None
        if self.critic is not None:
            with timer("values"):
                old_values = batch_values(self.critic.model, batch, cfg, self.backend)
        with timer("advantages"):
            batch.advantages, returns = self.advantages(batch, old_values)
        with timer("update"):
            s = self.state
            stats = policy_update(
                self.model,
                s.optimizer,
                s.scheduler,
                batch,
                old_logp,
                ref_logp,
                cfg,
                self.backend,
                self.skips,
                s.entropy,
            )
        if self.critic is not None:
            with timer("critic"):
                stats.update(
                    critic_update(self.critic, batch, old_values, returns, cfg, self.backend)
                )
        return stats

    def encode(self, rows: list[Row]) -> list[list[int]]:
        return self.prompts(rows)

    def sample(self, rows: list[Row], G: int, params: SamplingParams, seeds) -> tuple:
        """G completions of each row's prompt: the rollout, and what `score` needs beside it
        (keyword arguments; grpo.training.sampling.sample)."""
        rollout, context = sampling.sample(
            rows,
            G,
            params,
            seeds,
            engine=self.engine,
            prompts=self.prompts,
            environments=self.environments,
            rollout_func=self.rollout_func,
            caller=self,
            model=self.model,
        )
        self.episodes = context.get("episodes", self.episodes)
        return rollout, context

    def advantages(
        self, batch: GenerationBatch, values: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's advantages, computed once over its final batch, and the returns the critic
        learns from (gae only, else None). The registered estimator (algorithm.advantage_estimator)
        sees every rank's rewards (whole groups each), so that "batch" scaling and the batch-wide
        estimators see the global batch; `gae` is per token, from the critic's `values`."""
        a = self.cfg.algorithm
        if self.critic is not None:
            return gae_batch_advantages(batch, values, self.cfg, self.backend)
        # GDPO: each reward function normalised in its group, then the weighted sum
        if a.multi_objective_aggregation == "normalize_then_sum":
            everyone, mine = self.backend.gather_rows(batch.rewards_per_func)
            weights, G = self.rewards.weights, self.cfg.rollout.num_generations
            return algorithm.normalize_then_sum_advantages(everyone, weights, G)[mine], None
        estimator = ADVANTAGE_ESTIMATORS.get(a.advantage_estimator)
        everyone, mine = self.backend.gather_rows(batch.rewards)
        return estimator(everyone, self.cfg.rollout.num_generations, scale_rewards=a.scale_rewards)[
            mine
        ], None

    def _critic(self, restore: dict[str, Any] | None) -> Critic | None:
        """PPO's critic for the `gae` estimator (a copy of the policy's trunk, or the saved one)."""
        a = self.cfg.algorithm
        if a.advantage_estimator != "gae":
            return None
        return Critic(
            self.model,
            a.critic_learning_rate,
            self.cfg.training,
            restore.get("critic") if restore else None,
        )

    def score(
        self,
        rows: list[Row],
        rollout,
        num_generations: int | None = None,
        episodes=None,
        columns: dict[str, list] | None = None,
    ) -> GenerationBatch:
        """The rewards of a rollout of `rows` (one group of G per row, G = `num_generations` or
        rollout.num_generations), and the tokens the loss counts. `episodes` (Trainer.sample):
        each completion's environment; its prompt is the row's with the environment's observation,
        and the reward functions get the environments. `columns`: values per completion a
        rollout_func returned, given to the reward functions as dataset columns are."""
        G = num_generations or self.cfg.rollout.num_generations
        ids = [
            c[m.bool()].tolist()
            for c, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())
        ]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        group_rows = [row for row in rows for _ in range(G)]
        environments = None
        if episodes is not None:
            from grpo.rollout.environments import with_observation

            group_rows = [with_observation(r, e.observation) for r, e in zip(group_rows, episodes)]
            environments = [e.environment for e in episodes]
        if columns:
            group_rows = [
                {**row, **{key: values[i] for key, values in columns.items()}}
                for i, row in enumerate(group_rows)
            ]
        prompts = [row["prompt"] for row in group_rows]
        # with tools, a conversational row's completion is its turns and tool results, as in TRL
        messages = rollout.messages or [None] * len(texts)
        completions = [
            (turns or [{"role": "assistant", "content": text}]) if is_conversational(row) else text
            for row, text, turns in zip(group_rows, texts, messages)
        ]
        rewards_per_func = self.rewards.score(
            prompts, completions, ids, group_rows, self.trainer_state(), environments
        )
        rewards = algorithm.combine_rewards(rewards_per_func, self.rewards.weights)
        loss_mask = rollout.completion_mask.clone()
        if rollout.tool_mask is not None:  # tool results were not sampled: no loss on them
            loss_mask = loss_mask * (1 - rollout.tool_mask.to(loss_mask.device))
        if self.cfg.algorithm.mask_truncated_completions:
            loss_mask[rollout.truncated] = 0
        # gae: a completion without a reward (every function failed) leaves the loss
        if self.critic is not None:
            loss_mask[~torch.isfinite(rewards).to(loss_mask.device)] = 0
        return GenerationBatch(
            group_rows,
            prompts,
            completions,
            texts,
            rollout,
            rewards_per_func,
            rewards,
            loss_mask,
            # the columns its reward functions logged (log_extra), for the completions table
            extra_columns=self.rewards.last_extra,
        )

    def _tool_metrics(self) -> dict[str, float]:
        """The tools' metrics since the last step (grpo.rollout.tools.tool_metrics), over every rank;
        none without tools."""
        take = getattr(self.engine, "take_counts", None)
        if take is None:
            return {}
        from grpo.rollout.tools import tool_metrics

        return tool_metrics(sum_counts(self.backend.all_gather_object(take())))

    def trainer_state(self) -> SimpleNamespace:
        """What TRL passes reward functions as `trainer_state`, under its attribute names: optimizer
        steps (a grpo step is num_iterations of them) and the fractional epoch. A SimpleNamespace,
        so it pickles to reward functions in worker processes."""
        mu, sampler = self.cfg.algorithm.num_iterations, self.state.sampler
        return SimpleNamespace(
            global_step=self.state.step * mu,
            max_steps=self.cfg.training.max_steps * mu,
            epoch=sampler.epoch + sampler.position / sampler.num_rows,
        )

    def step_metrics(
        self, batch: GenerationBatch, update_stats: dict, timer: PhaseTimer
    ) -> dict[str, float]:
        """The step's metrics over every rank (the update's come reduced already); the phases'
        times are this rank's."""
        ro, b = batch.rollout, self.backend
        tokens = int(b.sum(int(ro.completion_mask.sum() + ro.prompt_mask.sum())))
        self.state.tokens_seen += tokens
        r = self.rewards
        logged = _mean_over_ranks(b.all_gather_object(r.take_logged_metrics()))
        tools = self._tool_metrics()
        # the counts of every rank: the run's reward failures, the step's, the sandbox's, truncated prompts
        failures, step_failures, sandbox, truncated = (
            sum_counts(parts)
            for parts in zip(
                *b.all_gather_object(
                    (
                        dict(r.failures),
                        r.step_failures(),
                        take_counts(),
                        {"prompts": self.prompts.take_truncated()},
                    )
                )
            )
        )
        metrics = {
            "step": self.state.step,
            **batch_metrics(
                Outcome.of(batch, b),
                self.cfg.rollout.num_generations,
                r.names,
                failures,
                self.cfg.algorithm.dynamic_sampling,
                step_failures,
                sandbox,
            ),
            **update_stats,
            "prompts/truncated": truncated["prompts"],
            **tools,
            "learning_rate": self.state.scheduler.get_last_lr()[0],
            "num_tokens": self.state.tokens_seen,
            **timer.metrics(tokens),
        }
        # what the reward functions logged (log_metric); a name of grpo's own metrics keeps grpo's
        return {**metrics, **{name: v for name, v in logged.items() if name not in metrics}}

    def check_environment_rows(self) -> None:
        """With several environments, that every training row names one (a ConfigError naming
        the first that does not)."""
        if self.environments is not None:
            self.environments.check_rows(self.task.train_rows, "training rows")

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict[str, float]]:
        """The loop to max_steps, then final/. SIGINT or SIGTERM stops it at the next step's end
        with a checkpoint (`stopped_by` says which); a second one stops it at once (Interrupted).
        output_dir is this run's until it returns (grpo.run.run_lock); a checkpoint the disk cannot
        take ends it with checkpoint.SaveFailed."""
        if not self.claimed:  # trained before: claimed again
            self._claim_output_dir()
        try:
            return self._train()
        finally:
            self._release_output_dir()  # the run is over (the report written): the directory is free

    def _train(self) -> list[dict[str, float]]:
        cfg, log, callbacks = self.cfg, self.log, self.callbacks
        history: list[dict[str, float]] = []
        started = time.monotonic()
        first_step = self.state.step
        log.start()
        try:
            with StopSignals() as stop:
                self._sync_run_state()
                callbacks.fire("on_train_begin")
                # a resumed run's "before" evaluation was made by the run it continues (eval.jsonl keeps it)
                before = (
                    self._evaluate_and_log("before")
                    if cfg.eval.before and self.resumed is None
                    else None
                )
                log.start_training(self.state.step)
                epoch = self.state.sampler.epoch
                callbacks.fire("on_epoch_begin")
                signum = None
                # asked again after each step's checkpoint: a signal during the save stops the loop there
                while (
                    self.state.step < cfg.training.max_steps
                    and not callbacks.control.should_training_stop
                    and not (signum := self._stop_signal(stop))
                ):
                    callbacks.fire("on_step_begin")
                    try:
                        metrics, batch = self.train_step()
                    except TrainingDiverged as error:
                        raise TrainingDiverged(f"{error}; {self._save_last_good()}") from error
                    self.trained_steps += 1
                    self.rewarded_steps += math.isfinite(metrics["reward"])
                    # health/* into this step's row; a health.fail_on check stops the loop after it, saved
                    metrics.update(
                        self.health.observe(metrics, callbacks.state.log_history, callbacks.control)
                    )
                    log.step(metrics)
                    history.append(metrics)
                    step = self.state.step
                    self._sync_run_state()
                    control = callbacks.fire("on_step_end")
                    self._log_row(metrics)
                    if cfg.logging.sample_every and (
                        step == 1 or step % cfg.logging.sample_every == 0
                    ):
                        self._log_samples(step, batch)
                    if (
                        cfg.eval.every
                        and step % cfg.eval.every == 0
                        and step < cfg.training.max_steps
                    ) or control.should_evaluate:
                        self._evaluate_and_log(f"step {step}")
                    faults.reached("logged")
                    # under torchrun a collective: asked where it decides
                    signum = self._stop_signal(stop)
                    # last, so that a checkpoint's step has all its logs: resuming cuts them back to it
                    if (
                        (cfg.training.save_steps and step % cfg.training.save_steps == 0)
                        or signum
                        or callbacks.control.should_save
                    ):
                        self.save(log.dir / f"checkpoint-{step}")
                        if self.backend.is_main:
                            checkpoint.prune(log.dir, cfg.training.save_total_limit)
                        callbacks.fire("on_save")
                    if self.state.sampler.epoch != epoch:  # the prompt order went round
                        epoch = self.state.sampler.epoch
                        callbacks.fire("on_epoch_end")
                        if not signum and self.state.step < cfg.training.max_steps:
                            callbacks.fire("on_epoch_begin")
                if signum:
                    self.stopped_by = signum
                    return history
                self._save_final()
                callbacks.fire("on_save")
                signum = self._stop_signal(stop)
                if signum:  # came during the save: the evaluation after is left to a resumed run
                    self.stopped_by = signum
                    return history
                if cfg.eval.after:
                    after = self._evaluate_and_log("after")
                    if before is not None:
                        log.before_after(before, after)
                if self.state.sampler.epoch == epoch:  # the epoch under way ends with training
                    callbacks.fire("on_epoch_end")
                self._log_row(self._summary(history, time.monotonic() - started, first_step))
                callbacks.fire("on_train_end")
        finally:
            self.rewards.close()  # no reward worker process outlives training
            if self.environments is not None:
                self.environments.close()  # nor a process an environment started
            log.close()
        log.report()
        return history

    def _log_row(self, row: dict[str, Any]) -> None:
        """A row of the callbacks' log_history (TRL's: its `step` in optimizer steps, and `epoch`),
        then on_log."""
        s = self.callbacks.state
        logs = {**{k: v for k, v in row.items() if k != "step"}, "epoch": s.epoch}
        s.log_history.append({**logs, "step": s.global_step})
        self.callbacks.fire("on_log", logs=logs)

    def _summary(self, history: list[dict], runtime: float, first_step: int) -> dict[str, Any]:
        """transformers' closing row: train_loss (the mean of the steps' losses), the speeds over this
        train() call's optimizer steps, total_flos (not counted by grpo: always 0); and, as TRL's
        does, the mean of each metric over the steps since the last logging_steps boundary (none
        when the last step is on one)."""
        mu = self.cfg.algorithm.num_iterations
        steps = (self.state.step - first_step) * mu
        losses = [r["loss"] for r in history if math.isfinite(r.get("loss", math.nan))]
        row: dict[str, Any] = {}
        every = self.cfg.logging.log_every
        if every and history and history[-1]["step"] % every:
            since = [r for r in history if r["step"] > history[-1]["step"] // every * every]
            for key in since[0]:
                values = [
                    r[key]
                    for r in since
                    if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
                ]
                if key != "step":
                    row[key] = sum(values) / len(values) if values else None
        runtime = max(runtime, 1e-9)
        return {
            **row,
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(
                steps * self.cfg.generation_batch_size(self.backend.world_size) / runtime, 3
            ),
            "train_steps_per_second": round(steps / runtime, 3),
            "total_flos": 0.0,
            "train_loss": sum(losses) / len(losses) if losses else 0.0,
        }

    def _evaluate_and_log(self, label: str) -> list[EvalResult]:
        """`evaluate(label)`, and its `eval_...` row for the callbacks (log_history, on_evaluate):
        each decoding's accuracy and mean reward, with TRL's group evaluation when
        `eval_generations` is set."""
        results = self.evaluate(label)
        metrics = eval_metrics(results)
        if self.eval_generations:
            from grpo.training.evaluate import group_evaluation

            metrics.update(
                {
                    f"eval_{k}": v
                    for k, v in group_evaluation(
                        self, self.task.eval_rows, self.eval_generations
                    ).items()
                }
            )
        self._sync_run_state()
        self._log_row(metrics)  # then on_evaluate, as transformers' evaluate does
        self.callbacks.fire("on_evaluate", metrics=metrics)
        return results

    def _log_samples(self, step: int, batch: GenerationBatch) -> None:
        """A few of the step's completions (from every rank's groups, in rank order) to samples.jsonl."""
        names = self.rewards.names
        texts = batch.completion_texts
        if batch.rollout.tool_mask is not None:  # the tool results set apart
            from grpo.rollout.multiturn import marked_texts

            texts = marked_texts(self.tokenizer, batch.rollout)
        parts = self.backend.all_gather_object(
            (
                batch.prompts,
                texts,
                batch.rewards.tolist(),
                batch.rewards_per_func.T.tolist(),
                batch.extra_columns,
            )
        )
        prompts, texts, rewards = ([x for part in parts for x in part[k]] for k in range(3))
        columns = {name: [x for part in parts for x in part[3][k]] for k, name in enumerate(names)}
        extra = {}  # log_extra's columns, None for the completions of a rank that logged none
        for column in dict.fromkeys(c for part in parts for c in part[4]):
            extra[column] = [
                x for part in parts for x in part[4].get(column, [None] * len(part[0]))
            ]
        self.log.samples(
            step,
            prompts,
            texts,
            rewards,
            self.cfg.rollout.num_generations,
            reward_columns=columns,
            extra_columns=extra,
        )

    def _stop_signal(self, stop: StopSignals) -> int | None:
        """The signal that stops the run, if any rank has had one: every rank stops after the same step."""
        return max(s or 0 for s in self.backend.all_gather_object(stop.signum)) or None

    def evaluate(self, label: str) -> list[EvalResult]:
        """Held-out evaluation (greedy and sampled, as configured); results go to eval.jsonl."""
        if self.evaluator is None and self.task.eval_rows:  # asked for outside the schedule
            self.evaluator = Evaluator(
                self.cfg,
                self.engine,
                self.tokenizer,
                self.task.eval_rows,
                self.task.scorer,
                self.rewards,
                self.backend,
            )
        if self.evaluator is None:
            raise ConfigError(
                "evaluation needs held-out rows (data.arithmetic.num_eval > 0 or data.eval_file)"
            )
        ev, step = self.evaluator, self.state.step
        with self.backend.generation(self.model):
            return self.log.evaluation(
                label,
                step,
                len(ev.rows),
                ev.num_batches,
                lambda progress: ev(label, step, progress),
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything besides the policy's weights that continues this run exactly (`restore=`)."""
        train = self.state.state_dict()
        if (
            self.backend.world_size > 1
        ):  # each rank's own random streams (dropout, reward functions' draws)
            train["rng"] = {"per_rank": self.backend.all_gather_object(train["rng"])}
        return {
            "world_size": self.backend.world_size,
            "train": train,
            "reward_failures": sum_counts(
                self.backend.all_gather_object(dict(self.rewards.failures))
            ),
            "skips": {"consecutive": self.skips.consecutive, "total": self.skips.total},
            "reference": self.reference.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
        }

    def _save_last_good(self) -> str:
        """After a divergence: a checkpoint of the state before the failed step, if its weights are
        still finite (skipped updates leave them as they were); what was done, for the message."""
        directory = self.log.dir / f"checkpoint-{self.state.step}"
        try:
            self.save(directory)
        except TrainingDiverged:
            return "the weights are no longer finite, so nothing was saved; the latest checkpoint holds the last good state"
        return f"the last good state is saved in {directory} (resume from it with --resume after changing the cause)"

    def _save_final(self) -> Path:
        """final/: when this step's checkpoint was just written (save_steps divides max_steps), the
        same files under a second name (checkpoint.link_checkpoint: nothing written twice); else a
        checkpoint of its own."""
        final = self.log.dir / checkpoint.FINAL
        latest = self.log.dir / f"checkpoint-{self.state.step}"
        if self.saved == latest:
            linked = self.backend.is_main and checkpoint.link_checkpoint(latest, final) is not None
            if self.backend.all_gather_object(linked)[0]:  # rank 0's answer, for every rank
                self.saved = final
                return final
        return self.save(final)

    def save(self, directory: Path) -> Path:
        """A checkpoint (grpo.run.checkpoint) of this step, to resume from or load with from_pretrained
        (with LoRA: the adapter only, for PeftModel.from_pretrained or `grpo export --merge`)."""
        # a checkpoint with NaN weights is never written
        check_finite_weights(self.model, f"write {directory}")
        state = self.state_dict()  # on every rank: it gathers what each rank holds
        a = self.cfg.algorithm
        if not (a.ref_sync_steps and self.state.step >= a.ref_sync_steps):
            state["reference"] = (
                None  # still a copy of the starting model, which a resumed run copies again
            )
        model = self.backend.savable_model(self.model)  # FSDP: gathered whole on rank 0
        failed = None
        if self.backend.is_main:  # the ranks' weights are the same: rank 0 writes them
            try:
                checkpoint.save_checkpoint(
                    directory, model, self.tokenizer, state, self.cfg, step=self.state.step
                )
            except (
                checkpoint.SaveFailed
            ) as error:  # a full disk: the run ends, its earlier checkpoints intact
                failed = error
        # also the barrier: no rank goes on (or resumes) before the checkpoint is whole, and every
        # rank ends with rank 0's failure
        said = self.backend.all_gather_object(None if failed is None else str(failed))[0]
        if failed is not None:
            raise failed
        if said is not None:
            raise checkpoint.SaveFailed(said)
        self.saved = directory
        return self.saved


def _mean_over_ranks(parts: list[dict[str, float]]) -> dict[str, float]:
    """Each name's mean over the ranks that logged it."""
    names = dict.fromkeys(name for part in parts for name in part)
    return {
        name: sum(p[name] for p in parts if name in p) / sum(name in p for p in parts)
        for name in names
    }


def eval_metrics(results: list[EvalResult], prefix: str = "eval") -> dict[str, float]:
    """An evaluation's results as flat metrics: `{prefix}_{decoding}/accuracy` and `/mean_reward`
    for each decoding ("greedy", "temperature 1", ...)."""
    metrics = {}
    for r in results:
        metrics[f"{prefix}_{r.decoding}/accuracy"] = r.accuracy
        metrics[f"{prefix}_{r.decoding}/mean_reward"] = r.mean_reward
    return metrics


def _check_same_world_size(saved: int, now: int) -> None:
    """A run continues on as many processes as it ran on: the global batch is per_device_train_batch_size
    x gradient_accumulation_steps x world size, and a resumed run's config cannot change."""
    if saved != now:
        how = (
            "as one process (`grpo train CONFIG --resume`)"
            if saved == 1
            else f"on {saved} processes in all (e.g. `torchrun --nproc_per_node {saved} -m grpo train CONFIG --resume`)"
        )
        raise ConfigError(
            f"the run being resumed ran on {saved} process(es), this one has {now}: its global batch "
            f"(training.per_device_train_batch_size x gradient_accumulation_steps x world size) would change; resume it {how}"
        )


def _this_ranks_state(train: dict[str, Any], backend) -> dict[str, Any]:
    """A saved train state with this rank's own random streams (a run resumes on as many ranks)."""
    rng = train["rng"]
    return {**train, "rng": rng["per_rank"][backend.rank] if "per_rank" in rng else rng}


def _task(cfg: Config, train_rows: list[Row] | None, eval_rows: list[Row] | None) -> Task:
    """The configured task, or rows given directly (scored by answer when every held-out row has one)."""
    if train_rows is None:
        task = load_task(cfg)
        return (
            task if eval_rows is None else Task(task.name, task.train_rows, eval_rows, task.scorer)
        )
    eval_rows = eval_rows or []
    scorer = AnswerScorer() if has_integer_answers(eval_rows) else RewardScorer()
    return Task("rows", train_rows, eval_rows, scorer)
