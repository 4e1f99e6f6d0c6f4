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
from grpo import config as config_module
from grpo import trl_api
from grpo.config import ConfigError
from grpo.tiny import char_tokenizer, tiny_model
from grpo.trl_api import MAPPING, NO_EFFECT, GRPOConfig, GRPOTrainer

# The first seed's script (its "小さなモデルでの訓練例"), as written there but for
# `from trl import ...` -> `from grpo import ...` and its sizes: num_generations 8 -> 4,
# per_device_train_batch_size 64 -> 8, max_completion_length 160 -> 8, max_steps 300 -> 2,
# make_problems(4000) -> 40. `model` and `tokenizer` are the test's (the seed leaves out
# their loading).
SEED_SCRIPT = '''
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
'''


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
    monkeypatch.setattr(trl_api, "GRPOTrainer", _Spy)  # what `from grpo import GRPOTrainer` returns
    _Spy.calls.clear(), _Spy.made.clear()
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    exec(compile(SEED_SCRIPT, "seed_script", "exec"), {"__name__": "seed_script", "model": model, "tokenizer": tokenizer})

    (trainer,) = _Spy.made
    assert _Spy.calls == [("correctness_reward", 8)] * 2  # each step, num_generations x 2 prompts
    assert [row["step"] for row in trainer.state.log_history] == [1, 2]
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

    def arithmetic_reward_func(prompts, completions, answer, **kwargs):  # a closure: runs in a thread
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
        GRPOTrainer(model=model, reward_processing_class=tokenizer, args=training_args,
                    train_dataset=dataset, reward_funcs=arithmetic_reward_func)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=training_args,
                          train_dataset=dataset, reward_funcs=arithmetic_reward_func)
    cfg = trainer.config
    assert (cfg.algorithm.beta, cfg.training.max_grad_norm, cfg.logging.log_every) == (0.04, 1.0, 10)
    assert cfg.training.max_steps == 3  # one epoch of 3 prompts, 4 x 2 = 8 completions = 1 prompt a step
    out = trainer.train()
    assert calls == [8, 8, 8] and out.global_step == 3
    assert "kl" in trainer.state.log_history[-1]
    trainer.save_model()
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the mapping

EXTRA = {"overwrite_output_dir", "max_prompt_length", "grpo_overrides"}
"""GRPOConfig fields TRL 1.16's GRPOConfig does not have (older TRL / transformers had the first two)."""

# a value for each field that differs from its default, and the other fields it needs to act
CHANGES = {
    "output_dir": ("elsewhere", {}), "overwrite_output_dir": (True, {}),
    "num_generations": (4, {}), "max_completion_length": (64, {}), "max_prompt_length": (128, {}),
    "temperature": (0.7, {}), "top_p": (0.9, {}), "top_k": (50, {}),
    "beta": (0.04, {}), "epsilon": (0.1, {}), "epsilon_high": (0.28, {}), "delta": (2.0, {}),
    "loss_type": ("grpo", {}), "scale_rewards": (False, {}), "importance_sampling_level": ("sequence", {}),
    "num_iterations": (2, {}), "mask_truncated_completions": (True, {}), "reward_weights": ([2.0], {}),
    "sync_ref_model": (True, {"beta": 0.04}), "ref_model_sync_steps": (64, {"beta": 0.04, "sync_ref_model": True}),
    "ref_model_mixup_alpha": (0.9, {"beta": 0.04, "sync_ref_model": True}),
    "learning_rate": (5e-6, {}), "lr_scheduler_type": ("cosine", {}), "warmup_steps": (5, {}),
    "weight_decay": (0.1, {}), "adam_beta1": (0.8, {}), "adam_beta2": (0.99, {}), "adam_epsilon": (1e-6, {}),
    "max_grad_norm": (0.5, {}), "per_device_train_batch_size": (16, {}), "gradient_accumulation_steps": (2, {}),
    "max_steps": (7, {}), "num_train_epochs": (1.0, {}), "seed": (1, {}), "data_seed": (7, {}),
    "bf16": (False, {}), "gradient_checkpointing": (False, {}), "activation_checkpointing": (False, {}),
    "trust_remote_code": (True, {}), "use_cpu": (True, {}), "logging_steps": (1, {}), "report_to": ("tensorboard", {}),
    "run_name": ("r", {}), "save_strategy": ("no", {}), "save_steps": (20, {}), "save_total_limit": (2, {}),
    "eval_strategy": ("steps", {}), "eval_steps": (5, {"eval_strategy": "steps"}), "per_device_eval_batch_size": (4, {}),
}


def test_every_field_is_mapped_and_every_mapped_field_is_tested():
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(MAPPING) == fields - set(trl_api.CHECKED_ONLY)
    assert set(CHANGES) == set(MAPPING)
    default = config_module.Config()
    keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(default) if dataclasses.is_dataclass(getattr(default, s.name))
            for f in dataclasses.fields(getattr(default, s.name))} | {"output_dir", "overwrite_output_dir"}
    assert {key for key, _ in MAPPING.values()} <= keys


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own default
def test_defaults_are_trls():
    trl = pytest.importorskip("trl")
    theirs = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    for f in dataclasses.fields(GRPOConfig):
        if f.name in EXTRA:
            assert f.name not in theirs
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
    assert (cfg.logging.log_every, cfg.training.save_steps) == (resolved.logging_steps, resolved.save_steps)
    assert cfg.logging.report_to == resolved.report_to == []
    assert cfg.training.max_steps == 3 * 100 // (8 // 8)  # three epochs of 100 prompts, one prompt a step


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_each_field_changes_the_config(name):
    value, context = CHANGES[name]
    base = GRPOConfig(**context).to_config(num_rows=100).to_dict()
    changed = GRPOConfig(**{**context, name: value}).to_config(num_rows=100).to_dict()
    key, _ = MAPPING[name]
    get = lambda d: [d := d[part] for part in key.split(".")][-1]  # noqa: E731
    assert get(changed) != get(base), (name, key)


def test_units():
    # TRL counts optimizer steps; a grpo step is num_iterations of them
    cfg = GRPOConfig(max_steps=10, num_iterations=2, save_steps=4, logging_steps=3).to_config()
    assert (cfg.training.max_steps, cfg.training.save_steps, cfg.logging.log_every) == (5, 2, 2)
    # epochs: prompts per step = 16 x 2 / 8 = 4
    cfg = GRPOConfig(num_train_epochs=2, per_device_train_batch_size=16, gradient_accumulation_steps=2,
                     save_strategy="epoch", warmup_steps=0.1).to_config(num_rows=10)
    assert (cfg.training.max_steps, cfg.training.save_steps, cfg.training.warmup_steps) == (5, 3, 0)
    with pytest.raises(ConfigError, match="num_train_epochs"):
        GRPOConfig().to_config()


def test_refused_and_ignored_fields():
    with pytest.raises(TypeError, match="`fp16`.*bf16"):
        GRPOConfig(fp16=True)
    with pytest.raises(TypeError, match="`entropy_coef`"):
        GRPOConfig(entropy_coef=0.1)
    with pytest.raises(TypeError, match="`not_a_field`"):
        GRPOConfig(not_a_field=1)
    with pytest.warns(UserWarning, match="use_vllm.*vllm_server_port|vllm_server_port.*use_vllm"):
        args = GRPOConfig(use_vllm=True, vllm_server_port=9000)
    assert args.ignored == {"use_vllm": True, "vllm_server_port": 9000}
    with pytest.raises(ConfigError, match="generation_batch_size"):
        GRPOConfig(generation_batch_size=32).to_config(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(use_vllm=False, push_to_hub=False)  # switches left off: nothing to warn about
    for field_name, value in [("shuffle_dataset", False), ("disable_dropout", True), ("steps_per_generation", 4)]:
        with pytest.raises(ConfigError, match=field_name):
            GRPOConfig(**{field_name: value}).to_config(10)
    with pytest.raises(ConfigError, match="optim"):
        GRPOConfig(optim="sgd").to_config(10)
    # grpo's own check, naming the GRPOConfig fields that set the key
    with pytest.raises(ConfigError, match="GRPOConfig: num_generations"):
        GRPOConfig(num_generations=3).to_config(10)
    with pytest.raises(NotImplementedError, match="LoRA"):
        GRPOTrainer("tiny", lambda completions, **kw: [0.0] * len(completions), train_dataset=[{"prompt": "x"}],
                    peft_config=object())


def test_import_grpo_stays_light():
    import subprocess
    import sys

    code = "import sys, grpo; assert 'torch' not in sys.modules; grpo.GRPOConfig; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert grpo.GRPOTrainer is GRPOTrainer or grpo.GRPOTrainer is trl_api.GRPOTrainer


# ---------------------------------------------------------------- YAML and Python give one run

REWARD_FILE = "def length_reward(completions, **kwargs):\n    return [len(c) / 8 for c in completions]\n"


def test_yaml_run_and_python_run_are_the_same(tmp_path):
    from grpo.rewards import resolve
    from grpo.trainer import Trainer

    (tmp_path / "reward.py").write_text(REWARD_FILE)
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = f"{tmp_path / 'reward.py'}:length_reward"
    # TRL's defaults that are not grpo's are written out: seed 42 for the data too, bf16,
    # gradient checkpointing, a console line every 10 steps, a checkpoint every 500, eval batches of 8
    yaml_text = f"""
output_dir: {tmp_path / 'yaml'}
model: {{name: tiny, tiny_hidden_size: 32, tiny_num_layers: 1}}
data: {{task: jsonl, train_file: {tmp_path / 'train.jsonl'}, seed: 42}}
rollout: {{num_generations: 4, max_completion_length: 6, temperature: 0.9}}
rewards: {{funcs: ["{spec}"], isolation: thread}}
algorithm: {{beta: 0.04, epsilon_high: 0.28, loss_type: dr_grpo}}
training: {{max_steps: 3, per_device_train_batch_size: 4, gradient_accumulation_steps: 2, learning_rate: 1.0e-3,
           warmup_steps: 1, bf16: true, gradient_checkpointing: true, save_steps: 500}}
logging: {{log_every: 10, sample_every: 0}}
eval: {{batch_size: 8}}
"""
    (tmp_path / "run.yaml").write_text(yaml_text)
    cfg = config_module.load(tmp_path / "run.yaml")
    yaml_history = Trainer(cfg).train()

    args = GRPOConfig(
        output_dir=str(tmp_path / "python"), num_generations=4, max_completion_length=6, temperature=0.9,
        beta=0.04, epsilon_high=0.28, loss_type="dr_grpo", max_steps=3, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=1,
        grpo_overrides=["rewards.isolation=thread", "logging.sample_every=0",
                        "model.tiny_hidden_size=32", "model.tiny_num_layers=1"],
    )
    _, length_reward = resolve(spec)
    trainer = GRPOTrainer("tiny", length_reward, args=args, train_dataset=str(tmp_path / "train.jsonl"))
    trainer.train()

    ours, theirs = cfg.to_dict(), trainer.config.to_dict()
    for d in (ours, theirs):
        del d["output_dir"], d["data"]["task"], d["data"]["train_file"], d["rewards"]["funcs"]
    assert ours == theirs
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_second"} for r in rows]  # noqa: E731
    assert untimed(trainer.state.log_history) == untimed(yaml_history)
    assert len(yaml_history) == 3 and yaml_history[-1]["reward_std"] > 0


def test_resume_from_checkpoint(tmp_path):
    rows = [{"prompt": f"{a}+{a}="} for a in range(6)]

    def make(max_steps, run="run"):
        args = GRPOConfig(output_dir=str(tmp_path / run), num_generations=2, per_device_train_batch_size=4,
                          max_completion_length=4, max_steps=max_steps, save_steps=1, learning_rate=1e-3,
                          grpo_overrides=["model.tiny_hidden_size=32", "model.tiny_num_layers=1", "logging.sample_every=0"])
        return GRPOTrainer("tiny", lambda completions, **kw: [float(c.count("1")) for c in completions], args=args, train_dataset=rows)

    whole = make(3, "whole")
    whole.train()
    make(2).train()
    with pytest.raises(ConfigError, match="resume_from_checkpoint=True"):
        make(3).train()
    resumed = make(3)
    out = resumed.train(resume_from_checkpoint=True)
    assert out.global_step == 3 and [r["step"] for r in resumed.state.log_history] == [3]
    untimed = lambda row: {k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_second"}  # noqa: E731
    # the same step as the uninterrupted run's (bf16, TRL's default, rounds differently after a reload)
    assert untimed(resumed.state.log_history[0]) == pytest.approx(untimed(whole.state.log_history[-1]), rel=1e-3, abs=1e-6)


def test_reward_model_by_path_and_evaluate(tmp_path):
    from test_reward_model import save_reward_model

    save_reward_model(tmp_path / "rm")
    rows = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=4, max_steps=1, use_cpu=True,
                      grpo_overrides=["model.tiny_hidden_size=32", "model.tiny_num_layers=1", "logging.sample_every=0",
                                      "eval.temperatures=[0.0]"])
    tokenizer = char_tokenizer()
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden_size=32, num_layers=1), [str(tmp_path / "rm"), "arithmetic_correct"],
                          args=args, train_dataset=rows, eval_dataset=rows, processing_class=tokenizer)
    assert list(trainer.reward_funcs) == ["rm", "arithmetic_correct"]
    trainer.train()
    assert "rewards/rm/mean" in trainer.state.log_history[0]
    metrics = trainer.evaluate()
    assert set(metrics) == {"eval/greedy/accuracy", "eval/greedy/mean_reward"}


def test_rewards_defined_in_a_script_run_in_threads():
    def correctness(completions, **kw):
        return [0.0] * len(completions)

    correctness.__module__ = "__main__"  # as in `python script.py`, where a worker would re-run the script
    cfg = GRPOConfig(max_steps=1).to_config()
    with pytest.warns(UserWarning, match="correctness.*threads"):
        trl_api._script_rewards_in_threads({"correctness": correctness}, cfg, [])
    assert cfg.rewards.isolation == "thread"
    cfg = GRPOConfig(max_steps=1, grpo_overrides=["rewards.isolation=process"]).to_config()
    trl_api._script_rewards_in_threads({"correctness": correctness}, cfg, ["rewards.isolation=process"])
    assert cfg.rewards.isolation == "process"  # asked for: kept


def test_no_args_is_trls_default_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer("tiny", lambda completions, **kw: [0.0] * len(completions), train_dataset=[{"prompt": "1+1="}] * 3)
    assert trainer.config.output_dir == "tiny-GRPO" and trainer.config.training.max_steps == 9  # 3 epochs of 3 prompts, 1 a step
