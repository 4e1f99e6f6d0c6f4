"""The run's parts, built from a config: where every bad input fails, before any generation.

`build_parts(cfg, ...)` claims output_dir first (grpo.training.output_dir), then builds, in
this order: the run log, the task's rows (checked), the tools and environments, the reward
set (its worker processes started: a function they cannot load fails here), the policy
(loaded, LoRA applied, prepared by the backend), the KL reference, the critic (for an
estimator that needs values), the rollout engine and the prompt encoder (every prompt checked
against the context), the optimizer and the train state, the evaluator, and the shares of
each step's groups. A start that fails gives output_dir up again. The parts come back as one
`RunParts`, which grpo.training.trainer.Trainer runs.

`model`/`tokenizer`/`train_rows`/`eval_rows`/`reward_funcs` may be passed directly (Python
API, tests); otherwise they come from the config. `restore` is a `state_dict()` of a run of
the same config, which this one continues (the model passed in then holds that run's weights).
`resume` is a checkpoint directory (grpo.run.checkpoint) to continue from: its config must
match `cfg` but for the keys a resumed run may change, and the model (given, or from the
config) is the one the run started from; the checkpoint's weights replace its own. `tools`:
functions the model may call (with rollout.tools': multi-turn rollouts, grpo.rollout.multiturn).
`environment_factory`: TRL's, a factory of environments or factories by name, in place of
rollout.environment (grpo.rollout.environments). `rollout_func`: TRL's, a rollout the user
writes, called as rollout_func(prompts, trainer) (grpo.rollout.custom).

With several environments, that every training row names one is `check_environment_rows`,
which Trainer.from_config calls at start-up (TRL's API, where TRL's trainer raises: when
train() starts).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from grpo.algorithm import needs_values
from grpo.backends import create_backend
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.health.monitor import HealthMonitor
from grpo.models.loading import context_length, load_model_and_tokenizer
from grpo.models.logprobs import sharded_by_fsdp
from grpo.models.lora import apply_lora
from grpo.registry import ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS
from grpo.rewards.reward_set import RewardSet
from grpo.rollout import SamplingParams, create_engine
from grpo.rollout.base import preflight
from grpo.run import checkpoint
from grpo.run.runlog import RunLog
from grpo.tasks import Task, load_task
from grpo.tasks.data import PromptEncoder, Row, check_columns
from grpo.tasks.scorers import AnswerScorer, RewardScorer, has_integer_answers
from grpo.training import sampling
from grpo.training.advantages import Advantages
from grpo.training.collect import Collector
from grpo.training.critic import Critic, CriticPhase
from grpo.training.evaluate import Evaluator
from grpo.training.forward import Forward, Split
from grpo.training.metrics import StepMetrics
from grpo.training.output_dir import OutputDir
from grpo.training.reference import Reference, ReferencePhase, create_reference
from grpo.training.sampling import Sampler
from grpo.training.saving import Saver
from grpo.training.scoring import Scoring
from grpo.training.source import InProcessSource, PromptDraw
from grpo.training.state import TrainState, reward_seed, trainer_state
from grpo.training.step import Phases
from grpo.training.update import PolicyUpdate, Skips, loss_settings

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    """What a run is made of, built by `build_parts`: the phases the step runs (`phases`), and
    what the loop around it reads (grpo.training.trainer): the config's schedule, the backend,
    output_dir's claim, the run log, the task, the policy and its tokenizer, the train state,
    the rewards, the reference and the critic, the step's metrics, the checkpoints' writer and
    the held-out evaluation."""

    cfg: Config
    backend: Any
    output_dir: OutputDir
    """The claim on output_dir: held from the start to the end of training."""
    resumed: checkpoint.Checkpoint | None
    """The checkpoint this run continues, or None."""
    log: RunLog
    task: Task
    model: torch.nn.Module
    """The policy, as the backend prepared it (with LoRA: the adapted transformers model)."""
    tokenizer: Any
    state: TrainState
    rewards: RewardSet
    reference: Reference
    """The KL reference (grpo.training.reference); `enabled` False when beta is 0."""
    critic: Critic | None
    """PPO's critic, for an estimator that needs values; else None."""
    environments: Any
    """The rollouts' environments (grpo.rollout.environments), or None."""
    tool_functions: list
    """The tools passed in (rollout.tools' are the engine's too)."""
    sampler: Sampler
    """The generate phase (the source's, and the evaluations' and TRL's generation step's)."""
    phases: Phases
    metrics: StepMetrics
    saver: Saver
    evaluator: Evaluator | None
    """The held-out evaluation when the config schedules one (else made on first use)."""
    health: HealthMonitor
    """The health checks across steps (grpo.health): health/* metrics, console, fail_on; continued
    from a restored state's history (saved with each checkpoint)."""
    num_prompts: int
    """Groups per step, over all ranks."""

    @property
    def source(self):
        """Where the step's completions come from (grpo.training.source)."""
        return self.phases.source

    def close(self) -> None:
        """Training is over: no reward worker process, environment's process or generator of the
        rollout source outlives it."""
        self.rewards.close()
        if self.environments is not None:
            self.environments.close()
        self.phases.source.close()

    @property
    def engine(self):
        """The rollout engine the run generates with."""
        return self.sampler.engine

    @property
    def sampling(self):
        """The training rollouts' sampling settings (grpo.rollout.SamplingParams)."""
        return self.source.params

    @property
    def episodes(self) -> list:
        """The last batch's episodes: each completion's environment (TRL's trainer.environments)."""
        return self.sampler.episodes

    @property
    def skips(self):
        """Skipped non-finite updates, in a row and in all (grpo.training.update.Skips)."""
        return self.phases.update.skips


def build_parts(
    cfg: Config,
    *,
    model=None,
    tokenizer=None,
    train_rows: list[Row] | None = None,
    eval_rows: list[Row] | None = None,
    reward_funcs: dict[str, Callable] | None = None,
    restore: dict[str, Any] | None = None,
    resume: str | Path | None = None,
    tools: list | None = None,
    environment_factory=None,
    rollout_func=None,
    check_rows: bool = False,
) -> RunParts:
    """The run's parts (see the module's docstring); every bad input fails here, output_dir
    claimed first and given up again when the start fails. `check_rows`: with several
    environments, that every training row names one (`check_environment_rows`)."""
    backend = create_backend(cfg)
    output_dir = OutputDir(cfg, backend)
    output_dir.claim()
    try:
        resumed = checkpoint.load_checkpoint(Path(resume), cfg) if resume is not None else None
        parts = _build(
            cfg,
            backend,
            output_dir,
            resumed,
            resumed.state if resumed is not None else restore,
            model=model,
            tokenizer=tokenizer,
            train_rows=train_rows,
            eval_rows=eval_rows,
            reward_funcs=reward_funcs,
            tools=list(tools or []),
            environment_factory=environment_factory,
            rollout_func=rollout_func,
        )
        if check_rows:  # the Trainer's start does (TRL's API: when train() starts)
            check_environment_rows(parts)
        return parts
    except BaseException:
        output_dir.abandon()
        raise


def _build(cfg: Config, backend, output_dir, resumed, restore, **given) -> RunParts:
    """`build_parts`' work once output_dir is claimed, in the order of the module's docstring."""
    if restore is not None:
        _check_same_world_size(restore.get("world_size", 1), backend.world_size)
    preflight(cfg)  # the engine's own checks (a generation server answers) before any loading
    run_log = RunLog(cfg, backend.is_main, resume=resumed)
    task, columns = _task_and_columns(cfg, given["train_rows"], given["eval_rows"])
    tools = sampling.configured_tools(cfg, given["tools"])
    environments = sampling.configured_environments(cfg, given["environment_factory"], tools)
    columns = _reward_columns(columns, tools, environments, given["rollout_func"])
    rewards = _rewards(cfg, backend, columns, given["reward_funcs"], restore, environments)
    _check_evaluation(cfg, task, environments)
    rewards.start()  # a reward function that its worker processes cannot load fails here
    model, tokenizer = _policy(cfg, backend, given["model"], given["tokenizer"])
    reference = create_reference(cfg.algorithm, model, restore["reference"] if restore else None)
    if resumed is not None:  # after the reference: unless saved, it is a copy of the starting model
        backend.load_weights(resumed, model)
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.algorithm.advantage_estimator)
    critic = _critic(cfg, estimator, model, restore)
    engine, prompts = _engine_and_prompts(cfg, backend, model, tokenizer, tools, environments)
    _check_prompts_fit(cfg, prompts, task, model)
    # skipped non-finite updates, in a row and in all
    skips = Skips(
        cfg.training.max_consecutive_skips, **(restore.get("skips", {}) if restore else {})
    )
    state = _train_state(cfg, backend, model, task, restore)
    sampler = sampling.Sampler(
        engine, prompts, tokenizer, model, environments, given["rollout_func"]
    )
    # its history restored (none in a checkpoint from before it was saved: the checks start afresh)
    health_state = restore.get("health") if restore else None
    health = HealthMonitor(
        cfg, is_main=backend.is_main, world_size=backend.world_size, state=health_state
    )
    ahead = restore.get("rollout_source") if restore else None  # batches generated ahead
    parts_of_phases = (rewards, reference, critic, sampler, estimator, skips, ahead)
    phases = build_phases(cfg, backend, task, model, state, *parts_of_phases)
    kept = (rewards, skips, reference, critic, health, phases.source)
    parts = RunParts(
        cfg=cfg,
        backend=backend,
        output_dir=output_dir,
        resumed=resumed,
        log=run_log,
        task=task,
        model=model,
        tokenizer=tokenizer,
        state=state,
        rewards=rewards,
        reference=reference,
        critic=critic,
        environments=environments,
        tool_functions=given["tools"],
        sampler=sampler,
        phases=phases,
        metrics=_step_metrics(cfg, backend, rewards, engine, prompts, state, phases.source),
        saver=Saver(cfg, backend, run_log.dir, model, tokenizer, state, *kept),
        evaluator=None,
        health=health,
        num_prompts=phases.collect.num_prompts,
    )
    if _wants_eval(cfg):
        parts.evaluator = evaluator_of(parts)
    return parts


def _step_metrics(cfg: Config, backend, rewards, engine, prompts, state, source) -> StepMetrics:
    """The step's metrics and the closing row's, with the settings they read."""
    a = cfg.algorithm
    return StepMetrics(
        backend,
        rewards,
        engine,
        prompts,
        state,
        cfg.rollout.num_generations,
        a.dynamic_sampling,
        num_iterations=a.num_iterations,
        samples_per_step=cfg.generation_batch_size(backend.world_size),
        log_every=cfg.logging.log_every,
        source=source,
    )


def _kept_filters(cfg: Config, engine, model) -> SamplingParams | None:
    """The run's sampling settings (their filters) when the engine's logprobs are over the
    tokens they kept only (the update adds the kept mass, grpo.models.kept_mass); None
    otherwise, and under FSDP, whose sharded weights that extra pass cannot read (said once:
    the gap stays)."""
    if not getattr(engine, "logprobs_over_kept", False):
        return None
    if sharded_by_fsdp(model):
        log.warning(
            "training.sharding=fsdp: the engine's logprobs are over the tokens top-k/top-p/min-p kept, and "
            "the kept mass that puts them on the whole vocabulary is not computed on sharded weights; the "
            "rollout/logprob_diff metrics and algorithm.rollout_correction see a gap of log(kept mass)"
        )
        return None
    return _sampling_params(cfg)


def build_phases(
    cfg: Config,
    backend,
    task,
    model,
    state,
    rewards,
    reference,
    critic,
    sampler,
    estimator,
    skips,
    restored_source=None,
) -> Phases:
    """The step's phases, each holding the settings it reads, resolved here once; the rollout
    source continued from `restored_source` (its `state_dict`) when it keeps one."""
    a, r, t = cfg.algorithm, cfg.rollout, cfg.training
    G = r.num_generations
    forward = Forward(
        backend,
        Split(t.per_device_train_batch_size, G, t.microbatch_tokens),
        r.temperature,
        t.logprob_chunk_size,
    )
    num_prompts, shard = _groups(cfg, backend)
    draw = PromptDraw(task.train_rows, state.sampler, state.generator, num_prompts, shard)
    source = _rollout_source(cfg, backend, model, state, sampler, draw, restored_source)
    progress = functools.partial(trainer_state, state, a.num_iterations, t.max_steps)
    seed = functools.partial(reward_seed, state, cfg, backend.rank)
    scoring = Scoring(rewards, G, a.mask_truncated_completions, critic is not None, progress, seed)
    collect = Collector(
        source,
        scoring,
        backend,
        num_prompts,
        shard.start,
        a.dynamic_sampling,
        a.max_sampling_rounds,
        sampler.engine.pad_token_id,
    )
    advantages = Advantages(
        estimator,
        MULTI_OBJECTIVE_AGGREGATIONS.get(a.multi_objective_aggregation),
        G,
        a.scale_rewards,
        rewards.weights,
        a.gamma,
        a.lam,
        a.whiten_advantages,
        backend,
    )
    update = PolicyUpdate(
        model,
        state.optimizer,
        state.scheduler,
        skips,
        state.entropy,
        forward,
        a,
        loss_settings(a, r.max_staleness),
        t.max_grad_norm,
        r.max_completion_length,
        r.engine,
        _kept_filters(cfg, sampler.engine, model),
    )
    critic_phase = None
    if critic is not None:
        critic_phase = CriticPhase(
            critic, forward, a.gamma, a.lam, a.value_clip, a.num_iterations, t.max_grad_norm
        )
    reference_phase = ReferencePhase(
        model, reference, forward, a.num_iterations, a.ref_sync_steps, a.ref_sync_alpha
    )
    return Phases(source, collect, reference_phase, advantages, update, critic_phase)


def _rollout_source(cfg: Config, backend, model, state, sampler, draw, restored):
    """The one place the rollout source is chosen: generation in the trainer's process (or by the
    `server` engine, step by step), or ahead of training on a server (rollout.max_staleness > 0:
    grpo.training.ahead)."""
    r, G, params = cfg.rollout, cfg.rollout.num_generations, _sampling_params(cfg)
    if not r.max_staleness:
        return InProcessSource(draw, sampler, params, G, backend, model)
    from grpo.rollout.server import ServerEngine
    from grpo.training.ahead import AheadSource

    if not isinstance(sampler.engine, ServerEngine) or sampler.rollout_func is not None:
        raise ConfigError(
            f"rollout.max_staleness={r.max_staleness}: tools, environments and a rollout_func run in the "
            "trainer's process and are not generated ahead yet; pass none of them, or set rollout.max_staleness: 0"
        )
    if restored is None and state.step > 0:
        raise ConfigError(
            f"rollout.max_staleness={r.max_staleness}: the state resumed from (step {state.step}) holds no "
            "batches generated ahead; resume from a checkpoint of this run"
        )
    return AheadSource(
        draw,
        sampler,
        params,
        G,
        model,
        max_staleness=r.max_staleness,
        sync_every=r.weight_sync_steps,
        max_steps=cfg.training.max_steps,
        request_timeout=r.server.request_timeout,
        push_timeout=r.server.weight_sync_timeout,
        step=state.step,
        restored=restored,
    )


def evaluator_of(parts: RunParts) -> Evaluator:
    """The held-out evaluation of a run: its engine (the rollout source's for the trainer's
    weights), the task's held-out rows and scorer, the run's rewards."""
    return Evaluator(
        parts.cfg,
        parts.source.evaluation_engine,
        parts.tokenizer,
        parts.task.eval_rows,
        parts.task.scorer,
        parts.rewards,
        parts.backend,
    )


def _rewards(cfg: Config, backend, columns, reward_funcs, restore, environments) -> RewardSet:
    """The reward set: the configured and given functions, and the environments' (not started)."""
    return RewardSet.from_config(
        cfg.rewards,
        cfg.rollout.max_completion_length,
        columns,
        reward_funcs,
        # saved as the run's totals over every rank: rank 0 carries them on, the others count anew
        failures=restore["reward_failures"] if restore and backend.is_main else None,
        environment_rewards=environments.reward_functions() if environments else None,
    )


def check_environment_rows(parts: RunParts) -> None:
    """With several environments, that every training row names one (a ConfigError naming
    the first that does not)."""
    if parts.environments is not None:
        parts.environments.check_rows(parts.task.train_rows, "training rows")


def _task_and_columns(cfg: Config, train_rows, eval_rows) -> tuple[Task, set[str]]:
    """The task (its rows checked: the same columns in every row, valid values) and the training
    rows' columns besides the prompt."""
    task = _task(cfg, train_rows, eval_rows)
    if not task.train_rows:
        raise ConfigError("no training rows")
    columns = check_columns(task.train_rows, "training rows") - {"prompt"}
    check_columns(task.eval_rows, "held-out rows")
    return task, columns


def _reward_columns(columns: set[str], tools: dict, environments, rollout_func) -> set[str] | None:
    """The dataset columns the reward functions may take (None: not known before the first batch);
    a rollout_func refused beside tools or environments."""
    if environments is not None:
        columns = columns | {"environments"}
    if rollout_func is not None and (tools or environments is not None):
        raise ConfigError(
            "rollout_func with tools or environments: a rollout_func runs its own loop (its tool calls "
            "too, marked by env_mask); give it alone, or drop it and use tools/environment_factory"
        )
    if rollout_func is not None:
        return None  # it may return more, known at its first batch
    return columns


def _wants_eval(cfg: Config) -> bool:
    e = cfg.eval
    return e.before or e.after or e.every > 0


def _check_evaluation(cfg: Config, task: Task, environments) -> None:
    """A scheduled evaluation needs held-out rows, and runs no environments yet."""
    if _wants_eval(cfg) and not task.eval_rows:
        raise ConfigError(
            "eval.before/after/every need held-out rows: set data.arithmetic.num_eval > 0 (task arithmetic) "
            "or data.eval_file (task jsonl), or turn evaluation off"
        )
    if _wants_eval(cfg) and environments is not None:
        raise ConfigError(
            "eval.before/after/every: the held-out accuracy evaluation does not run environments yet; turn it "
            "off (eval.before=false eval.after=false eval.every=0); TRL's group evaluation (GRPOTrainer."
            "evaluate) does run them"
        )


def _policy(cfg: Config, backend, model, tokenizer) -> tuple[torch.nn.Module, Any]:
    """The policy (given, or loaded from model.*) with its LoRA adapters, prepared by the backend."""
    if model is None:
        model, tokenizer = load_model_and_tokenizer(cfg.model, backend.device)
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        log.warning(
            "the model's config sets output_router_logits (a mixture of experts): grpo does not add the "
            "routers' load-balancing loss to the objective (TRL does), so expert use is not balanced here"
        )
    # the backend prepares the model as it will train: with its LoRA adapters (model.lora.r > 0)
    model = apply_lora(model, cfg.model.lora, cfg.training.seed)
    return backend.prepare_model(model), tokenizer


def _critic(cfg: Config, estimator, model, restore) -> Critic | None:
    """PPO's critic for an estimator that needs values (a copy of the policy's trunk, or the saved one)."""
    if not needs_values(estimator):
        return None
    a = cfg.algorithm
    return Critic(
        model, a.critic_learning_rate, cfg.training, restore.get("critic") if restore else None
    )


def _engine_and_prompts(cfg: Config, backend, model, tokenizer, tools, environments) -> tuple:
    """The rollout engine (the multi-turn one around it with tools or environments) and the
    prompt encoder (whose prompts offer the tools, as the chat template writes them)."""
    d, r = cfg.data, cfg.rollout
    template_kwargs = d.chat_template_kwargs
    if tools or environments is not None:
        engine = sampling.tool_engine(cfg, tools, model, tokenizer, backend.decoding)
        if environments is None:
            # an environment's prompts offer its own tools (grpo.training.sampling.sample)
            template_kwargs = {**(template_kwargs or {}), "tools": engine.schemas}
    else:
        engine = create_engine(r.engine, model, tokenizer, cfg, backend.decoding)
    prompts = PromptEncoder(
        tokenizer, d.chat_template == "auto", d.few_shot, r.max_prompt_length, template_kwargs
    )
    return engine, prompts


def _check_prompts_fit(cfg: Config, prompts: PromptEncoder, task: Task, model) -> None:
    """Every prompt and its longest completion within the model's context."""
    r = cfg.rollout
    prompts.check_fits(
        task.train_rows, r.max_completion_length, context_length(model), "training rows"
    )
    if _wants_eval(cfg):
        eval_length = cfg.eval.max_completion_length or r.max_completion_length
        prompts.check_fits(task.eval_rows, eval_length, context_length(model), "held-out rows")


def _train_state(cfg: Config, backend, model, task: Task, restore) -> TrainState:
    """The optimizer and the train state (the saved one's with `restore`)."""
    optimizer = backend.make_optimizer(model)
    if backend.is_main:  # before hours of training whose first save could not be written
        checkpoint.warn_if_short_of_space(Path(cfg.output_dir), checkpoint.estimated_size(model))
    return TrainState.create(
        cfg,
        optimizer,
        len(task.train_rows),
        restore=_this_ranks_state(restore["train"], backend) if restore else None,
        optimizer_state=backend.optimizer_state(model, optimizer),
    )


def _groups(cfg: Config, backend) -> tuple[int, slice]:
    """Groups per step over all ranks, and this rank's share of them (a whole number of groups
    each: config.TrainingConfig.check)."""
    world, rank = backend.world_size, backend.rank
    num_prompts = cfg.generation_batch_size(world) // cfg.rollout.num_generations
    share = num_prompts // world
    return num_prompts, slice(rank * share, (rank + 1) * share)


def _sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        r.max_completion_length,
        r.temperature,
        r.top_p,
        r.top_k,
        r.ignore_eos,
        min_p=r.min_p,
        repetition_penalty=r.repetition_penalty,
        min_new_tokens=r.min_new_tokens,
    )


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
