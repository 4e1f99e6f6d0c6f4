import copy
import json
import math

import pytest
import torch

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.models.tiny import tiny_model
from grpo.rollout import Rollout
from grpo.training.batching import GenerationBatch, microbatches, minibatches
from grpo.training.trainer import Trainer


def test_learns_toy_task(tokenizer, tmp_path, make_trainer):
    """A random-initialised model learns to answer a+b= with the right digit."""
    trainer = make_trainer(tokenizer, tmp_path)
    history = trainer.train()
    first = sum(h["reward"] for h in history[:10]) / 10
    last = sum(h["reward"] for h in history[-10:]) / 10
    assert first < 0.3, first
    assert last > 0.8, last
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 200
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert (tmp_path / "run" / "config.yaml").exists()


def test_metrics_have_trl_names(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        ["training.max_steps=2", "algorithm.beta=0.04", "training.per_device_train_batch_size=32"],
    )
    history = trainer.train()
    m = history[-1]
    for key in [
        "reward",
        "reward_std",
        "rewards/correct/mean",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "time/step",
        "tokens_per_second",
        "learning_rate",
        "grad_norm",
    ]:
        assert key in m, key
        assert isinstance(m[key], (int, float)) and not math.isnan(m[key]), key
    assert m["entropy"] > 0
    assert m["kl"] >= 0
    saved = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert saved["step"] == 2


def _hand_batch(trainer, seed=0):
    """A generation batch with varied completion lengths and varied rewards (so non-zero advantages:
    Trainer.update computes them from the rewards, in its advantages phase)."""
    g = torch.Generator().manual_seed(seed)
    N, Lp, T = 16, 5, 6
    prompt_ids = torch.randint(5, 95, (N, Lp), generator=g)
    prompt_mask = torch.ones(N, Lp, dtype=torch.long)
    prompt_mask[::3, :2] = 0
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(5, 95, (N, T), generator=g) * completion_mask
    # drawn on the host from one seed (the same batch on any device), placed as the engine would
    # place it: on the model's device; the rewards stay host-side, as the reward functions' are
    device = trainer.backend.device
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths == T)
    rollout = rollout.to(device)
    completion_mask = rollout.completion_mask
    rewards = torch.randn(N, generator=g)
    return GenerationBatch(
        rows=[{}] * N,
        prompts=[""] * N,
        completions=[""] * N,
        completion_texts=[""] * N,
        rollout=rollout,
        rewards_per_func=rewards[:, None],
        rewards=rewards,
        loss_mask=completion_mask.clone(),
    )


def _gradient(
    make_trainer, tokenizer, tmp_path, loss_type, minibatch, model_state, batch, extra=()
):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            f"algorithm.loss_type={loss_type}",
            f"training.per_device_train_batch_size={minibatch}",
            f"training.gradient_accumulation_steps={16 // minibatch}",
            "training.learning_rate=0.0",
            "training.max_grad_norm=0",
            "rollout.num_generations=4",
            "rollout.max_completion_length=6",
            *extra,
        ],
    )
    trainer.model.load_state_dict(model_state)
    if trainer.reference.enabled:
        trainer.reference.model.load_state_dict(model_state)
    trainer.update(batch)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("extra", [(), ("algorithm.beta=0.04",), ("training.bf16=true",)])
def test_gradient_independent_of_minibatch_split(
    tokenizer, tmp_path, loss_type, extra, make_trainer
):
    """One optimizer step's gradient is the same for 1 minibatch of 16 or 4 of 4 with accumulation."""
    state = copy.deepcopy(tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=7).state_dict())
    trainer = make_trainer(tokenizer, tmp_path)
    batch = _hand_batch(trainer)
    whole = _gradient(make_trainer, tokenizer, tmp_path, loss_type, 16, state, batch, extra)
    split = _gradient(make_trainer, tokenizer, tmp_path, loss_type, 4, state, batch, extra)
    assert whole.keys() == split.keys() and whole
    tol = 2e-2 if extra == ("training.bf16=true",) else 1e-5
    for name in whole:
        torch.testing.assert_close(
            split[name],
            whole[name],
            atol=tol * whole[name].abs().max().item() + 1e-8,
            rtol=tol,
            msg=name,
        )
    # the gradient is not trivially zero
    assert max(g.abs().max().item() for g in whole.values()) > 1e-4


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("extra", [(), ("algorithm.beta=0.04",), ("training.bf16=true",)])
def test_gradient_independent_of_microbatches(tokenizer, tmp_path, loss_type, extra, make_trainer):
    """Splitting each minibatch into token-bounded micro-batches leaves the gradient unchanged,
    bnpo included (it normalises by the whole minibatch's tokens)."""
    state = copy.deepcopy(tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=7).state_dict())
    batch = _hand_batch(make_trainer(tokenizer, tmp_path))
    whole = _gradient(make_trainer, tokenizer, tmp_path, loss_type, 8, state, batch, extra)
    split = _gradient(
        make_trainer,
        tokenizer,
        tmp_path,
        loss_type,
        8,
        state,
        batch,
        (*extra, "training.microbatch_tokens=20"),
    )
    tol = 2e-2 if extra == ("training.bf16=true",) else 1e-5
    for name in whole:
        torch.testing.assert_close(
            split[name],
            whole[name],
            atol=tol * whole[name].abs().max().item() + 1e-8,
            rtol=tol,
            msg=name,
        )
    assert max(g.abs().max().item() for g in whole.values()) > 1e-4


def test_microbatches_respect_the_token_budget(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "rollout.num_generations=4",
            "training.per_device_train_batch_size=8",
            "training.gradient_accumulation_steps=2",
            "training.microbatch_tokens=24",
        ],
    )
    batch = _hand_batch(trainer)
    ro = batch.rollout
    for minibatch in minibatches(ro.lengths.tolist(), 4, 8):
        pieces = microbatches(ro, minibatch, 24)
        assert torch.equal(torch.cat(pieces), minibatch)  # every row once, order kept
        assert len(pieces) > 1
        for piece in pieces:
            prompts = {
                tuple(ro.prompt_ids[r][ro.prompt_mask[r].bool()].tolist()) for r in piece.tolist()
            }
            cost = sum(len(p) for p in prompts) + len(piece) * int(ro.lengths[piece].max())
            assert cost <= 24 or len(piece) == 1
    assert all(len(microbatches(ro, mb, 0)) == 1 for mb in minibatches(ro.lengths.tolist(), 4, 8))


def test_same_seed_same_run(tokenizer, tmp_path, make_trainer):
    a = make_trainer(tokenizer, tmp_path / "a", ["training.max_steps=3"]).train()
    b = make_trainer(tokenizer, tmp_path / "b", ["training.max_steps=3"]).train()
    keys = ["reward", "loss", "grad_norm", "entropy", "completions/mean_length"]
    # exact: the same run twice in one process, the same operations on the same shapes
    assert [[h[k] for k in keys] for h in a] == [[h[k] for k in keys] for h in b]


def third_of_first_characters(prompts, completions, **kwargs):
    """1 for a third of all first characters: a reward a random model earns, so groups have spread."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(bool(t) and ord(t[0]) % 3 == 0) for t in texts]


def test_num_iterations_and_clipping(tokenizer, tmp_path, make_trainer):
    """With several passes per batch the ratio moves away from 1 and clipping engages."""
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=2",
            "algorithm.num_iterations=4",
            "training.learning_rate=0.01",
            "algorithm.epsilon=0.05",
            "training.per_device_train_batch_size=32",
            "rollout.max_completion_length=3",
        ],
        # a reward a random model earns a third of the time: groups with spread, so the ratio moves
        reward_funcs={"third": third_of_first_characters},
    )
    history = trainer.train()
    assert all(h["frac_reward_zero_std"] < 1 for h in history)
    assert any(h["clip_ratio/region_mean"] > 0 for h in history)


def test_reference_sync_replaces_reference(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=2",
            "algorithm.beta=0.04",
            "algorithm.ref_sync_steps=2",
            "training.per_device_train_batch_size=32",
        ],
        reward_funcs={"third": third_of_first_characters},  # a learning signal, so the weights move
    )
    before = {n: p.clone() for n, p in trainer.reference.model.named_parameters()}
    trainer.train()
    ref = dict(trainer.reference.model.named_parameters())
    for n, p in trainer.model.named_parameters():
        assert torch.equal(ref[n], p), n
    assert any(not torch.equal(before[n], ref[n]) for n in before)


def test_failing_reward_is_missing_not_fatal(
    tokenizer, tmp_path, caplog, make_trainer, first_char_correct
):
    calls = {"n": 0}

    def flaky(completions, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("sandbox crashed")
        return [None] * (len(completions) // 2) + [1.0] * (len(completions) - len(completions) // 2)

    trainer = make_trainer(
        tokenizer,
        tmp_path,
        ["training.max_steps=2", "training.per_device_train_batch_size=32"],
        reward_funcs={"correct": first_char_correct, "flaky": flaky},
    )
    history = trainer.train()
    assert history[0]["rewards/flaky/failures"] == 1
    assert math.isnan(history[0]["rewards/flaky/mean"])
    assert history[1]["rewards/flaky/mean"] == 1.0
    assert "sandbox crashed" in caplog.text


def test_dynamic_sampling_keeps_groups_with_spread(tokenizer, tmp_path, make_trainer):
    def half_right(completions, **kw):
        # the first group of every batch has spread, the others are all zero
        return [float(i < 8 and i % 2 == 0) for i in range(len(completions))]

    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=1",
            "algorithm.dynamic_sampling=true",
            "algorithm.max_sampling_rounds=3",
            "training.per_device_train_batch_size=32",
            "rollout.num_generations=8",
        ],
        reward_funcs={"half": half_right},
    )
    batch = trainer.collect_batch()
    assert len(batch) == 32 and batch.sampling_rounds == 3
    # 3 rounds gave 3 groups with spread; the 4th slot is filled with a zero-spread group
    assert batch.zero_std_groups_kept == 1
    spread = batch.rewards.view(4, 8).std(1)
    assert (spread[:3] > 0).all() and spread[3] == 0


def test_mask_truncated_completions(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        ["algorithm.mask_truncated_completions=true", "training.per_device_train_batch_size=32"],
    )
    batch = trainer.collect_batch()
    # the tiny model never emits EOS in one token: every completion is truncated and masked out
    assert batch.rollout.truncated.all()
    assert batch.loss_mask.sum() == 0


def test_overlong_penalty_is_added_as_a_reward(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "rewards.overlong_buffer=1",
            "training.per_device_train_batch_size=32",
            "rollout.max_completion_length=2",
        ],
    )
    batch = trainer.collect_batch()
    assert trainer.rewards.names == ["correct", "overlong"]
    lengths = batch.rollout.lengths.cpu()  # the rewards are host-side
    # length 2 = max: penalty (1 - 2) / 1 = -1; length 1: 0
    expected = torch.where(lengths == 2, -1.0, 0.0)
    torch.testing.assert_close(batch.rewards_per_func[:, 1], expected)


def test_gradient_checkpointing_same_gradient(tokenizer, tmp_path, make_trainer):
    state = copy.deepcopy(tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=7).state_dict())
    batch = _hand_batch(make_trainer(tokenizer, tmp_path))
    plain = _gradient(make_trainer, tokenizer, tmp_path, "dapo", 8, state, batch)
    checkpointed = _gradient(
        make_trainer,
        tokenizer,
        tmp_path,
        "dapo",
        8,
        state,
        batch,
        ("training.gradient_checkpointing=true",),
    )
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_minibatches_group_similar_lengths(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "rollout.num_generations=4",
            "training.per_device_train_batch_size=4",
            "training.gradient_accumulation_steps=4",
        ],
    )
    batch = _hand_batch(trainer)
    pieces = minibatches(batch.rollout.lengths.tolist(), 4, 4)
    rows = torch.cat(pieces)
    assert sorted(rows.tolist()) == list(range(16))  # every row exactly once
    lengths = batch.rollout.lengths
    # whole groups, ordered by their longest completion
    assert all(len(set((mb // 4).tolist())) == 1 for mb in pieces)
    longest = [int(lengths[mb].max()) for mb in pieces]
    assert longest == sorted(longest)


def test_tied_embedding_sparse_gradient_equals_dense(
    tokenizer, tmp_path, toy_config, first_char_correct
):
    """A tied embedding's lookup sends a sparse gradient; the weight's total gradient is unchanged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    tied = LlamaForCausalLM(llama)
    grads = {}
    for sparse in (True, False):
        model = copy.deepcopy(tied)
        cfg = config.from_dict(
            {**toy_config, "output_dir": str(tmp_path / "run")},
            [
                "training.learning_rate=0.0",
                "training.max_grad_norm=0",
                "rollout.num_generations=4",
                "rollout.max_completion_length=6",
                "training.per_device_train_batch_size=16",
            ],
        )
        trainer = Trainer.from_config(
            cfg, model=model, tokenizer=tokenizer, reward_funcs={"correct": first_char_correct}
        )
        assert trainer.model.get_input_embeddings().sparse is True
        trainer.model.get_input_embeddings().sparse = sparse
        trainer.update(_hand_batch(trainer))
        weight = trainer.model.get_input_embeddings().weight
        assert not weight.grad.is_sparse
        grads[sparse] = weight.grad.clone()
    torch.testing.assert_close(grads[True], grads[False], atol=1e-6, rtol=1e-5)
    assert grads[True].abs().max() > 0


def test_refuses_to_overwrite_a_run(tokenizer, tmp_path, make_trainer):
    run = tmp_path / "run"
    # metrics.jsonl alone (no checkpoint yet) is simply run again
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / ".grpo.lock").write_text("")  # what every run leaves in its directory
    with pytest.raises(ConfigError, match="already holds a run"):
        make_trainer(tokenizer, tmp_path, ["training.max_steps=1"])
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=1",
            "overwrite_output_dir=true",
            "training.per_device_train_batch_size=32",
        ],
    )
    trainer.train()
    assert [
        json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
    ] == [1]


def test_evaluates_before_every_n_and_after(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=3",
            "training.per_device_train_batch_size=32",
            "eval.before=true",
            "eval.after=true",
            "eval.every=2",
        ],
    )
    trainer.train()
    results = [
        json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()
    ]
    # two decodings (greedy, temperature 1) per evaluation, on the 4 held-out problems
    assert [(r["label"], r["step"]) for r in results] == [
        ("before", 0),
        ("before", 0),
        ("step 2", 2),
        ("step 2", 2),
        ("after", 3),
        ("after", 3),
    ]
    assert all(r["n"] == 4 for r in results)
    assert (tmp_path / "run" / "report.md").exists()


def test_bf16_weights_train(tokenizer, tmp_path, toy_config, first_char_correct):
    """model.dtype=bfloat16 (bf16 weights, bf16 gradients) runs a step and moves the weights,
    the output layer's gradient included."""
    cfg = config.from_dict(
        {**toy_config, "output_dir": str(tmp_path / "run")},
        [
            "training.max_steps=1",
            "rollout.num_generations=4",
            "training.per_device_train_batch_size=16",
        ],
    )
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0, dtype=torch.bfloat16)
    trainer = Trainer.from_config(
        cfg, model=model, tokenizer=tokenizer, reward_funcs={"correct": first_char_correct}
    )
    batch = _hand_batch(trainer)
    trainer.update(batch)
    head = trainer.model.get_output_embeddings().weight
    assert head.dtype == torch.bfloat16 and head.grad.dtype == torch.bfloat16
    assert head.grad.abs().sum() > 0


def test_a_registered_estimator_is_what_the_step_uses(tokenizer, tmp_path, make_trainer):
    """A new advantage estimator is one registered function; the config picks it by name."""
    from grpo.registry import ADVANTAGE_ESTIMATORS

    seen = []

    @ADVANTAGE_ESTIMATORS.register("zero_test")
    def zero(inputs):
        seen.append((tuple(inputs.rewards.shape), inputs.group_size, inputs.scale_rewards))
        return torch.zeros_like(inputs.rewards)

    try:
        trainer = make_trainer(
            tokenizer,
            tmp_path,
            [
                "training.max_steps=1",
                "training.per_device_train_batch_size=32",
                "algorithm.advantage_estimator=zero_test",
                "algorithm.scale_rewards=none",
            ],
        )
        metrics, batch = trainer.train_step()
    finally:
        ADVANTAGE_ESTIMATORS.unregister("zero_test")
    assert seen == [((32,), 16, "none")]
    assert torch.equal(trainer.phases.advantages(batch, None), torch.zeros(32))
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0


def test_unknown_engine_fails_before_the_model_loads(tokenizer, tmp_path, make_trainer):
    with pytest.raises(ConfigError, match="rollout.engine: 'sglang' is not one of hf"):
        make_trainer(tokenizer, tmp_path, ["rollout.engine=sglang"])


def test_jsonl_task_without_answers_trains_and_evaluates_by_its_rewards(
    tokenizer, tmp_path, capsys, toy_config
):
    """Rows with no integer answer: training and the before/after evaluation use the reward functions."""
    rows = [{"prompt": f"{a}+{b}=", "target": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    for name, part in (("train", rows), ("eval", rows[:4])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))

    def starts_with_target(completions, target, **kw):
        return [float(c[:1] == t[:1]) for c, t in zip(completions, target)]

    cfg = config.from_dict(
        {
            **toy_config,
            "output_dir": str(tmp_path / "run"),
            "data": {
                "task": "jsonl",
                "train_file": str(tmp_path / "train.jsonl"),
                "eval_file": str(tmp_path / "eval.jsonl"),
                "chat_template": "never",
            },
            "eval": {"before": True, "after": True, "temperatures": [0.0]},
        },
        ["training.max_steps=2", "training.per_device_train_batch_size=32"],
    )
    trainer = Trainer.from_config(
        cfg,
        model=tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0),
        tokenizer=tokenizer,
        reward_funcs={"target": starts_with_target},
    )
    history = trainer.train()
    assert len(history) == 2 and "rewards/target/mean" in history[0]
    results = [
        json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()
    ]
    assert [(r["label"], r["counts"]) for r in results] == [("before", {}), ("after", {})]
    assert all(0.0 <= r["mean_reward"] <= 1.0 and set(r["rewards"]) == {"target"} for r in results)
    out = capsys.readouterr().out
    assert "mean reward (before) | mean reward (after)" in out
    assert (
        "Scored by the configured reward functions" in (tmp_path / "run" / "report.md").read_text()
    )


def test_console_eta_counts_training_steps_only(
    tokenizer, tmp_path, capsys, monkeypatch, make_trainer
):
    """A slow evaluation before training shows its own progress bar and does not enter the ETA."""
    import re
    import time

    from grpo.training.evaluate import Evaluator

    original = Evaluator.__call__

    def slow(self, label, step, progress=None):
        time.sleep(3.0)
        return original(self, label, step, progress)

    monkeypatch.setattr(Evaluator, "__call__", slow)
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=3",
            "training.per_device_train_batch_size=32",
            "eval.before=true",
            "logging.log_every=1",
            "eval.temperatures=[0.0]",
        ],
    )
    trainer.train()
    out = capsys.readouterr().out
    # the evaluation's bar: one batch of the 4 held-out problems
    assert "eval before" in out and "1/1" in out
    first = re.search(r"1/3 \|.*\| ([\d.]+)s/step \| ETA (\d+):(\d+)", out)
    assert first, out
    step_s, eta_s = float(first.group(1)), int(first.group(2)) * 60 + int(first.group(3))
    # two steps left at the first step's pace; counting the 3 s evaluation would give at least 6 s more
    assert eta_s <= 2 * step_s + 1


def test_logged_extra_columns_follow_the_completions_through_select_and_concat():
    # dynamic sampling selects groups and merges rounds: what log_extra wrote stays with its row
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 95, (4, 3), generator=g)
    ones = torch.ones(4, 3, dtype=torch.long)
    rollout = Rollout(ids, ones, ids, ones, torch.zeros(4, dtype=torch.bool))

    def batch(tags, extra):
        return GenerationBatch(
            [{}] * 4,
            [""] * 4,
            [""] * 4,
            tags,
            rollout,
            torch.zeros(4, 1),
            torch.zeros(4),
            ones,
            extra_columns=extra,
        )

    first = batch(["a", "b", "c", "d"], {"judge": ["A", "B", "C", "D"]})
    second = batch(["e", "f", "g", "h"], {})
    kept = GenerationBatch.concat([first.select(torch.tensor([3, 1])), second], pad_token_id=0)
    assert kept.completion_texts == ["d", "b", "e", "f", "g", "h"]
    assert kept.extra_columns == {"judge": ["D", "B", None, None, None, None]}
