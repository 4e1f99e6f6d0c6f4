"""The generate phase: how a step's completions are made from its rows.

Three ways, set up from the config and the Python API's arguments:

- the engine alone (grpo.rollout), on the rows' prompts;
- with tools or environments, the multi-turn engine around it (grpo.rollout.multiturn.ToolEngine);
  with environments each completion's own is reset first, its observation added to its prompt,
  which offers that environment's tools (grpo.rollout.environments);
- a rollout_func the user wrote (grpo.rollout.custom), in place of the engine.

`Sampler` is the phase, built once with what it reads; it decodes the completions once
(`decode_completions`) for the rewards, the evaluation and TRL's generation step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import Callable

from grpo.config.schema import Config
from grpo.rollout import Rollout, SamplingParams, create_engine
from grpo.tasks.data import PromptEncoder, Row
from grpo.training.state import DrawnAt


def configured_tools(cfg: Config, passed: list) -> dict:
    """The tools of rollout.tools and those passed in, by name (grpo.rollout.tools)."""
    specs = cfg.rollout.tools + list(passed)
    if not specs:
        return {}
    from grpo.rollout.tools import build_tools

    if "python" in specs:  # fail now, naming the fix, when the sandbox cannot run programs here
        from grpo.rewards.code import CodeRunner

        CodeRunner(cfg.rewards.sandbox).check()
    return build_tools(specs, cfg.rewards.sandbox, cfg.rollout.tool_timeout)


def configured_environments(cfg: Config, factory, tools: dict):
    """The environments of environment_factory (passed in) or rollout.environment, or None."""
    spec = factory or cfg.rollout.environment
    if spec is None:
        return None
    from grpo.rollout.environments import Environments

    timeout = cfg.rollout.tool_timeout
    if factory is not None:
        return Environments(factory, tools, timeout)
    return Environments.from_config(spec, tools, timeout)


def tool_engine(cfg: Config, tools: dict, model, tokenizer, decoding):
    """The multi-turn engine (grpo.rollout.multiturn.ToolEngine) around the configured one."""
    from grpo.rollout.multiturn import ToolEngine
    from grpo.rollout.tools import ToolRunner

    r = cfg.rollout
    inner = create_engine(
        r.engine, model, tokenizer, ToolEngine.inner_config(cfg, tokenizer), decoding
    )
    runner = ToolRunner(
        tools, r.tool_timeout, r.tool_output_chars, r.tool_isolation, r.tool_memory_mb
    )
    return ToolEngine(
        inner,
        tokenizer,
        runner,
        r.max_tool_calls,
        cfg.data.chat_template_kwargs,
        answer_malformed=r.malformed_tool_calls == "answer",
    )


def rollout_limits(engine, model, params: SamplingParams) -> dict:
    """What a rollout_func's output is checked against (grpo.rollout.custom.read_output)."""
    policy = getattr(model, "module", model)  # under DDP: the module it wraps
    return {
        "vocab_size": policy.get_input_embeddings().weight.shape[0],
        "max_completion_length": params.max_new_tokens,
        "pad_token_id": engine.pad_token_id,
        "eos_token_ids": engine.eos_token_ids,
    }


@dataclass
class Generated:
    """What the generate phase hands the rewards phase: the rows, their rollout (G completions
    each, group-major), each completion's token ids and text (decoded once, here), and beside
    them `episodes` (each completion's environment, grpo.rollout.environments) or `columns`
    (values per completion a rollout_func returned, given to the reward functions as dataset
    columns are)."""

    rows: list[Row]
    rollout: Rollout
    ids: list[list[int]]
    texts: list[str]
    episodes: list | None = None
    columns: dict[str, list] | None = None
    drawn: DrawnAt | None = None
    """Where its prompts were drawn (the rollout source's; its reward seed is derived from it),
    or None outside training (the train state's position is read then)."""
    sampled_from: int | None = None
    """The step whose weights sampled it (0: the initial ones), when generated ahead of training
    (grpo.training.ahead); None: the weights of the step before."""
    generate_seconds: float | None = None
    """The generator's seconds for it, when generated ahead (the trainer's wait is not this)."""


def decode_completions(rollout: Rollout, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Each completion's token ids (its mask's) and its text, special tokens left out: what the
    reward functions, the scorers and TRL's generation step read."""
    # as lists once (one copy from the device), not a tensor op per completion: this runs every
    # step, and generating ahead it runs on the trainer's side
    rows, masks = rollout.completion_ids.tolist(), rollout.completion_mask.tolist()
    ids = [list(compress(row, mask)) for row, mask in zip(rows, masks)]
    return ids, tokenizer.batch_decode(ids, skip_special_tokens=True)


@dataclass
class Sampler:
    """The generate phase: G completions of each row's prompt, by one of three ways (see the
    module's docstring), decoded. It holds what it reads: the engine, the prompt encoder, the
    tokenizer, the environments, a rollout_func (called with `caller` as its trainer; the
    Trainer that runs the run sets it), the policy (a rollout_func's output is checked against
    its vocabulary and placed on its device); and keeps the last batch's episodes (TRL's
    trainer.environments)."""

    engine: object
    prompts: PromptEncoder
    tokenizer: object
    model: object
    environments: object = None
    rollout_func: Callable | None = None
    caller: object = None
    episodes: list = field(default_factory=list)

    def __call__(self, rows: list[Row], G: int, params: SamplingParams, seeds) -> Generated:
        """G completions of each row's prompt, decoded; with environments, each completion's own
        is reset first and its calls go to it (`episodes`, kept as the last batch's)."""
        rollout, extra = self._rollout(rows, G, params, seeds)
        if extra.get("episodes") is not None:
            self.episodes = extra["episodes"]
        ids, texts = decode_completions(rollout, self.tokenizer)
        return Generated(rows, rollout, ids, texts, **extra)

    def _rollout(self, rows: list[Row], G: int, params: SamplingParams, seeds) -> tuple:
        if self.rollout_func is not None:
            from grpo.rollout.custom import read_output

            prompts_each = [row["prompt"] for row in rows for _ in range(G)]
            rollout, columns = read_output(
                self.rollout_func(prompts_each, self.caller),
                len(prompts_each),
                **rollout_limits(self.engine, self.model, params),
            )
            # read on the host, trained on the model's device
            return rollout.to(next(self.model.parameters()).device), {"columns": columns}
        if self.environments is None:
            return self.engine.generate(self.prompts(rows), G, params, seeds), {}
        return self._environment_rollout(rows, G, params, seeds)

    def _environment_rollout(self, rows: list[Row], G: int, params: SamplingParams, seeds):
        from grpo.rollout.environments import with_observation

        environments = self.environments
        episodes = environments.start(rows, G)
        ids: list = [None] * len(episodes)
        for name, schemas in environments.schemas.items():
            mine = [i for i, episode in enumerate(episodes) if episode.name == name]
            if not mine:
                continue
            observed = [with_observation(rows[i // G], episodes[i].observation) for i in mine]
            for i, tokens in zip(mine, self.prompts(observed, tools=schemas)):
                ids[i] = tokens
        rollout = self.engine.generate(ids, G, params, seeds, episodes=episodes)
        return rollout, {"episodes": episodes}
