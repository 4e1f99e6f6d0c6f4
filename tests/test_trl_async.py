"""grpo.AsyncGRPOConfig / grpo.AsyncGRPOTrainer: a script written for TRL's experimental
asynchronous trainer trains here with only its import changed, against a generation server the
test starts (`grpo serve` in a thread of this process); the fields it takes are TRL 1.16's, with
TRL's defaults; what would change what is trained is refused by name."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
from serve_settings import SERVED_TINY

import grpo
from grpo.config.errors import ConfigError
from grpo.models.tiny import char_tokenizer, tiny_model
from grpo.trl.async_grpo import ACCEPTED, THROUGHPUT

# TRL-style: a dataset, a reward function, AsyncGRPOConfig, AsyncGRPOTrainer, train(). Only the
# import is grpo's; MODEL, SERVER_URL and OUTPUT_DIR are the test's.
SCRIPT = """
from datasets import Dataset
from grpo import AsyncGRPOConfig, AsyncGRPOTrainer


def reward_third(completions, **kwargs):
    return [float(bool(c) and ord(c[0]) % 3 == 0) for c in completions]


dataset = Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(1, 5) for b in range(1, 5)])
args = AsyncGRPOConfig(
    output_dir=OUTPUT_DIR,
    vllm_server_base_url=SERVER_URL,
    max_staleness=2,
    per_device_train_batch_size=16,
    num_generations=4,
    max_completion_length=3,
    max_steps=4,
    learning_rate=0.01,
    bf16=False,
    use_cpu=True,
    report_to="none",
)
trainer = AsyncGRPOTrainer(
    model=MODEL, reward_funcs=reward_third, args=args, train_dataset=dataset
)
trainer.train()
"""


def test_a_trl_style_async_script_trains_with_only_the_import_changed(tmp_path, serve_in_thread):
    model_dir = tmp_path / "model"
    tokenizer = char_tokenizer()
    tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    served = copy.deepcopy(SERVED_TINY)
    served["model"] = {"name": str(model_dir)}
    url = serve_in_thread(served).url
    namespace = {"MODEL": str(model_dir), "SERVER_URL": url, "OUTPUT_DIR": str(tmp_path / "run")}
    exec(compile(SCRIPT, "async_script.py", "exec"), namespace)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2]  # generated ahead, within 2
    assert all("rollout/is_weight" in r for r in rows)  # corrected (rollout_correction auto)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 4 and (tmp_path / "run" / "final").is_dir()
    cfg = trainer.config
    assert (cfg.rollout.engine, cfg.rollout.server.url, cfg.rollout.max_staleness) == (
        "server",
        url,
        2,
    )


def test_the_fields_are_trl_116s_with_its_defaults():
    trl_async = pytest.importorskip("trl.experimental.async_grpo")
    theirs = {f.name: f for f in dataclasses.fields(trl_async.AsyncGRPOConfig)}
    ours = {f.name: f for f in dataclasses.fields(grpo.AsyncGRPOConfig)}

    def default(f):
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    assert ACCEPTED <= set(theirs), sorted(ACCEPTED - set(theirs))
    assert {n: default(ours[n]) for n in ACCEPTED} == {n: default(theirs[n]) for n in ACCEPTED}
    for name in ("vllm_server_base_url", "max_staleness", "weight_sync_steps", "request_timeout"):
        assert name in ACCEPTED
    args = grpo.AsyncGRPOConfig("out")
    cfg = args.to_config(100)
    assert (cfg.rollout.engine, cfg.rollout.server.url) == ("server", "http://localhost:8000")
    assert (cfg.rollout.max_staleness, cfg.rollout.weight_sync_steps) == (4, 1)
    assert (cfg.rollout.server.request_timeout, cfg.rollout.server.weight_sync_timeout) == (
        600,
        1800,
    )
    assert (cfg.training.learning_rate, cfg.training.lr_scheduler_type) == (1e-6, "constant")
    assert (cfg.rollout.max_completion_length, cfg.model.dtype) == (2048, "float32")
    assert cfg.algorithm.rollout_correction == "auto" and cfg.algorithm.beta == 0.0


def test_what_would_differ_is_refused_by_name():
    with pytest.raises(
        TypeError, match="`beta` \\(GRPOConfig has it; TRL's AsyncGRPOConfig does not\\)"
    ):
        grpo.AsyncGRPOConfig(beta=0.04)
    with pytest.raises(TypeError, match="AsyncGRPOConfig: grpo does not implement TRL's `fp16`"):
        grpo.AsyncGRPOConfig(fp16=True)
    with pytest.raises(ConfigError, match="`router_aux_loss_coef`"):
        grpo.AsyncGRPOConfig(router_aux_loss_coef=0.01).to_config(10)
    with pytest.raises(ConfigError, match="AsyncGRPOConfig.dtype='auto'"):
        grpo.AsyncGRPOConfig(dtype="auto").to_config(10)
    with pytest.raises(ConfigError, match="rollout.weight_sync_steps: must be in \\[1, "):
        grpo.AsyncGRPOConfig(max_staleness=1, weight_sync_steps=4).to_config(10)
    with pytest.raises(ConfigError, match="TRL's internal rollout_worker"):
        grpo.AsyncGRPOTrainer("tiny", rollout_worker=object())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo.AsyncGRPOConfig(max_inflight_tasks=64, queue_maxsize=1024)
    said = [str(w.message) for w in caught if "without effect" in str(w.message)]
    assert len(said) == 1 and "max_inflight_tasks" in said[0] and "queue_maxsize" not in said[0]
    assert set(THROUGHPUT) <= ACCEPTED
    # grpo's own way to its keys, which the refusals above point to, is taken as GRPOConfig takes it
    args = grpo.AsyncGRPOConfig(grpo_overrides=["rollout.max_staleness=1", "algorithm.beta=0.04"])
    cfg = args.to_config(10)
    assert (cfg.rollout.max_staleness, cfg.algorithm.beta) == (1, 0.04)
    for wrong in ("rollout.max_staleness=1", [3]):  # a string would be read letter by letter
        with pytest.raises(ConfigError, match="grpo_overrides: a list of 'section.key=value'"):
            grpo.AsyncGRPOConfig(grpo_overrides=wrong).to_config(10)
