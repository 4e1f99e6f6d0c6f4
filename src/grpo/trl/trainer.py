"""TRL's `GRPOTrainer` on top of grpo's one trainer.

A TRL script runs here by changing its import to `from grpo import GRPOConfig,
GRPOTrainer`. `GRPOTrainer` turns TRL's arguments (model object or name, reward
callables or model ids, a datasets.Dataset, IterableDataset or rows, a peft
LoraConfig; grpo.trl.rows, .rewards, .lora, .arguments) into
`grpo.training.trainer.Trainer`'s, builds that Trainer (`_build_trainer`) and
delegates to it, with TRL's attributes over it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.trl.arguments import check_arguments, default_args, policy_tokenizer, tool_functions
from grpo.trl.config import GRPOConfig, warn_length_weighted_sequences
from grpo.trl.generation import trl_generation
from grpo.trl.lora import model_and_lora_keys
from grpo.trl.rewards import (
    processing_classes,
    reward_functions,
    reward_specs,
    script_rewards_in_threads,
)
from grpo.trl.rows import (
    config_and_train_rows,
    environment_owned_rows,
    eval_rows_of,
    held_out_rows,
    is_dataset_dict,
)

if TYPE_CHECKING:
    import torch


class GRPOTrainer:
    """TRL's GRPOTrainer arguments, trained by grpo.training.trainer.Trainer.

    `model`: a model object (then `processing_class` is its tokenizer, or is loaded from the
    model's `name_or_path`) or a name or path for grpo's loader. `reward_funcs`: a callable,
    a grpo reward name, a reward model's id or path, or a list of them. `train_dataset`: a
    datasets.Dataset or IterableDataset, a list of row dicts or a .jsonl path, with a `prompt`
    column (text or chat messages) and any columns the reward functions take; reward
    functions also get `trainer_state` (global_step, max_steps, epoch), as in TRL.
    `peft_config`: a peft.LoraConfig, trained as grpo's LoRA (model.lora).

    An IterableDataset is read up front, as far as one run goes: its first max_steps x
    prompts-per-step rows (max_steps is then required, as in TRL), drawn in a shuffled order
    like a Dataset's; a stream that ends sooner is gone through again, epoch after epoch,
    and an empty one is an error. A held-out IterableDataset is read to eval.num_problems
    rows (grpo_overrides), or whole up to EVAL_STREAM_LIMIT rows."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_func=None,
        **unknown,
    ):
        check_arguments(unknown, optimizers, reward_funcs, environment_factory)
        if args is None:
            args = default_args(model)
        if train_dataset is None:
            train_dataset = environment_owned_rows(environment_factory, args)
        self.args = args
        model, keys, self._peft_model = model_and_lora_keys(model, peft_config)
        reward_funcs = [] if reward_funcs is None else reward_funcs
        keys = {**(keys or {}), "rewards.funcs": reward_specs(reward_funcs)}
        # an environment sets each task: rows without a prompt get TRL's default before the check
        self.config, train_rows = config_and_train_rows(
            self.args, train_dataset, keys, default_prompt=environment_factory is not None
        )
        self.eval_dataset = eval_dataset
        """The held-out data as passed: one dataset, or a dict (or DatasetDict) of named ones."""
        eval_rows = held_out_rows(eval_dataset, self.config)
        model, processing_class = self._policy_and_tokenizer(model, processing_class)
        self._reward_funcs = reward_functions(reward_funcs, reward_processing_classes, self.config)
        """The reward functions passed, by name (those of environments are added by the Trainer)."""
        self.rollout_func = rollout_func
        """TRL's attribute: the rollout_func passed, or None; the one here is what rollouts call."""
        self.reward_processing_classes = processing_classes(
            reward_processing_classes, len(self._reward_funcs)
        )
        """One per reward function, as TRL keeps them (None where the function needs none or a
        reward model uses its own tokenizer)."""
        script_rewards_in_threads(self._reward_funcs, self.config, self.args.grpo_overrides)
        warn_length_weighted_sequences(self.args)
        self._set_up_callbacks(callbacks)
        self._inputs = dict(
            model=model,
            tokenizer=processing_class,
            train_rows=train_rows,
            eval_rows=eval_rows,
            reward_funcs=self._reward_funcs,
            tools=tool_functions(tools),
            environment_factory=environment_factory,
            # TRL calls it with the trainer it was given to
            rollout_func=None if rollout_func is None else partial(_call_rollout_func, self),
        )
        from grpo.training.evaluate import held_out_group_evaluation

        # TRL raises for a row naming no environment in train(): checked when train() starts, so
        # the Trainer is built from its parts without Trainer.from_config's check
        self._hooks = dict(
            callbacks=self.callback_handler,
            extra_evaluation=held_out_group_evaluation(
                self.args.num_generations_eval or self.args.num_generations
            ),
        )
        self._holds_run = _holds_run(self.config)
        self.trainer = _build_trainer(
            _start_config(self.config, self._holds_run), self._inputs, self._hooks
        )
        self.model, self.processing_class = self._policy(), self.trainer.tokenizer

    def _policy_and_tokenizer(self, model, processing_class) -> tuple:
        """The model= and processing_class= the Trainer takes: a model given by name is grpo's to
        load (its name set in the config), unless a processing class comes with it, when it is
        loaded here; an in-memory model's tokenizer is loaded from its name_or_path if not given."""
        if isinstance(model, (str, Path)):
            self.config.model.name = str(model)
            model = None
            if processing_class is not None:
                from grpo.models.loading import load_model_and_tokenizer

                model, _ = load_model_and_tokenizer(self.config.model)
        return model, policy_tokenizer(model, processing_class)

    def _set_up_callbacks(self, callbacks) -> None:
        from transformers import TrainerControl

        from grpo.training.callbacks import Callbacks

        self.callback_handler = Callbacks(callbacks or (), args=self.args, control=TrainerControl())
        """The callbacks (transformers.TrainerCallback objects), called with this GRPOConfig as
        `args`, a RunState as `state` and a transformers.TrainerControl as `control`."""
        self.state = self.callback_handler.state
        """TrainerState's names: global_step, max_steps, epoch, log_history, ... (optimizer steps)."""

    def _policy(self):
        """The model trained, as TRL hands it back: the PeftModel passed, or the PeftModel grpo
        made from peft_config (its base model is grpo's policy module, adapted in place), else
        grpo's policy module."""
        if self._peft_model is not None:
            return self._peft_model
        from grpo.models.lora import peft_model

        return peft_model(self.trainer.model) or self.trainer.model

    # -------------------------------------------------------------- callbacks (transformers' names)

    def add_callback(self, callback) -> None:
        """Adds a callback (a TrainerCallback object, or its class)."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        """Removes and returns the callback (or the first of that class); None when absent."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        """Removes the callback (or the first of that class)."""
        self.callback_handler.remove(callback)

    @property
    def control(self):
        """The transformers.TrainerControl the callbacks act on."""
        return self.callback_handler.control

    @property
    def reward_funcs(self) -> list:
        """The reward functions, as TRL lists them: those passed, then one per environment class
        with get_reward (and grpo's overlong penalty when configured)."""
        return list(self.trainer.rewards.funcs)

    @property
    def reward_func_names(self) -> list[str]:
        return list(self.trainer.rewards.names)

    @property
    def reward_weights(self):
        """The reward functions' weights (a tensor, as in TRL)."""
        return self.trainer.rewards.weights.clone()

    @property
    def tools(self) -> list:
        """The tools as functions: those passed, then each environment's methods (of its first
        instance), as TRL lists them."""
        if "trainer" not in vars(self):
            return vars(self).get("_assembled_tools")
        tools = list(self.trainer.parts.tool_functions)
        environments = self.trainer.environments
        for functions in (environments.tool_functions if environments else {}).values():
            tools += [f for f in functions if f not in tools]
        return tools

    @tools.setter
    def tools(self, value) -> None:
        # the tools' schemas are in the prompts and the rollout engine from construction on, so a
        # built trainer's cannot change; an object put together without __init__ (as TRL's tests
        # assemble one) holds what it is given
        if "trainer" in vars(self):
            raise ConfigError(
                "GRPOTrainer.tools: a built trainer's tools are fixed (their schemas are in its prompts); "
                "pass tools= to GRPOTrainer"
            )
        vars(self)["_assembled_tools"] = value

    @property
    def environments(self) -> list | None:
        """The last batch's environments, one per completion (TRL's attribute); None without
        environment_factory."""
        if self.trainer.environments is None:
            return None
        return [episode.environment for episode in self.trainer.parts.episodes]

    @property
    def _env_tools(self) -> dict:
        """TRL's per-environment tool lists: {name (None for a single factory): functions}."""
        return self.trainer.environments.tool_functions if self.trainer.environments else {}

    @property
    def _environment_pool(self) -> dict:
        """TRL's pools of reusable instances: {name: [environments]}."""
        return self.trainer.environments.pool if self.trainer.environments else {}

    def _generate(self, prompts: list) -> tuple:
        """TRL's generation step, for code written against it: completions for `prompts`, one per
        completion (a row's prompt repeated, as TRL's batch holds them), by the rollout_func when
        there is one, else by the rollout engine with the training sampling settings (tools and
        environments too), from seeds drawn from torch's global generator (the run's own is not
        touched). Returns TRL 1.16's tuple (prompt_ids, completion_ids, tool_mask, completions,
        logprobs, extra_fields, images, tool_images): lists per completion; tool_mask 1 on the
        model's tokens and 0 on tool results (None without them); images None and tool_images
        empty (grpo trains text models)."""
        from grpo.rollout.custom import require_keys
        from grpo.rollout.types import prompt_seeds

        prompts = copy.deepcopy(prompts)
        t = self.trainer
        if self.rollout_func is not None:
            # TRL's first check, before anything of the run is read; the sampler reads the rest
            output = self.rollout_func(prompts, self)
            require_keys(output)
            sampler = dataclasses.replace(t.sampler, rollout_func=lambda *_: output)
        else:
            sampler = t.sampler
        rows = [{"prompt": prompt} for prompt in prompts]
        with t.backend.generation(t.model):
            generated = sampler(rows, 1, t.sampling, prompt_seeds(None, len(rows)))
        rollout, extra = generated.rollout, generated.columns or {}
        return trl_generation(rollout, prompts, extra, self.trainer.tokenizer) + (None, [])

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute): entropy_coef, as the adaptive
        controller has moved it (use_adaptive_entropy)."""
        control = self.trainer.state.entropy
        return control.coef if control is not None else self.args.entropy_coef

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL adds a mixture-of-experts model's router load-balancing loss when its config has
        output_router_logits; grpo does not (warned at start for such a model): always False."""
        return False

    @property
    def ref_model(self):
        """The KL reference (TRL's attribute): None when beta is 0 (no reference is used) or with
        LoRA (the policy with its adapter switched off is the reference, as in TRL); otherwise
        the frozen copy of the starting policy."""
        reference = self.trainer.reference
        if not reference.enabled:
            return None
        return getattr(reference, "model", None)

    def train(self, resume_from_checkpoint: str | bool | None = None):
        """Trains to max_steps; `resume_from_checkpoint`: a checkpoint directory, or True for the
        latest one in output_dir. Returns TRL's TrainOutput-like (global_step, training_loss, metrics)."""
        from grpo.training.build import check_environment_rows

        check_environment_rows(self.trainer.parts)
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        elif self._holds_run:
            from grpo.run.runlog import check_output_dir

            try:
                check_output_dir(Path(self.config.output_dir), overwrite=False)
            except ConfigError as error:
                raise ConfigError(
                    f"{error}. From GRPOTrainer: train(resume_from_checkpoint=True) continues it; "
                    "GRPOConfig(overwrite_output_dir=True) starts afresh"
                ) from None
        self.trainer.train()
        last = self.state.log_history[-1] if self.state.log_history else {}
        summary = (
            {
                k: v
                for k, v in last.items()
                if k.startswith("train_") or k in ("total_flos", "epoch")
            }
            if "train_runtime" in last
            else {}
        )
        return TrainOutput(self.state.global_step, summary.get("train_loss", 0.0), summary)

    def _resume(self, checkpoint_path: str | bool) -> None:
        from grpo.run import checkpoint

        path = (
            checkpoint.latest_checkpoint(Path(self.config.output_dir))
            if checkpoint_path is True
            else Path(checkpoint_path)
        )
        if path is None:
            raise ValueError(
                f"train(resume_from_checkpoint=True): no checkpoint in {self.config.output_dir}"
            )
        # the trainer built at construction holds no training yet: replace it by one that resumes
        self.trainer.rewards.close()
        self.trainer = _build_trainer(self.config, self._inputs, self._hooks, resume=path)
        self.model, self._holds_run = self._policy(), False

    def save_model(self, output_dir: str | None = None) -> None:
        """The policy and tokenizer, loadable with from_pretrained (default: output_dir)."""
        directory = Path(output_dir or self.config.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)

    def evaluate(
        self,
        eval_dataset=None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Held-out evaluation of `eval_dataset` (default: the trainer's), its metrics keyed
        `{metric_key_prefix}_...`; a dict of datasets (or a DatasetDict) is evaluated one by one,
        each under `{metric_key_prefix}_{name}_...`, as transformers does.

        Two measures, both logged (log_history, on_evaluate; eval.jsonl for the second):
        TRL's (grpo.training.evaluate.group_evaluation: num_generations_eval sampled
        completions per prompt, their `loss`, `reward`, `reward_std`, `rewards/<name>/mean`,
        `completions/...`), and grpo's (one greedy and one temperature-1 completion per
        prompt, eval.temperatures: `{decoding}/accuracy` by the task's scorer and
        `{decoding}/mean_reward`). Then `runtime`, `samples_per_second`, `steps_per_second`
        and `epoch`. `ignore_keys` (model outputs to leave out, in transformers) has nothing
        to act on here."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("GRPOTrainer.evaluate: needs eval_dataset (here or at construction)")
        if is_dataset_dict(dataset):
            metrics: dict[str, float] = {}
            for name, split in dataset.items():
                metrics.update(self.evaluate(split, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        import time

        from grpo.tasks.scorers import AnswerScorer, RewardScorer, has_integer_answers
        from grpo.training.evaluate import Evaluator, group_evaluation
        from grpo.training.trainer import eval_metrics

        t, started = self.trainer, time.monotonic()
        rows = (
            t.task.eval_rows
            if eval_dataset is None and t.task.eval_rows
            else eval_rows_of(dataset, self.config)
        )
        scorer = AnswerScorer() if has_integer_answers(rows) else RewardScorer()
        engine = t.parts.source.evaluation_engine  # the trained weights, also when generating ahead
        evaluator = Evaluator(self.config, engine, t.tokenizer, rows, scorer, t.rewards, t.backend)
        step = t.state.step
        with t.backend.generation(t.model):
            results = t.log.evaluation(
                "evaluate",
                step,
                len(evaluator.rows),
                evaluator.num_batches,
                lambda progress: evaluator("evaluate", step, progress),
            )
        G = self.args.num_generations_eval or self.args.num_generations
        metrics = {
            f"{metric_key_prefix}_{k}": v for k, v in group_evaluation(t, evaluator.rows, G).items()
        }
        metrics.update(eval_metrics(results, metric_key_prefix))
        runtime = max(time.monotonic() - started, 1e-9)
        batches = math.ceil(len(evaluator.rows) * G / max(1, self.args.per_device_eval_batch_size))
        metrics[f"{metric_key_prefix}_runtime"] = round(runtime, 4)
        metrics[f"{metric_key_prefix}_samples_per_second"] = round(len(evaluator.rows) / runtime, 3)
        metrics[f"{metric_key_prefix}_steps_per_second"] = round(batches / runtime, 3)
        t.sync_run_state()
        t.log_row(metrics)
        metrics["epoch"] = self.state.epoch
        self.callback_handler.fire("on_evaluate", metrics=metrics)
        return metrics

    # -------------------------------------------------------------- TRL's helpers

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """TRL's: the tokens (where `mask` is 1) whose entropy is at or above the `threshold`
        quantile of the masked entropies, one threshold over the whole tensor (grpo's
        algorithm.entropy_mask with quantile 1 - threshold, scope batch; one process's tokens)."""
        from grpo.algorithm import entropy_mask

        if not 0.0 <= threshold <= 1.0:
            raise ValueError(
                f"get_high_entropy_mask: threshold must be in [0, 1], got {threshold!r}"
            )
        return entropy_mask(entropies, mask, 1.0 - threshold, "batch")

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's off-policy sequence mask (DeepSeek-V3.2): [B, 1], 1.0 to keep a completion (its
        advantage >= 0, or its mean per-token KL(pi_old || pi_theta) <= the threshold), 0.0 to
        drop it; grpo's algorithm.off_policy_mask."""
        from grpo import algorithm

        off_policy_mask = getattr(algorithm, "off_policy_mask", None)
        if off_policy_mask is None:
            raise NotImplementedError(
                "GRPOTrainer.get_off_policy_mask: grpo.algorithm has no off_policy_mask in this version; "
                "upgrade grpo"
            )
        return off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict


def _build_trainer(cfg: Config, inputs: dict, hooks: dict, resume: Path | None = None):
    """grpo's Trainer for `cfg`: its parts built from the inputs GRPOTrainer's arguments were
    turned into (`inputs`, grpo.training.build.build_parts), run with `hooks` (the callbacks,
    TRL's group evaluation); `resume`: a checkpoint directory to continue from. The one place the
    facade constructs a Trainer."""
    from grpo.training.build import build_parts
    from grpo.training.trainer import Trainer

    return Trainer(build_parts(cfg, **inputs, resume=resume), **hooks)


def _holds_run(cfg: Config) -> bool:
    """Whether output_dir holds a run's checkpoints that the config does not allow replacing."""
    from grpo.run import checkpoint

    return bool(checkpoint.checkpoints(Path(cfg.output_dir))) and not cfg.overwrite_output_dir


def _start_config(cfg: Config, holds_run: bool) -> Config:
    """The config the Trainer is built with. An output_dir holding a run is refused by grpo unless
    resumed, but whether train() will resume is not known yet: built here as if it may be
    overwritten (which happens only when training starts), and train() refuses it there unless
    resuming or overwrite_output_dir."""
    if not holds_run:
        return cfg
    start = copy.deepcopy(cfg)
    start.overwrite_output_dir = True
    return start


def _call_rollout_func(trainer: "GRPOTrainer", prompts, _grpo_trainer):
    return trainer.rollout_func(prompts, trainer)
