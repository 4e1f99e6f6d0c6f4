"""The generate phase: how a step's completions are made from its rows.

Three ways, set up from the config and the Python API's arguments:

- the engine alone (grpo.rollout), on the rows' prompts;
- with tools or environments, the multi-turn engine around it (grpo.rollout.multiturn.ToolEngine);
  with environments each completion's own is reset first, its observation added to its prompt,
  which offers that environment's tools (grpo.rollout.environments);
- a rollout_func the user wrote (grpo.rollout.custom), in place of the engine.

`generate` is the phase on a run's parts (grpo.training.build.RunParts); `sample` the same
from the parts it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.config.schema import Config
from grpo.rollout import SamplingParams, create_engine
from grpo.tasks.data import Row

if TYPE_CHECKING:
    from grpo.training.build import RunParts


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


def sample(
    rows: list[Row],
    G: int,
    params: SamplingParams,
    seeds,
    *,
    engine,
    prompts,
    environments=None,
    rollout_func=None,
    caller=None,
    model=None,
) -> tuple:
    """G completions of each row's prompt: the rollout, and what grpo.training.scoring.score needs beside it
    (keyword arguments). `prompts`: the PromptEncoder. With `environments`, each completion's
    own is reset first and its calls go to it: `episodes`. With a `rollout_func`, the rollout is
    its own, called with `caller` as the trainer, and what else it returned goes to the reward
    functions: `columns`."""
    if rollout_func is not None:
        from grpo.rollout.custom import read_output

        prompts_each = [row["prompt"] for row in rows for _ in range(G)]
        rollout, columns = read_output(
            rollout_func(prompts_each, caller),
            len(prompts_each),
            **rollout_limits(engine, model, params),
        )
        # read on the host, trained on the model's device
        return rollout.to(next(model.parameters()).device), {"columns": columns}
    if environments is None:
        return engine.generate(prompts(rows), G, params, seeds), {}
    from grpo.rollout.environments import with_observation

    episodes = environments.start(rows, G)
    ids: list = [None] * len(episodes)
    for name, schemas in environments.schemas.items():
        mine = [i for i, episode in enumerate(episodes) if episode.name == name]
        if not mine:
            continue
        observed = [with_observation(rows[i // G], episodes[i].observation) for i in mine]
        for i, tokens in zip(mine, prompts(observed, tools=schemas)):
            ids[i] = tokens
    rollout = engine.generate(ids, G, params, seeds, episodes=episodes)
    return rollout, {"episodes": episodes}


def generate(run: RunParts, rows: list[Row], G: int, params: SamplingParams, seeds) -> tuple:
    """`sample` with the run's engine, prompts, environments and rollout_func (called with
    `run.caller` as its trainer); the episodes, when there are environments, kept as the
    run's last (`run.episodes`: TRL's trainer.environments)."""
    rollout, context = sample(
        rows,
        G,
        params,
        seeds,
        engine=run.engine,
        prompts=run.prompts,
        environments=run.environments,
        rollout_func=run.rollout_func,
        caller=run.caller,
        model=run.model,
    )
    run.episodes = context.get("episodes", run.episodes)
    return rollout, context
