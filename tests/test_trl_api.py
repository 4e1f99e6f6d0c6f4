"""grpo.GRPOConfig / grpo.GRPOTrainer: TRL scripts run on grpo by changing their import.

The seeds' scripts are copied here (SEED_SCRIPT: the first seed's, verbatim but for its
import line and its sizes) and run on a tiny random model; the mapping of every TRL field
is checked against TRL 1.16's GRPOConfig itself; a YAML run and a Python-API run of the
same settings give the same metrics.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import grpo
from grpo.config import loading as config_module
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.models.tiny import char_tokenizer, tiny_model
from grpo.trl import config as trl_config
from grpo.trl import trainer as trl_trainer
from grpo.trl.config import MAPPING, NO_EFFECT, GRPOConfig
from grpo.trl.lora import lora_keys
from grpo.trl.rewards import script_rewards_in_threads
from grpo.trl.trainer import GRPOTrainer

# The first seed's script (its "小さなモデルでの訓練例"), as written there but for
# `from trl import ...` -> `from grpo import ...` and its sizes: num_generations 8 -> 4,
# per_device_train_batch_size 64 -> 8, max_completion_length 160 -> 8, max_steps 300 -> 2,
# make_problems(4000) -> 40. `model` and `tokenizer` are the test's (the seed leaves out
# their loading).
SEED_SCRIPT = """
import random
import re

from datasets import Dataset
from grpo import GRPOConfig, GRPOTrainer

INSTRUCTION = 'Calculate {expression}. Show your work briefly, then write the last line as "Answer: <number>".'


def make_problems(count, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, c = rng.randint(11, 99), rng.randint(2, 9), rng.randint(11, 99)
        rows.append(
            {
                "prompt": [{"role": "user", "content": INSTRUCTION.format(expression=f"{a} * {b} + {c}")}],
                "answer": a * b + c,
            }
        )
    return rows


def extract_answer(text):
    found = re.findall(r"Answer:\\s*(-?\\d+)", text.replace(",", ""))
    return int(found[-1]) if found else None


def correctness_reward(completions, answer, **kwargs):
    return [float(extract_answer(c[0]["content"]) == a) for c, a in zip(completions, answer)]


config = GRPOConfig(
    output_dir="grpo_arithmetic_output",
    num_generations=4,               # 1 問あたりの回答数
    per_device_train_batch_size=8,   # 1 周で扱う回答数（2 問 × 4 個）
    max_completion_length=8,
    learning_rate=5e-6,
    max_steps=2,
    bf16=True,
)
trainer = GRPOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=correctness_reward,
    args=config,
    train_dataset=Dataset.from_list(make_problems(40, seed=0)),
)
trainer.train()
"""


class _Spy(GRPOTrainer):
    """The GRPOTrainer the script gets: records each reward call and the trainer. A random
    model never writes "Answer: N", so correctness alone gives no signal; a length reward
    is added so the update has one, and rewards run in threads (no worker processes)."""

    calls: list[tuple[str, int]] = []
    made: list[GRPOTrainer] = []

    def __init__(self, model, reward_funcs, args=None, **kwargs):
        def spying(fn):
            def call(completions, **kw):
                _Spy.calls.append((fn.__name__, len(completions)))
                return fn(completions=completions, **kw)

            call.__name__ = fn.__name__
            return call

        def length(completions, **kw):
            return [float(len(c[0]["content"])) for c in completions]

        args.grpo_overrides.append("rewards.isolation=thread")
        super().__init__(model, [spying(reward_funcs), length], args, **kwargs)
        _Spy.made.append(self)


def test_first_seed_script_runs_by_changing_the_import(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        trl_trainer, "GRPOTrainer", _Spy
    )  # what `from grpo import GRPOTrainer` returns
    _Spy.calls.clear(), _Spy.made.clear()
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    exec(
        compile(SEED_SCRIPT, "seed_script", "exec"),
        {"__name__": "seed_script", "model": model, "tokenizer": tokenizer},
    )

    (trainer,) = _Spy.made
    assert _Spy.calls == [("correctness_reward", 8)] * 2  # each step, num_generations x 2 prompts
    *steps, summary = trainer.state.log_history
    assert [row["step"] for row in steps] == [1, 2]
    assert summary["step"] == 2 and "train_runtime" in summary and "train_loss" in summary
    assert trainer.config.training.bf16 and trainer.config.rollout.num_generations == 4
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before)
    assert (tmp_path / "grpo_arithmetic_output" / "final" / "model.safetensors").is_file()


def _third_seed_reward(prompts, completions, answer, **kwargs):
    # the third seed's reward function, as written there
    rewards = []
    for comp, true_ans in zip(completions, answer):
        score = 1.0 if str(true_ans) in comp else 0.0
        if score == 0.0 and len(comp) > 200:
            score -= 0.1
        rewards.append(score)
    return rewards


def test_third_seed_config_and_reward(tmp_path):
    calls = []

    def arithmetic_reward_func(
        prompts, completions, answer, **kwargs
    ):  # a closure: runs in a thread
        calls.append(len(completions))
        return _third_seed_reward(prompts, completions, answer, **kwargs)

    training_args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=5e-6,
        beta=0.04,
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="steps",
        num_generations=8,
        max_completion_length=8,  # 512 in the seed
        bf16=True,
    )
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=2)
    dataset = [{"prompt": f"{a} + {b} =", "answer": a + b} for a, b in [(1, 2), (3, 4), (2, 2)]]
    with pytest.raises(TypeError, match="reward_processing_classes"):
        GRPOTrainer(
            model=model,
            reward_processing_class=tokenizer,
            args=training_args,
            train_dataset=dataset,
            reward_funcs=arithmetic_reward_func,
        )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=training_args,
        train_dataset=dataset,
        reward_funcs=arithmetic_reward_func,
    )
    cfg = trainer.config
    assert (cfg.algorithm.beta, cfg.training.max_grad_norm, cfg.logging.log_every) == (
        0.04,
        1.0,
        10,
    )
    # one epoch of 3 prompts, 4 x 2 = 8 completions = 1 prompt a step
    assert cfg.training.max_steps == 3
    out = trainer.train()
    assert calls == [8, 8, 8] and out.global_step == 3
    assert "kl" in trainer.state.log_history[-1]
    trainer.save_model()
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the mapping

EXTRA = {"overwrite_output_dir", "max_prompt_length", "grpo_overrides"}
"""GRPOConfig fields TRL 1.16's GRPOConfig does not have (older TRL / transformers had the first two)."""
NEWER_TRANSFORMERS = {"activation_checkpointing"}
"""TrainingArguments fields that TRL's GRPOConfig has only with a newer transformers than the
oldest grpo supports (5.17 lacks these): grpo accepts them whatever is installed, with the default
of the transformers that has them."""

# a value for each field that differs from its default, and the other fields it needs to act
CHANGES = {
    "output_dir": ("elsewhere", {}),
    "overwrite_output_dir": (True, {}),
    "num_generations": (4, {}),
    "max_completion_length": (64, {}),
    "max_prompt_length": (128, {}),
    "temperature": (0.7, {}),
    "top_p": (0.9, {}),
    "top_k": (50, {}),
    "min_p": (0.05, {}),
    "repetition_penalty": (1.1, {}),
    "chat_template_kwargs": ({"enable_thinking": False}, {}),
    "beta": (0.04, {}),
    "vespo_k_pos": (1.5, {"loss_type": "vespo"}),
    "vespo_lambda_pos": (2.5, {"loss_type": "vespo"}),
    "vespo_k_neg": (2.5, {"loss_type": "vespo"}),
    "vespo_lambda_neg": (1.5, {"loss_type": "vespo"}),
    "off_policy_mask_threshold": (0.5, {}),
    "use_bias_correction_kl": (False, {"beta": 0.04}),
    "multi_objective_aggregation": ("normalize_then_sum", {}),
    "entropy_coef": (0.01, {}),
    "use_adaptive_entropy": (True, {}),
    "entropy_target": (0.5, {"use_adaptive_entropy": True}),
    "entropy_coef_delta": (0.01, {"use_adaptive_entropy": True}),
    "entropy_coef_min": (0.001, {"use_adaptive_entropy": True}),
    "entropy_coef_max": (0.5, {"use_adaptive_entropy": True}),
    "epsilon": (0.1, {}),
    "epsilon_high": (0.28, {}),
    "delta": (2.0, {}),
    "loss_type": ("grpo", {}),
    "sapo_temperature_pos": (2.0, {}),
    "sapo_temperature_neg": (2.0, {}),
    "top_entropy_quantile": (0.2, {}),
    "max_tool_calling_iterations": (2, {}),
    "use_vllm": (True, {}),
    "vllm_enable_sleep_mode": (True, {"use_vllm": True}),
    "vllm_gpu_memory_utilization": (0.5, {"use_vllm": True}),
    "vllm_importance_sampling_correction": (False, {"use_vllm": True}),
    "vllm_importance_sampling_mode": ("token_truncate", {"use_vllm": True}),
    "vllm_importance_sampling_clip_max": (2.0, {"use_vllm": True}),
    "vllm_mode": ("server", {"use_vllm": True}),
    "vllm_server_base_url": ("http://127.0.0.1:9", {"use_vllm": True, "vllm_mode": "server"}),
    "vllm_server_host": ("127.0.0.1", {"use_vllm": True, "vllm_mode": "server"}),
    "vllm_server_port": (9000, {"use_vllm": True, "vllm_mode": "server"}),
    "vllm_server_timeout": (60.0, {"use_vllm": True, "vllm_mode": "server"}),
    "vllm_group_port": (5000, {"use_vllm": True, "vllm_mode": "server"}),
    "scale_rewards": (False, {}),
    "importance_sampling_level": ("sequence", {}),
    "num_iterations": (2, {}),
    "mask_truncated_completions": (True, {}),
    "reward_weights": ([2.0], {}),
    "sync_ref_model": (True, {"beta": 0.04}),
    "ref_model_sync_steps": (64, {"beta": 0.04, "sync_ref_model": True}),
    "ref_model_mixup_alpha": (0.9, {"beta": 0.04, "sync_ref_model": True}),
    "learning_rate": (5e-6, {}),
    "lr_scheduler_type": ("cosine", {}),
    "warmup_steps": (5, {}),
    "weight_decay": (0.1, {}),
    "adam_beta1": (0.8, {}),
    "adam_beta2": (0.99, {}),
    "adam_epsilon": (1e-6, {}),
    "max_grad_norm": (0.5, {}),
    "per_device_train_batch_size": (16, {}),
    "gradient_accumulation_steps": (2, {}),
    "max_steps": (7, {}),
    "num_train_epochs": (1.0, {}),
    "seed": (1, {}),
    "data_seed": (7, {}),
    "shuffle_dataset": (False, {}),
    "bf16": (False, {}),
    "gradient_checkpointing": (False, {}),
    "activation_checkpointing": (False, {}),
    "trust_remote_code": (True, {}),
    "use_cpu": (True, {}),
    "logging_steps": (1, {}),
    "report_to": ("tensorboard", {}),
    "log_completions": (True, {}),
    "run_name": ("r", {}),
    "save_strategy": ("no", {}),
    "save_steps": (20, {}),
    "save_total_limit": (2, {}),
    "eval_strategy": ("steps", {}),
    "eval_steps": (5, {"eval_strategy": "steps"}),
    "per_device_eval_batch_size": (4, {}),
    "eval_on_start": (True, {}),
}


def test_every_field_is_mapped_and_every_mapped_field_is_tested():
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(MAPPING) == fields - set(trl_config.CHECKED_ONLY)
    assert set(CHANGES) == set(MAPPING)

    def dotted(node, prefix=""):
        # a section's name too: a key may itself hold a mapping (data.chat_template_kwargs)
        for key, value in node.items():
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from dotted(value, f"{prefix}{key}.")

    keys = set(dotted(Config().to_dict()))  # every key of every (nested) section
    assert {key for key, _ in MAPPING.values()} <= keys


# TRL's own default
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_defaults_are_trls():
    trl = pytest.importorskip("trl")
    theirs = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    for f in dataclasses.fields(GRPOConfig):
        if f.name in EXTRA:
            assert f.name not in theirs
            continue
        if f.name in NEWER_TRANSFORMERS and f.name not in theirs:
            continue
        t = theirs[f.name]
        ours = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = t.default if t.default is not dataclasses.MISSING else t.default_factory()
        assert ours == default, f.name
    assert not NO_EFFECT - set(theirs) - {"logging_dir", "save_safetensors"}  # names TRL had
    # TRL's resolved defaults, where they are not grpo's: bf16 and checkpointing on, every 10 / 500 steps
    resolved = trl.GRPOConfig(output_dir="x", use_cpu=True)
    cfg = GRPOConfig(use_cpu=True).to_config(num_rows=100)
    assert cfg.training.bf16 is resolved.bf16 is True
    assert cfg.training.gradient_checkpointing is resolved.gradient_checkpointing is True
    assert (cfg.logging.log_every, cfg.training.save_steps) == (
        resolved.logging_steps,
        resolved.save_steps,
    )
    assert cfg.logging.report_to == resolved.report_to == []
    # three epochs of 100 prompts, one prompt a step
    assert cfg.training.max_steps == 3 * 100 // (8 // 8)


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_each_field_changes_the_config(name):
    value, context = CHANGES[name]
    base = GRPOConfig(**context).to_config(num_rows=100).to_dict()
    changed = GRPOConfig(**{**context, name: value}).to_config(num_rows=100).to_dict()
    key, _ = MAPPING[name]
    get = lambda d: [d := d[part] for part in key.split(".")][-1]  # noqa: E731
    assert get(changed) != get(base), (name, key)


def test_generation_kwargs_override_the_sampling_fields_and_refuse_the_rest():
    cfg = GRPOConfig(
        temperature=0.9,
        min_p=0.1,
        generation_kwargs='{"temperature": 0.7, "top_k": 5, "do_sample": true}',
        chat_template_kwargs='{"enable_thinking": false}',
    ).to_config(num_rows=100)
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.min_p) == (0.7, 5, 0.1)
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match=r"generation_kwargs\['num_beams'\]: not implemented"):
        GRPOConfig(generation_kwargs={"num_beams": 4}).to_config(num_rows=100)
    with pytest.raises(ConfigError, match=r"\['do_sample'\]: grpo always samples"):
        GRPOConfig(generation_kwargs={"do_sample": False}).to_config(num_rows=100)
    with pytest.raises(ConfigError, match="chat_template_kwargs: not JSON"):
        GRPOConfig(chat_template_kwargs="{enable").to_config(num_rows=100)


def test_reward_sources_and_their_processing_classes_are_checked_as_trl_does(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1)
    rows = [{"prompt": "1+1="}] * 4
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer("tiny", args=args, train_dataset=rows)
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer("tiny", "length_reward", args=args)
    # one tokenizer for two reward models: TRL reads it as a list of one, which must match
    with pytest.raises(ValueError, match=r"reward_processing_classes \(1\) must match .* \(2\)"):
        GRPOTrainer(
            "tiny",
            ["reward_model:a", "reward_model:b"],
            args=args,
            train_dataset=rows,
            reward_processing_classes=char_tokenizer(),
        )


def test_units():
    # TRL counts optimizer steps; a grpo step is num_iterations of them
    cfg = GRPOConfig(max_steps=10, num_iterations=2, save_steps=4, logging_steps=3).to_config()
    assert (cfg.training.max_steps, cfg.training.save_steps, cfg.logging.log_every) == (5, 2, 2)
    # epochs: prompts per step = 16 x 2 / 8 = 4
    cfg = GRPOConfig(
        num_train_epochs=2,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        save_strategy="epoch",
        warmup_steps=0.1,
    ).to_config(num_rows=10)
    assert (cfg.training.max_steps, cfg.training.save_steps, cfg.training.warmup_steps) == (5, 3, 0)
    with pytest.raises(ConfigError, match="num_train_epochs"):
        GRPOConfig().to_config()


def test_refused_and_ignored_fields():
    with pytest.raises(TypeError, match="`fp16`.*bf16"):
        GRPOConfig(fp16=True)
    with pytest.raises(TypeError, match="`cast_lm_head_to_fp32`"):
        GRPOConfig(cast_lm_head_to_fp32=True)
    with pytest.raises(TypeError, match="`not_a_field`"):
        GRPOConfig(not_a_field=1)
    with pytest.warns(UserWarning, match="vllm_max_model_length"):
        args = GRPOConfig(use_vllm=True, vllm_max_model_length=9000)
    # use_vllm is grpo's vllm engine
    assert args.ignored == {"vllm_max_model_length": 9000} and args.use_vllm
    with pytest.raises(ConfigError, match="generation_batch_size"):
        GRPOConfig(generation_batch_size=32).to_config(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # switches left off: nothing to warn about
        GRPOConfig(push_to_hub=False, hub_always_push=False)
    for field_name, value in [
        ("disable_dropout", True),
        ("steps_per_generation", 4),
    ]:
        with pytest.raises(ConfigError, match=field_name):
            GRPOConfig(**{field_name: value}).to_config(10)
    with pytest.raises(ConfigError, match="optim"):
        GRPOConfig(optim="sgd").to_config(10)
    # grpo's own check, naming the GRPOConfig fields that set the key
    with pytest.raises(ConfigError, match="GRPOConfig: num_generations"):
        GRPOConfig(num_generations=3).to_config(10)
    with pytest.raises(TypeError, match="peft_config must be a peft.LoraConfig"):
        GRPOTrainer(
            "tiny",
            lambda completions, **kw: [0.0] * len(completions),
            train_dataset=[{"prompt": "x"}],
            peft_config=object(),
        )


def test_import_grpo_stays_light():
    import subprocess
    import sys

    code = "import sys, grpo; assert 'torch' not in sys.modules; grpo.GRPOConfig; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert grpo.GRPOTrainer is GRPOTrainer or grpo.GRPOTrainer is trl_trainer.GRPOTrainer


# ---------------------------------------------------------------- YAML and Python give one run

REWARD_FILE = (
    "def length_reward(completions, **kwargs):\n    return [len(c) / 8 for c in completions]\n"
)


def test_yaml_run_and_python_run_are_the_same(tmp_path):
    from grpo.rewards.reward_set import resolve
    from grpo.training.trainer import Trainer

    (tmp_path / "reward.py").write_text(REWARD_FILE)
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = f"{tmp_path / 'reward.py'}:length_reward"
    # TRL's defaults that are not grpo's are written out: seed 42 for the data too, bf16,
    # gradient checkpointing, a console line every 10 steps, a checkpoint every 500, eval batches of 8
    yaml_text = f"""
output_dir: {tmp_path / "yaml"}
model: {{name: tiny, tiny_hidden_size: 32, tiny_num_layers: 1}}
data: {{task: jsonl, train_file: {tmp_path / "train.jsonl"}, seed: 42}}
rollout: {{num_generations: 4, max_completion_length: 6, temperature: 0.9}}
rewards: {{funcs: ["{spec}"], isolation: thread}}
algorithm: {{beta: 0.04, kl_bias_correction: true, epsilon_high: 0.28, loss_type: dr_grpo}}
training: {{max_steps: 3, per_device_train_batch_size: 4, gradient_accumulation_steps: 2, learning_rate: 1.0e-3,
           warmup_steps: 1, bf16: true, gradient_checkpointing: true, save_steps: 500}}
logging: {{log_every: 10, sample_every: 0}}
eval: {{batch_size: 8}}
"""
    (tmp_path / "run.yaml").write_text(yaml_text)
    cfg = config_module.load(tmp_path / "run.yaml")
    yaml_history = Trainer.from_config(cfg).train()

    args = GRPOConfig(
        output_dir=str(tmp_path / "python"),
        num_generations=4,
        max_completion_length=6,
        temperature=0.9,
        beta=0.04,
        epsilon_high=0.28,
        loss_type="dr_grpo",
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        warmup_steps=1,
        grpo_overrides=[
            "rewards.isolation=thread",
            "logging.sample_every=0",
            "model.tiny_hidden_size=32",
            "model.tiny_num_layers=1",
        ],
    )
    _, length_reward = resolve(spec)
    trainer = GRPOTrainer(
        "tiny", length_reward, args=args, train_dataset=str(tmp_path / "train.jsonl")
    )
    trainer.train()

    ours, theirs = cfg.to_dict(), trainer.config.to_dict()
    for d in (ours, theirs):
        del d["output_dir"], d["data"]["task"], d["data"]["train_file"], d["rewards"]["funcs"]
    assert ours == theirs
    untimed = lambda rows: [
        {k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_second"}
        for r in rows
    ]  # noqa: E731
    # exact: one config (above), so one Trainer computing the same operations on the same shapes
    # log_history: those rows with TRL's `epoch`, then transformers' summary row
    assert untimed(
        [{k: v for k, v in r.items() if k != "epoch"} for r in trainer.state.log_history[:-1]]
    ) == untimed(yaml_history)
    # the runs had a learning signal
    assert len(yaml_history) == 3 and any(h["reward_std"] > 0 for h in yaml_history)


def test_resume_from_checkpoint(tmp_path):
    rows = [{"prompt": f"{a}+{a}="} for a in range(6)]

    def make(max_steps, run="run"):
        args = GRPOConfig(
            output_dir=str(tmp_path / run),
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=4,
            max_steps=max_steps,
            save_steps=1,
            learning_rate=1e-3,
            grpo_overrides=[
                "model.tiny_hidden_size=32",
                "model.tiny_num_layers=1",
                "logging.sample_every=0",
            ],
        )
        return GRPOTrainer(
            "tiny",
            lambda completions, **kw: [float(c.count("1")) for c in completions],
            args=args,
            train_dataset=rows,
        )

    whole = make(3, "whole")
    whole.train()
    make(2).train()
    with pytest.raises(ConfigError, match="resume_from_checkpoint=True"):
        make(3).train()
    resumed = make(3)
    out = resumed.train(resume_from_checkpoint=True)
    assert out.global_step == 3 and [r["step"] for r in resumed.state.log_history] == [3, 3]
    untimed = lambda row: {
        k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_second"
    }  # noqa: E731
    # the same step as the uninterrupted run's (bf16, TRL's default, rounds differently after a reload)
    assert untimed(resumed.state.log_history[0]) == pytest.approx(
        untimed(whole.state.log_history[-2]), rel=1e-3, abs=1e-6
    )


def test_reward_model_by_path_and_evaluate(tmp_path, save_reward_model):
    save_reward_model(tmp_path / "rm")
    rows = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(4)]
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_steps=1,
        use_cpu=True,
        grpo_overrides=[
            "model.tiny_hidden_size=32",
            "model.tiny_num_layers=1",
            "logging.sample_every=0",
            "eval.temperatures=[0.0]",
        ],
    )
    tokenizer = char_tokenizer()
    trainer = GRPOTrainer(
        tiny_model(tokenizer, hidden_size=32, num_layers=1),
        [str(tmp_path / "rm"), "arithmetic_correct"],
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
        processing_class=tokenizer,
    )
    assert trainer.reward_func_names == ["rm", "arithmetic_correct"]
    trainer.train()
    assert "rewards/rm/mean" in trainer.state.log_history[0]
    metrics = trainer.evaluate()
    # grpo's measures (one decoding here), TRL's (sampled groups: loss and rewards), the timing
    assert {"eval_greedy/accuracy", "eval_greedy/mean_reward"} <= set(metrics)
    assert {"eval_loss", "eval_reward", "eval_rewards/rm/mean", "eval_runtime", "epoch"} <= set(
        metrics
    )
    assert trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]


def test_rewards_defined_in_a_script_run_in_threads():
    def correctness(completions, **kw):
        return [0.0] * len(completions)

    correctness.__module__ = (
        "__main__"  # as in `python script.py`, where a worker would re-run the script
    )
    cfg = GRPOConfig(max_steps=1).to_config()
    with pytest.warns(UserWarning, match="correctness.*threads"):
        script_rewards_in_threads({"correctness": correctness}, cfg, [])
    assert cfg.rewards.isolation == "thread"
    cfg = GRPOConfig(max_steps=1, grpo_overrides=["rewards.isolation=process"]).to_config()
    script_rewards_in_threads({"correctness": correctness}, cfg, ["rewards.isolation=process"])
    assert cfg.rewards.isolation == "process"  # asked for: kept


def test_no_args_is_trls_default_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(
        "tiny",
        lambda completions, **kw: [0.0] * len(completions),
        train_dataset=[{"prompt": "1+1="}] * 3,
    )
    # 3 epochs of 3 prompts, 1 a step
    assert trainer.config.output_dir == "tiny-GRPO" and trainer.config.training.max_steps == 9


# ---------------------------------------------------------------- log_completions, IterableDataset, trainer_state, peft_config

TINY = ["model.tiny_hidden_size=32", "model.tiny_num_layers=1", "rewards.isolation=thread"]


def test_log_completions_is_samples_every_logging_step():
    assert GRPOConfig(max_steps=1).to_config().logging.sample_every == 0  # TRL's default: none
    cfg = GRPOConfig(
        max_steps=20, log_completions=True, logging_steps=4, num_iterations=2
    ).to_config()
    assert cfg.logging.sample_every == 2  # every 4 optimizer steps = every 2 grpo steps


def _stream(count=None):
    import itertools

    from datasets import IterableDataset

    def rows():
        for a in itertools.count() if count is None else range(count):
            yield {"prompt": f"{a % 10}+1=", "answer": a % 10 + 1, "index": a}

    return IterableDataset.from_generator(rows)


def test_iterable_dataset_is_read_as_far_as_the_run_goes(tmp_path):
    seen = []

    def index_reward(completions, index, **kw):
        seen.extend(index)
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=3,
        max_steps=3,
        grpo_overrides=[*TINY, "eval.num_problems=3"],
    )
    # an endless stream: 3 steps x 2 prompts are taken, and 3 held-out rows
    trainer = GRPOTrainer(
        "tiny", index_reward, args=args, train_dataset=_stream(), eval_dataset=_stream()
    )
    assert [r["index"] for r in trainer.trainer.task.train_rows] == list(range(6))
    assert [r["index"] for r in trainer.trainer.task.eval_rows] == [0, 1, 2]
    trainer.train()
    assert sorted(set(seen)) == list(range(6)) and len(seen) == 12  # each row once, in G copies
    with pytest.raises(ValueError, match="IterableDataset.*set GRPOConfig.max_steps"):
        GRPOTrainer(
            "tiny",
            index_reward,
            args=GRPOConfig(output_dir=str(tmp_path / "b")),
            train_dataset=_stream(4),
        )
    with pytest.raises(ValueError, match="yielded no rows"):
        GRPOTrainer("tiny", index_reward, args=args, train_dataset=_stream(0))
    with pytest.raises(
        ValueError, match="eval_dataset is an IterableDataset of more than 10000 rows"
    ):
        GRPOTrainer(
            "tiny",
            index_reward,
            args=GRPOConfig(output_dir=str(tmp_path / "c"), max_steps=1, grpo_overrides=TINY),
            train_dataset=_stream(4),
            eval_dataset=_stream(),
        )
    short = GRPOTrainer("tiny", index_reward, args=args, train_dataset=_stream(4))
    # a shorter stream: gone through again, as epochs
    assert len(short.trainer.task.train_rows) == 4


def step_reward(completions, trainer_state, **kwargs):
    """A reward function as TRL's docs write one: shaped by the trainer's progress."""
    return [float(trainer_state.global_step) + trainer_state.epoch / 100 for _ in completions]


def test_reward_functions_get_trainer_state_in_worker_processes(tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=3,
        max_steps=6,
        num_iterations=2,
        grpo_overrides=[
            "model.tiny_hidden_size=32",
            "model.tiny_num_layers=1",
            "rewards.isolation=process",
            "rewards.workers=1",
            "logging.sample_every=0",
        ],
    )
    rows = [{"prompt": f"{a}+1="} for a in range(4)]  # 2 prompts a step: an epoch is 2 steps
    trainer = GRPOTrainer("tiny", step_reward, args=args, train_dataset=rows)
    assert trainer.trainer.rewards.executor.in_worker(0)  # pickled to a worker, not run in a thread
    trainer.train()
    means = [row["rewards/step_reward/mean"] for row in trainer.state.log_history[:-1]]
    # optimizer steps before each grpo step (num_iterations 2 each), and the epoch reached by its prompts
    assert means == pytest.approx([0 + 0.005, 2 + 0.01, 4 + 0.015])


def test_peft_config_maps_onto_model_lora():
    from peft import LoraConfig

    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.05,
        target_modules=["v_proj", "q_proj"],
        task_type="CAUSAL_LM",
    )
    keys = lora_keys(lora)
    assert keys == {
        "model.lora.r": 4,
        "model.lora.alpha": 8.0,
        "model.lora.dropout": 0.05,
        "model.lora.target_modules": ["q_proj", "v_proj"],
    }
    cfg = GRPOConfig(max_steps=1).to_config(extra=keys)
    assert (
        cfg.model.lora.r,
        cfg.model.lora.alpha,
        cfg.model.lora.dropout,
        cfg.model.lora.target_modules,
    ) == (4, 8.0, 0.05, ["q_proj", "v_proj"])
    assert lora_keys(LoraConfig(target_modules="all-linear"))["model.lora.target_modules"] == [
        "all-linear"
    ]
    tokenizer = char_tokenizer()  # None: peft's choice for the architecture (Llama: q_proj, v_proj)
    targets = lora_keys(LoraConfig(), tiny_model(tokenizer, hidden_size=32, num_layers=1))[
        "model.lora.target_modules"
    ]
    assert targets == ["q_proj", "v_proj"]
    for settings, named in [
        ({"use_dora": True}, "use_dora=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save="),
        ({"use_rslora": True}, "use_rslora"),
        ({"init_lora_weights": "gaussian"}, "init_lora_weights='gaussian'"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern="),
    ]:
        with pytest.raises(ConfigError, match=f"peft_config sets {named}"):
            lora_keys(LoraConfig(**settings))
    with pytest.raises(ConfigError, match="task_type=SEQ_CLS"):
        lora_keys(LoraConfig(task_type="SEQ_CLS"))
    with pytest.raises(ConfigError, match="regular expression"):
        lora_keys(LoraConfig(target_modules=r".*\.q_proj"))


def test_peft_config_trains_only_the_adapter(tmp_path):
    from peft import LoraConfig, PeftModel

    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=4)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=4,
        max_steps=2,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        grpo_overrides=["rewards.isolation=thread", "logging.sample_every=0"],
    )
    rows = [{"prompt": f"{a}+{a}="} for a in range(4)]
    trainer = GRPOTrainer(
        model,
        lambda completions, **kw: [float(c.count("1")) - len(c) / 4 for c in completions],
        args=args,
        train_dataset=rows,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.config.model.lora.r == 4
    # as in TRL, trainer.model is the PeftModel, around the module grpo trains in place
    assert isinstance(trainer.model, PeftModel) and trainer.model.get_base_model() is model
    trainer.train()
    adapter = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert adapter and all(p.requires_grad for p in adapter.values())
    # B starts at 0: it learned
    assert any(p.abs().max() > 0 for n, p in adapter.items() if "lora_B" in n)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            # `before` was taken on the host, before the trainer placed the model on its device
            assert not p.requires_grad and torch.equal(
                p.detach().cpu(), before[name.replace(".base_layer", "")]
            ), name


def test_log_completions_sends_a_table_to_wandb(tmp_path, monkeypatch):
    import sys
    import types

    logged = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: object()
    fake.log = lambda metrics, step=None: logged.append((metrics, step))
    fake.finish = lambda: None

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    fake.Table = Table
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=3,
        max_steps=2,
        logging_steps=2,
        log_completions=True,
        report_to="wandb",
        grpo_overrides=TINY,
    )
    GRPOTrainer(
        "tiny",
        lambda completions, **kw: [1.0] * len(completions),
        args=args,
        train_dataset=[{"prompt": f"{a}="} for a in range(4)],
    ).train()
    tables = [(m["completions"], step) for m, step in logged if "completions" in m]
    assert [step for _, step in tables] == [1, 2]  # the first step, then every logging_steps
    table = tables[-1][0]
    # one per group
    assert table.columns[:4] == ["step", "prompt", "completion", "reward"] and len(table.data) == 2
    assert all(row[0] == 2 and row[3] == 1.0 for row in table.data)


@pytest.mark.parametrize(
    "loss_type, policy_loss, aggregation",
    [
        ("cispo", "cispo", "dapo"),
        ("sapo", "sapo", "grpo"),
        ("dr_grpo", "clipped", "dr_grpo"),
        ("dapo", "clipped", "dapo"),
    ],
)
def test_trl_loss_type_splits_into_policy_loss_and_aggregation(loss_type, policy_loss, aggregation):
    # CISPO's cap, as TRL's docs advise
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    cfg = GRPOConfig(loss_type=loss_type, **extra).to_config(num_rows=100)
    assert (cfg.algorithm.policy_loss, cfg.algorithm.loss_type) == (policy_loss, aggregation)


def test_top_entropy_quantile_keeps_trls_scope():
    cfg = GRPOConfig(top_entropy_quantile=0.2).to_config(num_rows=100)
    assert (cfg.algorithm.top_entropy_quantile, cfg.algorithm.entropy_mask_scope) == (0.2, "batch")


def test_vllm_fields_map_onto_the_vllm_engine_and_trls_correction():
    cfg = GRPOConfig(use_vllm=True).to_config(num_rows=100)
    assert cfg.rollout.engine == "vllm"
    # TRL 1.16 corrects for vLLM's sampling by default: sequence-level, ratios above 3 masked
    assert (cfg.algorithm.rollout_correction, cfg.algorithm.rollout_correction_cap) == (
        "sequence_mask",
        3.0,
    )
    plain = GRPOConfig().to_config(num_rows=100)
    # no vLLM: grpo's default, no correction in a synchronous run (as TRL)
    from grpo.config.algorithm import resolved_rollout_correction

    correction = resolved_rollout_correction(plain.algorithm.rollout_correction, 0)
    assert (plain.rollout.engine, correction) == ("hf", "none")
    with pytest.raises(ConfigError, match="vllm_mode='remote': colocate .* or server"):
        GRPOConfig(vllm_mode="remote").to_config(num_rows=100)
    # TRL's server mode is grpo's server engine, at vllm_server_base_url or host and port
    served = GRPOConfig(
        use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.2", vllm_server_timeout=30
    ).to_config(num_rows=100)
    assert (served.rollout.engine, served.rollout.server.url) == ("server", "http://10.0.0.2:8000")
    assert (served.rollout.server.timeout, served.rollout.server.group_port) == (30.0, 51216)
    assert served.algorithm.rollout_correction == "sequence_mask"  # TRL corrects there too
    with pytest.raises(ConfigError, match="vllm_importance_sampling_clip_min"):
        GRPOConfig(use_vllm=True, vllm_importance_sampling_clip_min=0.5).to_config(num_rows=100)


def test_a_trl_field_of_grpos_meaning_and_default_is_declared_once():
    """A TRL field that sets a grpo key as it is, with the same default, is a SAME_MEANING row,
    its type and default taken from grpo's config; no such field is declared again by hand."""
    import dataclasses

    from grpo.config.schema import Config
    from grpo.trl.config import MAPPING, SAME_MEANING, GRPOConfig, _Fields

    defaults, mine = Config(), {f.name: f for f in _Fields.__dataclass_fields__.values()}
    hand_declared = {
        f.name for f in dataclasses.fields(_Fields) if f.name in _Fields.__annotations__
    }

    def grpo_default(key):
        value = defaults
        for part in key.split("."):
            value = getattr(value, part)
        return value

    args = GRPOConfig()
    for name, key in SAME_MEANING.items():
        assert getattr(args, name) == grpo_default(key), name
        assert name not in hand_declared, f"{name} is declared by hand and in SAME_MEANING"
    twice = [
        name
        for name, (key, how) in MAPPING.items()
        if how is None
        and name in hand_declared
        and mine[name].default is not dataclasses.MISSING
        and mine[name].default == grpo_default(key)
    ]
    assert not twice, (
        f"declared again by hand with grpo's default: {twice} (make them SAME_MEANING rows)"
    )
