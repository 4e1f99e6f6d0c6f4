"""Training on multi-turn completions with tools: tool-result tokens leave the loss (its value,
gradient and normalisers), the tools' metrics reach the step's, and a TRL script with
`tools=[calculator]` trains through grpo.GRPOTrainer."""

import copy
import json
import os
import random

import pytest
import torch

from grpo.models import logprobs
from grpo.models.tiny import tiny_model
from grpo.training.metrics import Outcome

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of integers with + - * and parentheses.

    Args:
        expression: The expression, e.g. "3 * (4 + 5)".
    """
    if not set(expression) <= set("0123456789+-*() "):
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression, {"__builtins__": {}}))  # digits and operators only


OVERRIDES = [
    "data.chat_template=auto",
    "rollout.num_generations=2",
    "rollout.max_completion_length=140",
    "rollout.tool_isolation=thread",
    "training.per_device_train_batch_size=4",
    "training.max_steps=2",
    "training.max_grad_norm=0",
]


def _tool_trainer(make_trainer, tool_tokenizer, tmp_path, ForcedCalls, overrides=()):
    trainer = make_trainer(
        tool_tokenizer, tmp_path, OVERRIDES + list(overrides), hidden=32, tools=[calculator]
    )
    # a random tiny model never writes a call: its first turns are given one (ForcedCalls);
    # everything after is the real mechanism, and its later turns are sampled
    trainer.engine.inner = ForcedCalls(trainer.engine.inner, tool_tokenizer, CALL)
    return trainer


def test_the_loss_and_its_gradient_ignore_tool_result_logits(
    tool_tokenizer, make_trainer, tmp_path, ForcedCalls, monkeypatch
):
    trainer = _tool_trainer(make_trainer, tool_tokenizer, tmp_path, ForcedCalls)
    rows = trainer.task.train_rows[:2]
    batch = trainer.phases.collect.scoring(trainer.sampler(rows, 2, trainer.sampling, [3, 4]))
    rollout = batch.rollout
    tool = rollout.tool_mask.bool()
    assert tool.any() and not batch.loss_mask[tool].any()
    assert batch.loss_mask[~tool].sum() == rollout.completion_mask[~tool].sum()
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75])

    model = trainer.model
    weights = copy.deepcopy(model.state_dict())
    hidden_states = logprobs.completion_hidden_states
    # the policy that sampled, a little off the current one: the loss's value then depends on the
    # log-probs too (on one pass with old = current, only its gradient does)
    update = trainer.phases.update
    old_logp = update.forward.batch(model, batch) - 0.05

    def loss_and_gradient(positions: torch.Tensor | None):
        """The update's loss and gradient, with noise added to the final hidden states that
        predict the completion tokens `positions` [N, T] (so to those tokens' logits, and only
        theirs: the output layer works position by position)."""
        model.load_state_dict(weights)
        fired = []

        def perturbed(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *args):
            hidden = hidden_states(
                model, prompt_ids, prompt_mask, completion_ids, completion_mask, *args
            )
            W = completion_ids.shape[1]
            ids = rollout.completion_ids[:, :W]
            # the batch row of each row of this piece (rows with equal ids have equal masks)
            rows = [int((ids == row).all(-1).nonzero()[0]) for row in completion_ids]
            where = positions[rows, :W].unsqueeze(-1).to(hidden.dtype)
            noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
            fired.append(True)
            return hidden + 5.0 * noise.to(hidden.dtype) * where

        if positions is not None:
            monkeypatch.setattr(logprobs, "completion_hidden_states", perturbed)
        try:
            stats = update(batch, advantages, old_logp, None)
        finally:
            monkeypatch.setattr(logprobs, "completion_hidden_states", hidden_states)
        assert positions is None or fired
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return stats["loss"], grads.clone()

    loss, grads = loss_and_gradient(None)
    tool_loss, tool_grads = loss_and_gradient(tool)
    assert tool_loss == pytest.approx(loss, rel=1e-6, abs=1e-9)
    assert torch.allclose(tool_grads, grads, rtol=1e-5, atol=1e-8)
    # the same noise on the sampled tokens' logits does change both: the check can fail
    sampled = batch.loss_mask.bool()
    other_loss, other_grads = loss_and_gradient(sampled)
    assert other_loss != pytest.approx(loss, rel=1e-3)
    assert not torch.allclose(other_grads, grads, rtol=1e-3, atol=1e-6)


def test_a_run_with_tools_logs_their_metrics(tool_tokenizer, make_trainer, tmp_path, ForcedCalls):
    trainer = _tool_trainer(
        make_trainer, tool_tokenizer, tmp_path, ForcedCalls, ["logging.sample_every=1"]
    )
    history = trainer.train()
    # the sample completions show the tool results set apart
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    assert samples and all(
        s["completion"].startswith(CALL + "[tool result]<tool>3</tool>A:[/tool result]")
        for s in samples
    )
    assert len(history) == 2
    # the completion lengths count the model's tokens, not the tool results' (as in TRL)
    batch = trainer.collect_batch()
    rollout = batch.rollout
    model_tokens = (rollout.completion_mask * (1 - rollout.tool_mask)).sum(-1).float()
    assert Outcome.of(batch).lengths.tolist() == model_tokens.tolist()
    assert (model_tokens < rollout.lengths).all()
    for metrics in history:
        assert metrics["tools/call_frequency"] == 1.0  # one call per completion, in its first turn
        assert metrics["tools/failure_frequency"] == 0.0
        assert metrics["tools/timeouts"] == 0
        assert metrics["tools/turns_mean"] == 2.0
        assert metrics["tools/seconds"] >= 0


def test_trls_calculator_example_runs_through_grpo(
    tool_tokenizer, tmp_path, monkeypatch, ForcedCalls
):
    from grpo import GRPOConfig, GRPOTrainer

    monkeypatch.chdir(tmp_path)
    # TRL's documented tool example, with sizes shrunk and a tiny model
    dataset = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} * {b}? Use the calculator."}],
            "answer": a * b,
        }
        for a, b in [(12, 7), (31, 4), (9, 9), (15, 6)]
    ]

    def answer_reward(completions, answer, **kwargs):
        return [float(str(a) in c[0]["content"]) for c, a in zip(completions, answer)]

    args = GRPOConfig(
        output_dir="out",
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=140,
        max_steps=2,
        max_tool_calling_iterations=2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        grpo_overrides=["rewards.isolation=thread", "rollout.tool_isolation=thread"],
    )
    trainer = GRPOTrainer(
        model=tiny_model(tool_tokenizer, hidden_size=32, num_layers=1, seed=1),
        processing_class=tool_tokenizer,
        reward_funcs=answer_reward,
        args=args,
        train_dataset=dataset,
        tools=[calculator],
    )
    assert trainer.config.rollout.max_tool_calls == 2
    # the prompt offers the tool, as the chat template writes it
    assert tool_tokenizer.decode(trainer.trainer.sampler.prompts(dataset[:1])[0]).startswith(
        "T:calculator;"
    )
    trainer.trainer.engine.inner = ForcedCalls(trainer.trainer.engine.inner, tool_tokenizer, CALL)
    out = trainer.train()
    assert out.global_step == 2
    logged = [row for row in trainer.state.log_history if "tools/call_frequency" in row]
    assert logged and all(row["tools/call_frequency"] == 1.0 for row in logged)

    # TRL's generation step (_generate), which code written against TRL may call: one prompt per
    # completion, TRL's tuple back; here every turn is the call, and the 140 tokens hold one call,
    # its result and the start of the next
    engine = trainer.trainer.engine
    engine.inner = ForcedCalls(engine.inner.inner, tool_tokenizer, CALL, every_turn=True)
    prompts = [dataset[0]["prompt"]] * 2
    prompt_ids, ids, tool_mask, completions, logprobs, extra, images, tool_images = (
        trainer._generate(prompts)
    )
    assert prompt_ids == [trainer.trainer.sampler.prompts(dataset[:1])[0]] * 2
    assert [len(m) for m in tool_mask] == [len(c) for c in ids] == [len(lp) for lp in logprobs]
    call = tool_tokenizer(CALL, add_special_tokens=False)["input_ids"]
    for row, mask in zip(ids, tool_mask):
        assert row[: len(call)] == call and mask[: len(call)] == [1] * len(call)
        assert 0 in mask  # the tool results: not the model's
    # where the results are, logprobs are 0 (never sampled)
    assert all(
        lp == 0.0 for row, mask in zip(logprobs, tool_mask) for lp, m in zip(row, mask) if not m
    )
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant"]
    assert completions[0][1]["content"] == "3"
    assert (extra, images, tool_images) == ({}, None, [])
    with pytest.raises(ValueError, match="a built trainer's tools are fixed"):
        trainer.tools = []


def test_tools_that_are_not_functions_are_refused(tool_tokenizer):
    from grpo import GRPOConfig, GRPOTrainer

    model = tiny_model(tool_tokenizer, hidden_size=32, num_layers=1, seed=1)
    with pytest.raises(TypeError, match="tools= takes functions"):
        GRPOTrainer(
            model=model,
            processing_class=tool_tokenizer,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(output_dir="x", use_cpu=True),
            train_dataset=[{"prompt": "a"}],
            tools=["not a function", 3],
        )


@pytest.mark.skipif(
    __import__("grpo.sandbox", fromlist=["bwrap_path"]).bwrap_path() is None,
    reason="bubblewrap is not installed (make test installs it)",
)
def test_the_python_tool_runs_the_models_code_in_the_sandbox_during_training(
    tool_tokenizer, make_trainer, tmp_path, ForcedCalls
):
    trainer = make_trainer(
        tool_tokenizer,
        tmp_path,
        [*OVERRIDES, "rollout.tools=[python]", "rollout.tool_timeout=5", "training.max_steps=1"],
        hidden=32,
    )
    code = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    trainer.engine.inner = ForcedCalls(trainer.engine.inner, tool_tokenizer, code)
    # the prompt offers it
    assert tool_tokenizer.decode(
        trainer.sampler.prompts(trainer.task.train_rows[:1])[0]
    ).startswith("T:python;")
    rows = trainer.task.train_rows[:2]
    rollout = trainer.engine.generate(trainer.sampler.prompts(rows), 2, trainer.sampling, [1, 2])
    for ids, mask, tool in zip(rollout.completion_ids, rollout.completion_mask, rollout.tool_mask):
        assert tool_tokenizer.decode(ids[tool.bool()]) == "<eos><tool>42</tool>A:"
        assert tool_tokenizer.decode(ids[mask.bool()]).startswith(code + "<eos><tool>42</tool>A:")
    trainer.engine.take_counts()
    (metrics,) = trainer.train()
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["sandbox/ok"] == 4  # the step's four calls, counted as the code rewards' runs


SECRET_CALL = '<tool_call>{"name": "secret", "arguments": {}}</tool_call>'


def secret() -> str:
    """Tells this turn's secret digit."""
    return str(random.randint(0, 9))


def secret_reward(completions, **kwargs):
    """0.5 for calling the tool first, 0.5 more for then answering with the digit it told.
    Completions come as TRL gives them with tools: the assistant turns (with their tool_calls)
    and the tool results, as messages."""
    rewards = []
    for turns in completions:
        first = turns[0]
        called = first["content"] == "" and [
            call["function"]["name"] for call in first.get("tool_calls", [])
        ] == ["secret"]
        reward = 0.5 * called
        if called and len(turns) > 2 and turns[1]["role"] == "tool":
            reward += 0.5 * (turns[2]["content"][:1] == turns[1]["content"])
        rewards.append(reward)
    return rewards


def test_a_tiny_model_learns_to_call_a_tool(tool_tokenizer, make_trainer, tmp_path):
    """Nothing forced: the call is one token of this tokenizer (an added token), which a random
    model writes now and then; the reward needs a digit only the tool tells, so calling pays,
    and the call rate and the reward rise within seconds of CPU."""
    from tokenizers import AddedToken

    tool_tokenizer.add_tokens([AddedToken(SECRET_CALL, special=False, normalized=False)])
    trainer = make_trainer(
        tool_tokenizer,
        tmp_path,
        [
            "data.chat_template=auto",
            "rollout.num_generations=8",
            "rollout.max_completion_length=24",
            "rollout.tool_isolation=thread",
            "training.per_device_train_batch_size=64",
            "training.max_steps=30",
            "training.learning_rate=3e-3",
        ],
        reward_funcs={"secret": secret_reward},
        tools=[secret],
    )
    history = trainer.train()
    calls = [m["tools/call_frequency"] for m in history]
    rewards = [m["reward"] for m in history]
    first, last = slice(0, 3), slice(-3, None)
    assert sum(calls[first]) / 3 < 0.6 and sum(calls[last]) / 3 > 0.9, calls
    assert sum(rewards[last]) / 3 > sum(rewards[first]) / 3 + 0.25, rewards


def test_tools_with_dynamic_sampling_lora_and_evaluation(
    tool_tokenizer, make_trainer, tmp_path, ForcedCalls
):
    trainer = _tool_trainer(
        make_trainer,
        tool_tokenizer,
        tmp_path,
        ForcedCalls,
        [
            "algorithm.dynamic_sampling=true",
            "algorithm.max_sampling_rounds=2",
            "model.lora.r=4",
            "eval.after=true",
            "eval.max_completion_length=140",
        ],
    )
    history = trainer.train()
    assert len(history) == 2 and all(m["tools/call_frequency"] == 1.0 for m in history)
    # the held-out completions are generated with the tools too (one turn each here: a random
    # model's greedy completions make no call), and the evaluation ran to its row
    assert trainer.parts.evaluator.engine is trainer.engine
    assert trainer.engine.take_counts()["completions"] > 0
    assert (tmp_path / "run" / "eval.jsonl").read_text().strip()


def test_tools_named_in_the_config_run_in_forked_processes(
    tool_tokenizer, make_trainer, tmp_path, monkeypatch, ForcedCalls
):
    """rollout.tools as 'module:function' names, with the default process isolation: each call
    runs in a child forked from the training process (torch and the model loaded)."""
    (tmp_path / "forked_calculator.py").write_text(
        "import os\n\n\n"
        "def calculator(expression: str) -> str:\n"
        '    """Evaluates an expression.\n\n    Args:\n        expression: The expression.\n    """\n'
        "    return f'{eval(expression, {})} from {os.getpid()}'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [o for o in OVERRIDES if not o.startswith("rollout.tool_isolation")]
    trainer = make_trainer(
        tool_tokenizer,
        tmp_path,
        [*overrides, "rollout.tools=[forked_calculator:calculator]", "training.max_steps=1"],
        hidden=32,
    )
    assert trainer.cfg.rollout.tool_isolation == "process"
    assert [s["function"]["name"] for s in trainer.engine.schemas] == ["calculator"]
    trainer.engine.inner = ForcedCalls(trainer.engine.inner, tool_tokenizer, CALL)
    rows = trainer.task.train_rows[:2]
    rollout = trainer.engine.generate(trainer.sampler.prompts(rows), 2, trainer.sampling, [5, 6])
    results = [turns[1]["content"] for turns in rollout.messages]
    assert all(r.startswith("3 from ") for r in results)
    assert str(os.getpid()) not in {r.split()[-1] for r in results}  # not this process
    trainer.engine.take_counts()
    (metrics,) = trainer.train()
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
