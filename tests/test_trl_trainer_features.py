"""grpo.GRPOTrainer as TRL users and TRL's own tests use it beyond train(): callbacks, the
log_history summary row, evaluate(), a PeftModel, reward weights and reward-model tokenizers,
reward functions that log (log_metric, log_extra), TRL's warnings and public helpers.

Each runs a tiny random model for a step or two (rewards in threads, no worker processes,
unless the test is about them)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from grpo.config.errors import ConfigError
from grpo.models.tiny import char_tokenizer, tiny_model
from grpo.trl.config import GRPOConfig
from grpo.trl.trainer import GRPOTrainer

TINY = [
    "model.tiny_hidden_size=32",
    "model.tiny_num_layers=1",
    "rewards.isolation=thread",
    "eval.temperatures=[0.0]",
]
ROWS = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(6)]


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def varied_reward(completions, **kwargs):
    """Rewards that differ within a group (a random model's completions all run to the limit)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def args(tmp_path, **kw):
    settings = dict(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_completion_length=4,
        max_steps=2,
        learning_rate=1e-3,
        grpo_overrides=list(TINY),
    )
    settings.update(kw)
    return GRPOConfig(**settings)


# ---------------------------------------------------------------- a TRL user's script

USER_SCRIPT = """
from transformers import TrainerCallback

from grpo import GRPOConfig, GRPOTrainer


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("train_begin", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))
        if state.global_step >= 2:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", sorted(logs)[:1]))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", metrics["eval_reward"]))

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.events.append(("train_end", model is not None and optimizer is not None))


def accuracy_reward(completions, answer, log_metric, **kwargs):
    rewards = [float(str(a) in c) for c, a in zip(completions, answer)]
    log_metric("accuracy", sum(rewards) / len(rewards))
    log_metric("completion_chars", sum(len(c) for c in completions) / len(completions))
    return rewards


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


recorder = Recorder()
config = GRPOConfig(
    output_dir=OUTPUT_DIR,
    num_generations=2,
    per_device_train_batch_size=4,
    max_completion_length=4,
    max_steps=5,
    learning_rate=1e-3,
    grpo_overrides=GRPO_OVERRIDES,
    **CHAT_TEMPLATE,
)
trainer = GRPOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=[accuracy_reward, length_reward],
    args=config,
    train_dataset=train_rows,
    callbacks=[recorder],
)
trainer.train()
metrics = trainer.evaluate(eval_dataset=eval_rows)
"""


@pytest.mark.parametrize(
    "chat_template",
    [
        pytest.param({}, id="plain"),
        pytest.param(
            {"chat_template_kwargs": {"enable_thinking": False}}, id="chat_template_kwargs"
        ),
    ],
)
def test_a_trl_users_script(tmp_path, chat_template):
    tokenizer = char_tokenizer()
    # Qwen3's switch in miniature: with enable_thinking false the template writes an empty thought
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    namespace = {
        "__name__": "user_script",
        "model": tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=3),
        "tokenizer": tokenizer,
        "OUTPUT_DIR": str(tmp_path / "run"),
        "GRPO_OVERRIDES": list(TINY),
        "CHAT_TEMPLATE": chat_template,
        "train_rows": [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in ROWS
        ],
        "eval_rows": [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in ROWS[:2]
        ],
    }
    exec(compile(USER_SCRIPT, "user_script", "exec"), namespace)
    trainer, recorder, metrics = namespace["trainer"], namespace["recorder"], namespace["metrics"]
    events = recorder.events
    # the prompts the model continued were rendered with the script's template variables
    prompt = tokenizer.decode(trainer.trainer.sampler.prompts(namespace["train_rows"][:1])[0])
    assert prompt.endswith("<think></think>") == bool(chat_template)
    # stopped by the callback after the second step of five, then ended as a run ends
    assert [e for e in events if e[0] == "step_end"] == [("step_end", 1), ("step_end", 2)]
    end = events.index(("train_end", True))  # after the summary row's on_log; evaluate() after it
    assert events[0] == ("train_begin", 0) and events[end - 1][0] == "log"
    assert events[end + 1 :] == [("log", ["epoch"]), ("evaluate", metrics["eval_reward"])]
    assert trainer.state.global_step == 2
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    # the steps' rows carry what the reward function logged, then the summary row, then evaluate's
    step_rows = [r for r in trainer.state.log_history if "reward" in r and "train_runtime" not in r]
    assert [r["step"] for r in step_rows] == [1, 2]
    for row in step_rows:
        assert 0.0 <= row["accuracy"] <= 1.0
        assert row["completion_chars"] == pytest.approx(row["completions/mean_length"], abs=4.0)
    summary = next(r for r in trainer.state.log_history if "train_runtime" in r)
    assert summary["step"] == 2 and summary["total_flos"] == 0.0
    assert summary["train_loss"] == pytest.approx(sum(r["loss"] for r in step_rows) / 2)
    assert {"train_samples_per_second", "train_steps_per_second", "epoch"} <= set(summary)
    # evaluate(eval_dataset=...): TRL's keys, one on_evaluate, the row last in log_history
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["eval_reward"])
    assert "eval_rewards/accuracy_reward/mean" in metrics
    assert "eval_accuracy" in metrics  # the reward function's log_metric, during evaluation too
    assert ("evaluate", metrics["eval_reward"]) in events
    assert trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]


# ---------------------------------------------------------------- callbacks


class Events:
    """A callback that records every event it is given (transformers' names)."""

    def __init__(self):
        self.seen = []

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)

        def record(args, state, control, **kwargs):
            self.seen.append(name)
            assert {"model", "processing_class", "optimizer", "lr_scheduler"} <= set(kwargs)

        return record


def test_callbacks_events_save_and_evaluate_on_request(tmp_path):
    from transformers import TrainerCallback

    class SaveAndEvaluateAtOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_save = control.should_evaluate = True

    events = Events()
    trainer = GRPOTrainer(
        "tiny",
        length_reward,
        args=args(tmp_path, max_steps=3, save_strategy="no"),
        train_dataset=ROWS,
        eval_dataset=ROWS[:2],
        callbacks=[events, SaveAndEvaluateAtOne],  # an object and a class
    )
    assert events.seen == ["on_init_end"]
    assert isinstance(trainer.pop_callback(SaveAndEvaluateAtOne), SaveAndEvaluateAtOne)
    assert trainer.pop_callback(SaveAndEvaluateAtOne) is None
    trainer.add_callback(SaveAndEvaluateAtOne)
    trainer.train()
    # 6 rows, 2 prompts a step: an epoch is 3 steps
    assert events.seen[:3] == ["on_init_end", "on_train_begin", "on_epoch_begin"]
    assert events.seen.count("on_step_begin") == 3 and events.seen.count("on_step_end") == 3
    assert events.seen[-2:] == ["on_log", "on_train_end"]
    assert events.seen.count("on_epoch_end") == 1 and events.seen.count("on_evaluate") == 1
    assert events.seen.count("on_save") == 2  # checkpoint-1 on request, and final/
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    assert not (tmp_path / "run" / "checkpoint-2").exists()
    eval_rows = [r for r in trainer.state.log_history if "eval_greedy/accuracy" in r]
    assert [r["step"] for r in eval_rows] == [1] and "eval_loss" in eval_rows[0]
    trainer.remove_callback(events)
    assert events not in list(trainer.callback_handler)


def test_grpo_trainer_takes_callbacks_without_transformers(make_trainer, tokenizer, tmp_path):
    from grpo.training.callbacks import Callbacks, Control

    stops = []

    class StopAtOne:
        def on_step_end(self, args, state, control, **kwargs):
            stops.append((state.global_step, type(control)))
            control.should_training_stop = True

    trainer = make_trainer(tokenizer, tmp_path, ["training.max_steps=3"])
    trainer.callbacks = Callbacks([StopAtOne()], args=trainer.cfg, state=trainer.callbacks.state)
    history = trainer.train()
    assert len(history) == 1 and stops == [(1, Control)]
    assert trainer.saved.name == "final"
    assert "train_runtime" in trainer.callbacks.state.log_history[-1]


# ---------------------------------------------------------------- evaluation


def test_evaluate_a_dict_of_datasets_and_eval_dataset_attribute(tmp_path):
    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_list(ROWS[:2])
    trainer = GRPOTrainer(
        "tiny",
        length_reward,
        args=args(tmp_path, num_generations_eval=1),
        train_dataset=ROWS,
        eval_dataset=datasets.DatasetDict({"data1": split, "data2": split}),
    )
    assert set(trainer.eval_dataset) == {"data1", "data2"}
    metrics = trainer.evaluate()
    assert metrics["eval_data1_loss"] == 0.0  # a group of one has no advantage (TRL's rule)
    assert metrics["eval_data1_reward"] == metrics["eval_data2_reward"]  # same rows, same seeds
    assert metrics["eval_data1_reward_std"] == 0.0
    one = trainer.evaluate(eval_dataset=split, metric_key_prefix="test")
    assert one["test_reward"] == metrics["eval_data1_reward"]
    with pytest.raises(ConfigError, match="dict of datasets"):
        GRPOTrainer(
            "tiny",
            length_reward,
            args=args(tmp_path / "b", eval_strategy="steps", eval_steps=1),
            train_dataset=ROWS,
            eval_dataset={"a": ROWS[:2]},
        )


def test_eval_on_start_and_eval_steps(tmp_path):
    trainer = GRPOTrainer(
        "tiny",
        length_reward,
        args=args(tmp_path, max_steps=2, eval_on_start=True, eval_strategy="steps", eval_steps=1),
        train_dataset=ROWS,
        eval_dataset=ROWS[:2],
    )
    trainer.train()
    history = trainer.state.log_history
    assert "eval_loss" in history[0] and history[0]["step"] == 0  # before the first step
    # after step 1 (the last step's evaluation is eval.after's, off by default)
    assert [r["step"] for r in history if "eval_loss" in r] == [0, 1]


# ---------------------------------------------------------------- objects users pass


def test_a_peft_model_trains_its_own_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    tokenizer = char_tokenizer()
    base = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=4)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model,
        varied_reward,
        args=args(tmp_path, learning_rate=0.1),
        train_dataset=ROWS,
        processing_class=tokenizer,
    )
    assert trainer.model is model and trainer.config.model.lora.r == 4
    trainer.train()
    # `before` was taken on the host, before the trainer placed the model on its device
    changed = {
        n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach().cpu())
    }
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)
    frozen = peft.get_peft_model(
        tiny_model(tokenizer, hidden_size=32, num_layers=1),
        peft.LoraConfig(r=4, inference_mode=True),
    )
    with pytest.raises(ConfigError, match="is_trainable=True"):
        GRPOTrainer(
            frozen,
            length_reward,
            args=args(tmp_path / "b"),
            train_dataset=ROWS,
            processing_class=tokenizer,
        )


def test_reward_weights_for_several_functions(tmp_path):
    def one(completions, **kwargs):
        return [1.0] * len(completions)

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        "tiny", [one, zero], args=args(tmp_path, reward_weights=[0.7, 0.3]), train_dataset=ROWS
    )
    trainer.train()
    assert trainer.config.rewards.funcs == ["one", "zero"]
    assert trainer.state.log_history[-1]["reward"] == pytest.approx(0.7)  # TRL's test's check
    with pytest.raises(ConfigError, match="3 weights for 2"):
        GRPOTrainer(
            "tiny",
            [one, zero],
            args=args(tmp_path / "b", reward_weights=[1, 1, 1]),
            train_dataset=ROWS,
        )


def test_reward_processing_classes_for_a_reward_model(tmp_path, save_reward_model):
    model, tok = save_reward_model(tmp_path / "rm")
    tok.model_max_length = 77  # this object, not the saved tokenizer, is the one used
    trainer = GRPOTrainer(
        "tiny",
        [str(tmp_path / "rm"), model],
        args=args(tmp_path, max_steps=1),
        train_dataset=ROWS,
        reward_processing_classes=[tok, tok],
    )
    by_path, by_object = trainer.reward_funcs
    assert by_path.tokenizer is tok and by_object.tokenizer is tok and by_object.model is model
    trainer.train()
    row = trainer.state.log_history[0]
    # one model, scored twice: the same rewards
    first, second = trainer.reward_func_names
    assert row[f"rewards/{first}/mean"] == pytest.approx(row[f"rewards/{second}/mean"])


# ---------------------------------------------------------------- reward functions that log


def logging_reward(completions, log_metric, log_extra, **kwargs):
    log_metric("chars", float(sum(len(c) for c in completions)))
    log_extra("head", [c[:2] for c in completions])
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_log_metric_and_log_extra(tmp_path, isolation):
    trainer = GRPOTrainer(
        "tiny",
        logging_reward,
        args=args(
            tmp_path,
            log_completions=True,
            logging_steps=1,
            grpo_overrides=[*TINY, f"rewards.isolation={isolation}", "rewards.workers=2"],
        ),
        train_dataset=ROWS,
    )
    trainer.train()
    rows = trainer.state.log_history[:-1]
    for row in rows:
        # with 2 workers a batch is two calls, each logging its chunk's sum: their mean
        calls = 2 if isolation == "process" else 1
        assert row["chars"] == pytest.approx(4 * row["completions/mean_length"] / calls)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    assert samples and all(s["extra"]["head"] == s["completion"][:2] for s in samples)
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "chars" in metrics


def test_log_metric_refuses_what_is_not_a_finite_number(tmp_path, caplog):
    def bad(completions, log_metric, **kwargs):
        log_metric("x", math.nan)
        return [1.0] * len(completions)

    trainer = GRPOTrainer(
        "tiny", [bad, length_reward], args=args(tmp_path, max_steps=1), train_dataset=ROWS
    )
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "grpo: reward function 'bad': log_metric('x', nan)" in caplog.text
    assert trainer.state.log_history[0]["rewards/bad/errors"] == 1
    assert "x" not in trainer.state.log_history[0]


def test_reward_functions_without_kwargs_get_no_loggers():
    from grpo.rewards.worker import call_reward_logged

    class Scorer:
        def __call__(self, completions, prompts, completion_ids, answer):
            return [0.5] * len(completions)

    values, logs = call_reward_logged(
        Scorer(),
        {"completions": ["a"], "prompts": ["p"], "completion_ids": [[1]], "answer": [1]},
        1,
    )
    assert values == [0.5] and logs == {"metrics": {}, "extra": {}}


# ---------------------------------------------------------------- warnings TRL users rely on


def test_all_rewards_none_warns_as_trl(tmp_path, caplog):
    def nothing(completions, **kwargs):
        return [None] * len(completions)

    trainer = GRPOTrainer("tiny", nothing, args=args(tmp_path, max_steps=1), train_dataset=ROWS)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_level_with_token_summed_loss_warns(tmp_path, caplog, loss_type):
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(
            "tiny",
            length_reward,
            args=args(tmp_path, importance_sampling_level="sequence", loss_type=loss_type),
            train_dataset=ROWS,
        )
    assert ("weights each sequence by its completion length" in caplog.text) == (
        loss_type != "grpo"
    )


# ---------------------------------------------------------------- public helpers


def test_get_high_entropy_mask_is_trls(tmp_path):
    trl = pytest.importorskip("trl")
    trainer = GRPOTrainer("tiny", length_reward, args=args(tmp_path), train_dataset=ROWS)
    torch.manual_seed(0)
    entropies = torch.rand(3, 7) * 5
    mask = (torch.rand(3, 7) > 0.3).long()

    class OneProcess:  # what TRL's method reads of its trainer, on one process
        class accelerator:
            pad_across_processes = staticmethod(lambda t, dim, pad_index: t)
            gather = staticmethod(lambda t: t)

    for threshold in (0.0, 0.5, 0.8, 1.0):
        theirs = trl.GRPOTrainer.get_high_entropy_mask(OneProcess, entropies, mask, threshold)
        assert torch.equal(trainer.get_high_entropy_mask(entropies, mask, threshold), theirs)


def test_ref_model_and_off_policy_mask(tmp_path):
    trainer = GRPOTrainer("tiny", length_reward, args=args(tmp_path), train_dataset=ROWS)
    assert trainer.ref_model is None  # beta 0: no reference
    with_kl = GRPOTrainer(
        "tiny", length_reward, args=args(tmp_path / "b", beta=0.04), train_dataset=ROWS
    )
    assert isinstance(with_kl.ref_model, torch.nn.Module)
    assert not any(p.requires_grad for p in with_kl.ref_model.parameters())
    logp = torch.zeros(3, 2)
    sampling = torch.tensor([[0.2, 0.4], [1.0, 0.6], [1.0, 0.6]])
    keep = GRPOTrainer.get_off_policy_mask(
        torch.tensor([[-1.0], [-1.0], [1.0]]), logp, sampling, torch.ones(3, 2), 0.5
    )
    assert keep.tolist() == [[1.0], [0.0], [1.0]]
