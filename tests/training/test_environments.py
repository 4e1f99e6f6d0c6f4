"""Environments (TRL's environment_factory, rollout.environment): one reset instance per
completion, its methods the completion's tools (run in this process, on that instance), its
reset's string added to the prompt, its get_reward a reward function; several environments
chosen per row; TRL's environment example through grpo.GRPOTrainer."""

import json
import textwrap

import pytest
import torch

from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.models.tiny import tiny_model

INCREMENT = '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'

OVERRIDES = [
    "data.chat_template=auto",
    "rollout.num_generations=2",
    "rollout.max_completion_length=120",
    "training.per_device_train_batch_size=4",
    "training.max_steps=2",
    "training.max_grad_norm=0",
]


class Counter:
    """TRL's counter environment: `increment` is its tool, `get_reward` its counter."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.counter, self.resets = 0, []

    def reset(self, **row):
        self.counter = 0
        self.resets.append(row)
        return " Count!"

    def increment(self, step: int) -> int:
        """Adds to the counter.

        Args:
            step: What to add.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter)


class Echo:
    def reset(self, **row):
        return None

    def shout(self, text: str) -> str:
        """Shouts the text.

        Args:
            text: The text.
        """
        return text.upper()


def _trainer(make_trainer, tool_tokenizer, tmp_path, factory, overrides=(), **kwargs):
    return make_trainer(
        tool_tokenizer,
        tmp_path,
        OVERRIDES + list(overrides),
        hidden=32,
        environment_factory=factory,
        **kwargs,
    )


def test_each_completion_calls_its_own_environment_which_scores_it(
    tool_tokenizer, make_trainer, tmp_path, ForcedCalls
):
    trainer = _trainer(make_trainer, tool_tokenizer, tmp_path, Counter)
    # the environment's reward comes after the run's own, weight 1, named after its class
    assert trainer.rewards.names == ["correct", "Counter"]
    assert trainer.rewards.weights.tolist() == [1.0, 1.0]
    forced = ForcedCalls(trainer.engine.inner, tool_tokenizer, INCREMENT)
    trainer.engine.inner = forced
    rows = trainer.task.train_rows[:2]
    generated = trainer.sampler(rows, 2, trainer.sampling, [5, 6])
    rollout, episodes = generated.rollout, generated.episodes
    # one instance per completion, each reset with its row, and each called once
    instances = [e.environment for e in episodes]
    assert len({id(e) for e in instances}) == 4
    assert [e.resets[-1] for e in instances] == [rows[0], rows[0], rows[1], rows[1]]
    assert [e.counter for e in instances] == [2, 2, 2, 2]
    # the prompt offers the environment's tool and ends with what reset returned
    prompt = tool_tokenizer.decode(forced.asked[0][0])
    assert prompt.startswith("T:increment;") and "Count!<eos>A:" in prompt
    assert rollout.messages[0][1] == {"role": "tool", "name": "increment", "content": "2"}
    batch = trainer.phases.collect.scoring(generated)
    assert batch.rewards_per_func[:, 1].tolist() == [2.0, 2.0, 2.0, 2.0]
    # the prompts the reward functions get are those the model saw
    assert batch.prompts[0][-1]["content"].endswith(" Count!")
    history = trainer.train()
    assert [m["rewards/Counter/mean"] for m in history] == [2.0, 2.0]
    assert all(m["tools/call_frequency"] == 1.0 for m in history)
    # instances are reused from step to step: a step of 4 completions needs 4
    assert len(trainer.environments.pool[None]) == 4


def test_environments_by_name_offer_only_their_own_tools(
    tool_tokenizer, make_trainer, tmp_path, ForcedCalls
):
    rows = [
        {"prompt": [{"role": "user", "content": "1+1="}], "answer": 2, "environment": "counter"},
        {"prompt": [{"role": "user", "content": "2+1="}], "answer": 3, "environment": "echo"},
    ]
    trainer = _trainer(
        make_trainer,
        tool_tokenizer,
        tmp_path,
        {"counter": Counter, "echo": Echo},
        ["rollout.max_completion_length=200"],  # room for the error message
        train_rows=rows,
    )
    assert trainer.rewards.names == ["correct", "Counter"]
    forced = ForcedCalls(trainer.engine.inner, tool_tokenizer, INCREMENT)
    trainer.engine.inner = forced
    generated = trainer.sampler(rows, 2, trainer.sampling, [1, 2])
    rollout, episodes = generated.rollout, generated.episodes
    prompts = [tool_tokenizer.decode(ids) for ids in forced.asked[0]]
    assert prompts[0].startswith("T:increment;") and prompts[1].startswith("T:shout;")
    # `environment` chose the instance and is not passed to reset
    assert [e.name for e in episodes] == ["counter", "counter", "echo", "echo"]
    assert "environment" not in episodes[0].environment.resets[-1]
    # the echo rows' call to increment is not theirs to make: answered with an error
    assert rollout.messages[0][1]["content"] == "2"
    assert rollout.messages[2][1]["content"].startswith("error: no tool named 'increment'")
    batch = trainer.phases.collect.scoring(generated)
    rewards = batch.rewards_per_func[:, 1].tolist()
    assert rewards[:2] == [2.0, 2.0] and all(r != r for r in rewards[2:])  # NaN: not scored


def test_a_row_naming_no_environment_is_refused_at_start(tool_tokenizer, make_trainer, tmp_path):
    rows = [
        {"prompt": "1+1=", "answer": 2, "environment": "counter"},
        {"prompt": "x", "answer": 1, "environment": "shop"},
    ]
    with pytest.raises(ConfigError, match="training rows: row 1: environment='shop' is not among"):
        _trainer(make_trainer, tool_tokenizer, tmp_path, {"counter": Counter}, train_rows=rows)


def test_different_observations_in_a_group_are_sampled_one_by_one(
    tool_tokenizer, make_trainer, tmp_path
):
    class Dealer:
        dealt = 0

        def reset(self, **row):
            Dealer.dealt += 1
            return f" card {Dealer.dealt}"

        def peek(self) -> str:
            """Looks at the card."""
            return "7"

    trainer = _trainer(make_trainer, tool_tokenizer, tmp_path, Dealer)
    rows = trainer.task.train_rows[:2]

    def run():
        Dealer.dealt = 0
        generated = trainer.sampler(rows, 2, trainer.sampling, [8, 9])
        return generated.rollout, [e.observation for e in generated.episodes]

    first, observations = run()
    assert observations == [" card 1", " card 2", " card 3", " card 4"]
    prompts = [
        tool_tokenizer.decode(p[m.bool()]) for p, m in zip(first.prompt_ids, first.prompt_mask)
    ]
    assert all(f"card {k}<eos>A:" in p for k, p in zip(range(1, 5), prompts))
    again, _ = run()
    assert first.completion_ids.tolist() == again.completion_ids.tolist()


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: object(), "made a object, which has no reset method"),
        (lambda: 1 / 0, r"environment_factory: <lambda>\(\) raised ZeroDivisionError"),
    ],
)
def test_a_factory_that_cannot_make_an_environment_is_refused(
    tool_tokenizer, make_trainer, tmp_path, factory, message
):
    with pytest.raises(ConfigError, match=message):
        _trainer(make_trainer, tool_tokenizer, tmp_path, factory)


@pytest.mark.parametrize(
    "returned, message",
    [
        (["a list"], r"Bad.reset returned a list; return None or a string"),
        ("x" * 100_001, "Bad.reset returned 100,001 characters; at most 100,000"),
    ],
)
def test_a_reset_that_returns_what_cannot_be_a_prompt_is_refused(
    tool_tokenizer, make_trainer, tmp_path, returned, message
):
    class Bad:
        def reset(self, **row):
            return returned

    trainer = _trainer(make_trainer, tool_tokenizer, tmp_path, Bad)
    with pytest.raises(ConfigError, match=message):
        trainer.sampler(trainer.task.train_rows[:1], 2, trainer.sampling, [1])


def test_no_reward_function_and_no_environment_reward_is_refused(tool_tokenizer, tmp_path):
    from grpo.training.trainer import Trainer

    cfg = loading.from_dict(
        {"output_dir": str(tmp_path / "run"), "rewards": {"funcs": [], "isolation": "thread"}},
        OVERRIDES + ["data.task=arithmetic"],
    )
    model = tiny_model(tool_tokenizer, hidden_size=32, num_layers=1, seed=0)
    with pytest.raises(ConfigError, match="rewards.funcs: empty, and no environment scores"):
        Trainer.from_config(cfg, model=model, tokenizer=tool_tokenizer, environment_factory=Echo)


def test_rollout_environment_in_the_config_is_found_beside_it(tool_tokenizer, tmp_path):
    from grpo.training.trainer import Trainer

    (tmp_path / "envs.py").write_text(
        textwrap.dedent(
            '''
            class Lamp:
                def reset(self, **row):
                    self.on = False

                def switch(self) -> str:
                    """Switches the lamp on."""
                    self.on = True
                    return "on"

                def get_reward(self) -> float:
                    return float(self.on)
            '''
        )
    )
    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "rollout": {"environment": "envs.py:Lamp"},
                "rewards": {"funcs": [], "isolation": "thread"},
            }
        )
    )
    cfg = loading.load(config, OVERRIDES)
    assert cfg.rollout.environment == f"{tmp_path / 'envs.py'}:Lamp"
    model = tiny_model(tool_tokenizer, hidden_size=32, num_layers=1, seed=0)
    trainer = Trainer.from_config(cfg, model=model, tokenizer=tool_tokenizer)
    assert trainer.rewards.names == ["Lamp"]
    history = trainer.train()
    assert len(history) == 2 and "rewards/Lamp/mean" in history[0]


def test_trls_environment_example_runs_through_grpo(
    tool_tokenizer, tmp_path, monkeypatch, ForcedCalls
):
    import random

    from grpo import GRPOConfig, GRPOTrainer

    monkeypatch.chdir(tmp_path)
    random.seed(0)

    # TRL's documented environment_factory example, with the import changed, sizes shrunk and a
    # tiny model: the environment owns the data (no train_dataset; reset samples the task and
    # returns the prompt) and the reward (get_reward)
    class IncrementEnv:
        def reset(self, **kwargs) -> str | None:
            self.counter = 0
            self.target = random.randint(1, 6)
            return f"Increment the counter by {self.target}."

        def get_reward(self) -> float:
            return float(self.counter == self.target)

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            self.counter += step
            return self.counter

    args = GRPOConfig(
        output_dir="out",
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=120,
        max_steps=2,
        max_tool_calling_iterations=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=tiny_model(tool_tokenizer, hidden_size=32, num_layers=1, seed=1),
        processing_class=tool_tokenizer,
        args=args,
        environment_factory=IncrementEnv,
    )
    assert trainer.reward_func_names == ["IncrementEnv"]
    assert trainer.reward_weights.tolist() == [1.0]
    assert [tool.__name__ for tool in trainer.tools] == ["increment"]
    assert [tool.__name__ for tool in trainer._env_tools[None]] == ["increment"]
    # every turn of the random model is given a call of increment(2): the first runs, the second
    # is past max_tool_calling_iterations
    call = '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'
    forced = ForcedCalls(trainer.trainer.engine.inner, tool_tokenizer, call, every_turn=True)
    trainer.trainer.engine.inner = forced
    out = trainer.train()
    assert out.global_step == 2
    environments = trainer.environments
    assert len(environments) == 4 and all(env.counter == 2 for env in environments)
    # the reset's text is the prompt: the targets differ within a group, so each completion was
    # sampled with its own prompt
    prompts = [tool_tokenizer.decode(ids) for ids in forced.asked[-2]]
    assert all(
        p.endswith(f"Increment the counter by {env.target}.<eos>A:")
        for env, p in zip(environments, prompts)
    )
    assert len(set(prompts)) > 1
    last = [
        row
        for row in trainer.state.log_history
        if "rewards/IncrementEnv/mean" in row
        and "train_runtime" not in row  # not the summary's mean
    ][-1]
    hits = [float(env.target == 2) for env in environments]
    assert last["rewards/IncrementEnv/mean"] == pytest.approx(sum(hits) / len(hits))


def test_trl_api_refusals_for_environments(tool_tokenizer, tmp_path, monkeypatch):
    from grpo import GRPOConfig, GRPOTrainer

    monkeypatch.chdir(tmp_path)  # a refusal must come before output_dir is claimed

    model = tiny_model(tool_tokenizer, hidden_size=32, num_layers=1, seed=1)
    with pytest.raises(ValueError, match="`train_dataset` is required unless"):
        GRPOTrainer(model=model, reward_funcs=lambda **kw: [], args=GRPOConfig(output_dir="x"))
    with pytest.raises(ValueError, match="max_steps"):
        GRPOTrainer(model=model, args=GRPOConfig(output_dir="x"), environment_factory=Counter)
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer(
            model=model,
            args=GRPOConfig(output_dir="x", max_steps=1),
            environment_factory={"a": Counter, "b": Echo},
        )
    # a row naming no environment: refused when train() starts, where TRL raises, before any step
    trainer = GRPOTrainer(
        model=model,
        processing_class=tool_tokenizer,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(output_dir="x", max_steps=1, report_to="none", save_strategy="no"),
        train_dataset=[{"prompt": "1+1=", "environment": "a"}, {"prompt": "x", "environment": "c"}],
        environment_factory={"a": Counter, "b": Echo},
    )
    with pytest.raises(ValueError, match="row 1: environment='c' is not among the environments"):
        trainer.train()
    assert trainer.state.global_step == 0


# ---------------------------------------------------------------- rollout_func


def _rollout_func_trainer(tool_tokenizer, tmp_path, rollout_func, reward, max_steps=2):
    from grpo import GRPOConfig, GRPOTrainer

    rows = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(4)]
    return GRPOTrainer(
        model=tiny_model(tool_tokenizer, hidden_size=32, num_layers=1, seed=1),
        processing_class=tool_tokenizer,
        reward_funcs=reward,
        args=GRPOConfig(
            output_dir=str(tmp_path / "out"),
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=16,
            max_steps=max_steps,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            grpo_overrides=["rewards.isolation=thread"],
        ),
        train_dataset=rows,
        rollout_func=rollout_func,
    )


def test_a_rollout_func_is_trained_on_as_it_returns(tool_tokenizer, tmp_path):
    seen = []

    def rollout_func(prompts, trainer):
        # TRL's contract: the prompts as the dataset has them, one per completion, and the trainer
        seen.append((list(prompts), trainer))
        tok = trainer.processing_class
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        # the model's "7", an environment's " ok", the model's end of sequence
        model, env = (
            tok("7", add_special_tokens=False)["input_ids"],
            tok(" ok", add_special_tokens=False)["input_ids"],
        )
        completion = model + env + [tok.eos_token_id]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [completion] * len(prompts),
            "logprobs": [[-0.5] * len(completion)] * len(prompts),
            "env_mask": [[1] * len(model) + [0] * len(env) + [1]] * len(prompts),
            "turns": [i % 2 for i in range(len(prompts))],
        }

    def reward(completions, turns, **kwargs):
        return [float(t) for t in turns]  # a column the rollout_func returned

    trainer = _rollout_func_trainer(tool_tokenizer, tmp_path, rollout_func, reward)
    batch = trainer.trainer.collect_batch()
    prompts, given = seen[0]
    assert given is trainer
    assert len(prompts) == 4 and prompts[0] == prompts[1] and prompts[0] != prompts[2]
    # the environment's tokens leave the loss; the model's stay
    assert batch.rollout.tool_mask[0].tolist()[:5] == [0, 1, 1, 1, 0]
    assert batch.loss_mask[0].tolist()[:5] == [1, 0, 0, 0, 1]
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert not batch.rollout.truncated.any()
    assert batch.completion_texts[0] == "7 ok"
    # TRL's generation step (_generate) calls the rollout_func the same way, returning TRL's tuple
    prompt_ids, ids, tool_mask, completions, logprobs, extra, _, _ = trainer._generate(["1+1="])
    assert seen[-1] == (["1+1="], trainer)
    assert prompt_ids == [tool_tokenizer("1+1=", add_special_tokens=False)["input_ids"]]
    assert tool_mask == [[1, 0, 0, 0, 1]] and logprobs == [[-0.5] * 5]
    assert completions == ["7 ok"] and extra == {"turns": [0]}
    out = trainer.train()
    assert out.global_step == 2


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda o: o.pop("logprobs"), r"rollout_func must return keys \['logprobs'\]"),
        (lambda o: o["prompt_ids"].pop(), "prompt_ids has 3 entries for 4 prompts"),
        (
            lambda o: o["completion_ids"].__setitem__(1, [10_000]),
            r"completion_ids\[1\] is not a list of token ids below",
        ),
        (
            lambda o: o["completion_ids"].__setitem__(2, [5] * 17),
            r"completion_ids\[2\] has 17 tokens, more than rollout.max_completion_length=16",
        ),
        (
            lambda o: o["logprobs"].__setitem__(0, [0.5, -1.0]),
            r"logprobs\[0\] holds a value that is not a finite log-probability",
        ),
        (
            lambda o: o["logprobs"].__setitem__(0, [-1.0]),
            r"logprobs\[0\] must have one value per token",
        ),
        (lambda o: o.__setitem__("env_mask", [[2, 1]] * 4), r"env_mask\[0\] must hold 0s and 1s"),
        (lambda o: o.__setitem__("score", [1.0]), "'score' has 1 values for 4 completions"),
    ],
)
def test_what_a_rollout_func_returns_is_checked_before_training(
    tool_tokenizer, tmp_path, change, message
):
    def rollout_func(prompts, trainer):
        output = {
            "prompt_ids": [[5, 6]] * len(prompts),
            "completion_ids": [[7, 8]] * len(prompts),
            "logprobs": [[-1.0, -1.0]] * len(prompts),
        }
        output = {key: list(value) for key, value in output.items()}
        change(output)
        return output

    trainer = _rollout_func_trainer(
        tool_tokenizer, tmp_path, rollout_func, lambda completions, **kw: [0.0] * len(completions)
    )
    with pytest.raises(ConfigError, match=message) as refused:
        trainer.trainer.collect_batch()
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "x").exists()


def test_an_environment_reward_named_like_a_reward_function_is_refused(
    tool_tokenizer, make_trainer, tmp_path, first_char_correct
):
    with pytest.raises(ConfigError, match="'Counter' is both a reward function and an environment"):
        _trainer(
            make_trainer,
            tool_tokenizer,
            tmp_path,
            Counter,
            reward_funcs={"Counter": first_char_correct},
        )


def test_a_reset_that_hangs_stops_the_run_within_the_timeout(
    tool_tokenizer, make_trainer, tmp_path
):
    import threading
    import time

    release = threading.Event()

    class Stuck:
        def reset(self, **row):
            if Stuck.armed:
                release.wait(30)  # a reset that never returns (released when the test ends)

    Stuck.armed = False
    trainer = _trainer(make_trainer, tool_tokenizer, tmp_path, Stuck, ["rollout.tool_timeout=0.5"])
    Stuck.armed = True
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"Stuck.reset did not return within 0.5 s"):
            trainer.sampler(trainer.task.train_rows[:1], 2, trainer.sampling, [1])
    finally:
        release.set()
    assert time.monotonic() - started < 5


def test_an_environment_method_without_a_schema_is_refused_naming_it(
    tool_tokenizer, make_trainer, tmp_path
):
    class Vague:
        def reset(self, **row):
            return None

        def poke(self, x):
            return x

    with pytest.raises(ConfigError, match=r"environment_factory: Vague.poke: no JSON schema"):
        _trainer(make_trainer, tool_tokenizer, tmp_path, Vague)


@pytest.mark.slow  # ten seconds; the SIGKILL resume with tools (tests/run) is in the default suite
def test_resume_with_environments_is_exact(tool_tokenizer, make_trainer, tmp_path, ForcedCalls):
    """Every rollout's environment is reset from its row first, so nothing is pending between
    steps: a run resumed from a checkpoint, with new instances, is the uninterrupted run (the
    environment's own reward included)."""
    steps = ["training.max_steps=4", "training.save_steps=2"]

    def trainer(path, overrides, **kwargs):
        made = _trainer(make_trainer, tool_tokenizer, path, Counter, overrides, **kwargs)
        made.engine.inner = ForcedCalls(made.engine.inner, tool_tokenizer, INCREMENT)
        return made

    full = trainer(tmp_path / "a", steps)
    full_history = full.train()
    trainer(tmp_path / "b", [*steps, "training.max_steps=2"]).train()
    resumed = trainer(tmp_path / "b", steps, resume=tmp_path / "b" / "run" / "checkpoint-2")
    resumed_history = resumed.train()
    for key in ("reward", "rewards/Counter/mean", "tools/call_frequency"):
        assert [m[key] for m in resumed_history] == [m[key] for m in full_history[2:]], key
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
