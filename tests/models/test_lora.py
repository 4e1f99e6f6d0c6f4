"""LoRA through peft: only the adapter trains, the reference is the base model without a
copy (or a frozen adapter after resets), checkpoints hold the adapter and resume exactly,
exports merge it, fused decoding and the tiled logprobs compute the adapted model, and bad
settings fail at start-up naming the field."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.config.model_data import LoraConfig, ModelConfig
from grpo.config.training import CPUConfig
from grpo.cpu import kernels
from grpo.cpu.fused_decoding import FusedDecoder, fused_decoding_applies
from grpo.cpu.layer import CPULayer
from grpo.models import logprobs, lora
from grpo.models.tiny import tiny_model
from grpo.rewards.arithmetic import completion_text
from grpo.rollout.hf import TransformersSteps, left_pad
from grpo.run import checkpoint
from grpo.run.export import export_checkpoint
from grpo.training.reference import AdapterDisabled, FrozenAdapter, FrozenCopy
from grpo.training.trainer import Trainer

TOY = {
    "output_dir": "UNSET",
    "model": {"name": "tiny", "lora": {"r": 4, "alpha": 8.0}},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "instruction": "{expression}=",
            "num_eval": 4,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 2, "temperature": 1.0},
    "training": {
        "max_steps": 3,
        "per_device_train_batch_size": 16,
        "learning_rate": 0.02,
        "lr_scheduler_type": "constant",
    },
    "logging": {"log_every": 1000, "sample_every": 0},
    "rewards": {"isolation": "thread"},
}


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    from grpo.run import runlog

    # plots: seconds, not what is tested here
    monkeypatch.setattr(runlog.RunLog, "report", lambda self: None)


def third(completions, **kwargs):
    """A reward with spread for a random model: a third of all first characters."""
    texts = [completion_text(c) for c in completions]
    return [float(bool(t) and ord(t[0]) % 3 == 0) for t in texts]


def _cfg(tmp_path, overrides=()):
    return config.from_dict({**TOY, "output_dir": str(tmp_path / "run")}, list(overrides))


def _trainer(tokenizer, tmp_path, overrides=(), model=None, **kw):
    model = (
        model if model is not None else tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=0)
    )
    return Trainer.from_config(
        _cfg(tmp_path, overrides),
        model=model,
        tokenizer=tokenizer,
        reward_funcs={"third": third},
        **kw,
    )


def _base_weights(model):
    """The base model's weights by their names in the unadapted model."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" not in name:
            out[name.replace(".base_layer", "")] = p.detach().clone()
    return out


def _batch(tokenizer, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [tokenizer(t)["input_ids"] for t in ["1+2=", "3+4=", "hello", "ab"]][:n]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    completion = torch.randint(5, len(tokenizer), (ids.shape[0], 5), generator=gen)
    cmask = torch.ones_like(completion)
    cmask[1, 3:] = 0
    return ids, mask, completion, cmask


def _logp(model, batch):
    with torch.no_grad():
        return logprobs.completion_logprobs(model, *batch)[0]


# ------------------------------------------------------------------ 1. only the adapter trains


def test_only_the_adapter_trains_and_the_base_is_bitwise_unchanged(tokenizer, tmp_path):
    model = tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tokenizer, tmp_path, model=model)
    assert trainer.model is model  # adapted in place: the transformers model, not a wrapper
    assert lora.is_adapted(model)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # all-linear: every projection of every layer, never the output layer
    assert len(names) == 2 * 7 * 2
    optimized = {id(p) for group in trainer.state.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}
    # the CPU kernels reach the base layers inside peft's lora.Linear
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, kernels.CPULinear)
    adapter_before = {k: v.clone() for k, v in lora.adapter_parameters(model).items()}
    # starts as the base
    assert all(
        float(v.detach().abs().sum()) == 0 for k, v in adapter_before.items() if "lora_B" in k
    )
    trainer.train()
    after = _base_weights(model)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    changed = [
        k
        for k, v in lora.adapter_parameters(model).items()
        if not torch.equal(v, adapter_before[k])
    ]
    assert len(changed) == len(adapter_before)


def test_a_tied_model_with_a_frozen_base(tokenizer, tmp_path, gemma3_tiny):
    """Gemma ties its output layer to the embedding: with LoRA both are frozen, so no gradient is
    preallocated for them, the output layer's in-place weight gradient does not apply, and neither moves."""
    model = gemma3_tiny()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    embedding = model.get_input_embeddings().weight.detach().clone()
    trainer = _trainer(tokenizer, tmp_path, ["training.max_steps=2"], model=model)
    # the backend asks for the output weight's gradient in place, which a frozen weight never takes
    assert trainer.backend.output_layer_kernels().weight_grad_in_place
    output = trainer.model.get_output_embeddings().weight
    assert not output.requires_grad and output.grad is None
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    # preallocated
    assert all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)
    before = {k: v.detach().clone() for k, v in lora.adapter_parameters(trainer.model).items()}
    trainer.train()
    assert torch.equal(trainer.model.get_input_embeddings().weight, embedding)
    assert all(p.grad is None for p in frozen)
    assert any(
        not torch.equal(v, before[k]) for k, v in lora.adapter_parameters(trainer.model).items()
    )


def test_adapter_init_comes_from_the_seed(tokenizer, tmp_path):
    a = _trainer(tokenizer, tmp_path / "a").model
    torch.manual_seed(123)  # the global random state does not matter
    b = _trainer(tokenizer, tmp_path / "b").model
    c = _trainer(tokenizer, tmp_path / "c", ["training.seed=7"]).model
    pa, pb, pc = (lora.adapter_parameters(m) for m in (a, b, c))
    key = next(k for k in pa if "lora_A" in k)
    assert torch.equal(pa[key], pb[key]) and not torch.equal(pa[key], pc[key])


# ------------------------------------------------------------------ 2. the reference without a copy


def test_adapter_disabled_reference_is_the_base_model_exactly(tokenizer, tmp_path):
    model = tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=0)
    base = copy.deepcopy(model)  # the model before wrapping
    trainer = _trainer(tokenizer, tmp_path, ["algorithm.beta=0.04"], model=model)
    CPULayer(trainer.cfg.cpu).install(base)  # the same kernels as the policy's base layers
    assert isinstance(trainer.reference, AdapterDisabled)
    trainer.train()  # the adapter moves away from zero
    batch = _batch(tokenizer)
    with trainer.reference.module() as reference:
        assert reference is trainer.model
        ref = _logp(reference, batch)
    # exact: with the adapter disabled peft's layers call their base layers, the same CPULinear
    # products on the same shapes as the prepared copy's
    assert torch.equal(ref, _logp(base, batch))
    assert not torch.allclose(_logp(trainer.model, batch), ref)  # the adapter is back on after
    assert all(p.requires_grad for p in lora.adapter_parameters(trainer.model).values())


def test_a_lora_reference_holds_no_second_copy(tokenizer, tmp_path):
    def held(trainer):
        with trainer.reference.module() as reference:
            return sum(lora.held_tensors(trainer.model, reference).values())

    full = _trainer(tokenizer, tmp_path / "full", ["algorithm.beta=0.04", "model.lora.r=0"])
    adapted = _trainer(tokenizer, tmp_path / "lora", ["algorithm.beta=0.04"])
    assert isinstance(full.reference, FrozenCopy) and isinstance(adapted.reference, AdapterDisabled)
    policy_full = sum(lora.held_tensors(full.model).values())
    policy_lora = sum(lora.held_tensors(adapted.model).values())
    assert held(full) == 2 * policy_full  # a frozen copy of every weight
    assert held(adapted) == policy_lora  # nothing beyond the policy itself
    trainable, total = lora.parameter_counts(adapted.model)
    assert policy_lora - policy_full == trainable < total / 5


# ------------------------------------------------------------------ 3. reference resets


def test_reference_reset_is_a_frozen_copy_of_the_adapter(tokenizer, tmp_path):
    trainer = _trainer(
        tokenizer,
        tmp_path,
        ["algorithm.beta=0.04", "algorithm.ref_sync_steps=2", "training.max_steps=4"],
    )
    ref = trainer.reference
    assert isinstance(ref, FrozenAdapter)
    assert not any(p.requires_grad for p in ref.weights.values())
    optimized = {id(p) for g in trainer.state.optimizer.param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in ref.weights.values()}
    batch = _batch(tokenizer)
    base = _logp(trainer.model, batch)  # B = 0: the policy is the base model
    with ref.module() as m:
        # exact: both adapters' B is 0, so each adds exactly 0 to the same base layers
        assert torch.equal(_logp(m, batch), base)
    trainer.train_step()
    trainer.train_step()  # step 2: the reset
    at_sync = _logp(trainer.model, batch)
    with ref.module() as m:
        ref_at_sync = _logp(m, batch)
    # not bitwise: the same adapter weights through different modules (the policy's lora_A/B are
    # CPULinear, the reference adapter's plain nn.Linear: oneDNN vs MKL on AMD, the same MKL on
    # Intel), so the last bits may differ; a wrong or stale adapter differs by far more (below)
    torch.testing.assert_close(ref_at_sync, at_sync, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(at_sync, base, rtol=1e-3, atol=1e-3)
    trainer.train_step()  # step 3: the policy moves on, the reference stays
    policy = _logp(trainer.model, batch)
    with ref.module() as m:
        # exact: the same reference module, weights and batch as at the reset
        assert torch.equal(_logp(m, batch), ref_at_sync)
    assert not torch.allclose(policy, at_sync, rtol=1e-3, atol=1e-3)
    # switching adapters for the reference leaves the policy's adapter trainable, the reference's frozen
    assert all(p.requires_grad for p in lora.adapter_parameters(trainer.model).values())
    assert not any(p.requires_grad for p in ref.weights.values())
    state = ref.state_dict()
    assert state and all(".lora_" in k for k in state)
    assert sum(v.numel() for v in state.values()) == lora.parameter_counts(trainer.model)[0]


def test_reference_blend_works_on_the_adapter_weights(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, ["algorithm.beta=0.04", "algorithm.ref_sync_steps=1"])
    ref = trainer.reference
    trainer.train_step()
    policy = {k: v.detach().clone() for k, v in lora.adapter_parameters(trainer.model).items()}
    old = {k: v.clone() for k, v in ref.weights.items()}
    ref.sync(trainer.model, 0.25)
    for k, v in ref.weights.items():
        torch.testing.assert_close(v, 0.25 * policy[k] + 0.75 * old[k], rtol=0, atol=1e-7)


# ------------------------------------------------------------------ 4. checkpoints and resume


def test_checkpoint_holds_the_adapter_not_the_base(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path)
    trainer.train()
    final = tmp_path / "run" / "final"
    files = {p.name for p in final.iterdir()}
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "train_state.pt",
        "config.yaml",
        "manifest.json",
    } <= files
    assert "model.safetensors" not in files
    assert checkpoint.verify(final) == ""
    saved = load_file(final / "adapter_model.safetensors")
    assert sum(v.numel() for v in saved.values()) == lora.parameter_counts(trainer.model)[0]
    # loadable with peft onto the base model
    from peft import PeftModel

    base = tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=0)
    loaded = PeftModel.from_pretrained(base, final)
    batch = _batch(tokenizer)
    ids = torch.cat([batch[0], batch[2]], 1)
    mask = torch.cat([batch[1], batch[3]], 1)
    with torch.no_grad():
        ours = trainer.model(input_ids=ids, attention_mask=mask).logits
        theirs = loaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_resume_continues_a_lora_run_exactly(tokenizer, tmp_path):
    overrides = [
        "training.max_steps=4",
        "training.save_steps=2",
        "algorithm.beta=0.04",
        "algorithm.ref_sync_steps=1",
    ]
    whole = _trainer(tokenizer, tmp_path / "whole", overrides)
    history = whole.train()
    first = _trainer(tokenizer, tmp_path / "cut", [*overrides[1:], "training.max_steps=2"])
    first.train()
    cut = tmp_path / "cut" / "run"
    resumed = _trainer(tokenizer, tmp_path / "cut", overrides, resume=cut / "checkpoint-2")
    assert resumed.state.step == 2
    rest = resumed.train()
    skip = ("time/", "tokens_per_second")
    for a, b in zip(history[2:], rest):
        assert {k: v for k, v in a.items() if not k.startswith(skip)} == {
            k: v for k, v in b.items() if not k.startswith(skip)
        }
    for (k, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k  # exact: the same steps, computed the same way on this machine
    assert whole.reference.state_dict().keys() == resumed.reference.state_dict().keys()
    for k, v in whole.reference.state_dict().items():
        assert torch.equal(v, resumed.reference.state_dict()[k]), k


def test_resume_refuses_a_checkpoint_of_the_other_kind(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, ["training.max_steps=1"])
    trainer.train()
    saved = checkpoint.load_checkpoint(tmp_path / "run" / "final", trainer.cfg)
    plain = tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=0)
    with pytest.raises(ConfigError, match="holds a LoRA adapter, the model has none"):
        saved.load_weights(plain)
    from grpo.models.loading import load_model_and_tokenizer

    with pytest.raises(ConfigError, match="holds a LoRA adapter.*grpo export"):
        load_model_and_tokenizer(ModelConfig(name=str(tmp_path / "run" / "final")))


# ------------------------------------------------------------------ 5. export


def _logits(model, batch):
    ids = torch.cat([batch[0], batch[2]], 1)
    mask = torch.cat([batch[1], batch[3]], 1)
    with torch.no_grad():
        return model(
            input_ids=ids, attention_mask=mask, position_ids=logprobs.position_ids_from_mask(mask)
        ).logits


@pytest.fixture
def trained(tokenizer, tmp_path):
    """A trained tiny LoRA run's final checkpoint (a model.name the export can load again)."""
    trainer = Trainer.from_config(
        _cfg(tmp_path, ["model.tiny_hidden_size=32"]), reward_funcs={"third": third}
    )
    trainer.train()
    return trainer, tmp_path / "run" / "final"


def test_merged_export_is_the_adapted_model(trained, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, final = trained
    out = export_checkpoint(final, tmp_path / "merged", merge=True)
    assert out == tmp_path / "merged"
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not lora.lora_layers(merged)
    batch = _batch(tokenizer)
    torch.testing.assert_close(
        _logits(merged, batch), _logits(trainer.model, batch), rtol=1e-4, atol=1e-4
    )
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("1+2=")["input_ids"] == tokenizer("1+2=")["input_ids"]


def test_adapter_export_copies_adapter_and_tokenizer(trained, tmp_path):
    _, final = trained
    out = export_checkpoint(final, tmp_path / "adapter", merge=False)
    names = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= names
    assert not names & {"train_state.pt", "config.yaml"}
    assert (out / "adapter_model.safetensors").read_bytes() == (
        final / "adapter_model.safetensors"
    ).read_bytes()


def test_export_errors(trained, tokenizer, tmp_path):
    _, final = trained
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "o1", merge=True)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export_checkpoint(final, tmp_path / "busy", merge=True)
    full = _trainer(tokenizer, tmp_path / "full", ["model.lora.r=0", "training.max_steps=1"])
    full.train()
    with pytest.raises(ConfigError, match="full weights.*already a model"):
        export_checkpoint(tmp_path / "full" / "run" / "final", tmp_path / "o2", merge=True)
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(final, damaged)
    with open(damaged / "adapter_model.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.raises(ConfigError, match="damaged.*adapter_model.safetensors"):
        export_checkpoint(damaged, tmp_path / "o3", merge=False)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


# ------------------------------------------------------------------ 6. fused decoding and logprobs


def _adapted(tokenizer, gemma3_tiny=None, seed=1):
    model = (
        gemma3_tiny(4, 2)
        if gemma3_tiny
        else tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=3)
    )
    model = lora.apply_lora(model.eval(), LoraConfig(r=4, alpha=8.0), seed=seed)
    with torch.no_grad():  # a trained-looking adapter: B != 0
        gen = torch.Generator().manual_seed(seed)
        for key, p in lora.adapter_parameters(model).items():
            if "lora_B" in key:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _steps(steps, ids, mask, n=6, tokens=None):
    """Logits of a prefill and n greedy steps, and the tokens fed: `tokens` (another run's) instead
    of this run's own argmax, which could take the other side of a tie where two code paths'
    logits differ in their last bits."""
    positions = logprobs.position_ids_from_mask(mask)
    out, fed = [steps(ids, mask, positions)], []
    pos = mask.sum(-1)
    for t in range(n):
        nxt = out[-1].argmax(-1, keepdim=True) if tokens is None else tokens[t]
        fed.append(nxt)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out.append(steps(nxt, mask, pos[:, None]))
        pos = pos + 1
    return out, fed


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_decoding_packs_the_merged_weights(arch, tokenizer, gemma3_tiny):
    model = _adapted(tokenizer, gemma3_tiny if arch == "gemma3" else None)
    weight = model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    prompts = [tokenizer(t)["input_ids"] for t in ["abc", "hello world", "1+2="]]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    with torch.no_grad():
        plain, tokens = _steps(TransformersSteps(model), ids, mask)
        fused, _ = _steps(
            FusedDecoder(model, 3, ids.shape[1] + 7, pack=False), ids, mask, tokens=tokens
        )
        with lora.peft_model(model).disable_adapter():
            base, _ = _steps(TransformersSteps(model), ids, mask)
    for t, (a, b) in enumerate(zip(fused, plain)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {t}")
    assert not torch.allclose(base[0], plain[0], atol=1e-3)  # the adapter counts
    # packing leaves it alone
    assert torch.equal(model.model.layers[0].self_attn.q_proj.base_layer.weight, weight)


def test_fused_decoding_with_an_adapter_in_bf16(tokenizer, gemma3_tiny):
    if not kernels.packing_available():
        pytest.skip("oneDNN weight packing is not available in this torch build")
    model = _adapted(tokenizer, gemma3_tiny)
    CPULayer(CPUConfig()).install(model)
    assert fused_decoding_applies(model, torch.bfloat16)
    # float32 would decode from merged copies of every adapted weight: transformers' modules instead
    assert not fused_decoding_applies(model, torch.float32)
    prompts = [tokenizer(t)["input_ids"] for t in ["abc", "hello world", "1+2="]]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with kernels.packed_for_decoding(model, rows=3):
            plain, tokens = _steps(TransformersSteps(model), ids, mask)
        fused, _ = _steps(FusedDecoder(model, 3, ids.shape[1] + 7), ids, mask, tokens=tokens)
    for t, (a, b) in enumerate(zip(fused, plain)):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.03, atol=0.03, msg=f"step {t}")


def test_tiled_logprobs_of_a_lora_model_equal_the_peft_model_forward(tokenizer):
    model = _adapted(tokenizer)
    CPULayer(CPUConfig()).install(model)
    batch = _batch(tokenizer)
    wrapper = lora.peft_model(model)
    with torch.no_grad():
        # the definition: log_softmax of the PeftModel's own forward
        expected = logprobs.reference_logprobs(wrapper, *batch)
        ours = logprobs.completion_logprobs(model, *batch, vocab_block=16)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # and the gradient reaches the adapter only
    model.train()
    logp, _ = logprobs.completion_logprobs(model, *batch, vocab_block=16)
    logp.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert any(float(g.abs().sum()) > 0 for n, g in grads.items() if "lora_A" in n)


def test_a_bf16_lora_run_decodes_fused_and_trains(tokenizer, tmp_path, monkeypatch):
    """The CPU bf16 default path with an adapter and a reference adapter: fused decoding
    applies (the adapters' own small layers are merged, not packed alone), and it trains."""
    if not kernels.packing_available():
        pytest.skip("oneDNN weight packing is not available in this torch build")
    trainer = _trainer(
        tokenizer,
        tmp_path,
        [
            "training.bf16=true",
            "algorithm.beta=0.04",
            "algorithm.ref_sync_steps=1",
            "training.max_steps=2",
        ],
    )
    assert trainer.backend.cpu.uses_fused_decoding(trainer.model, torch.bfloat16)
    built, original = [], FusedDecoder.__init__
    monkeypatch.setattr(
        FusedDecoder, "__init__", lambda self, *a, **kw: built.append(1) or original(self, *a, **kw)
    )
    before = {k: v.detach().clone() for k, v in lora.adapter_parameters(trainer.model).items()}
    history = trainer.train()
    assert len(built) == 2  # each step's rollout decoded fused
    assert len(history) == 2 and all(h["kl"] >= 0 for h in history)
    assert any(
        not torch.equal(v, before[k]) for k, v in lora.adapter_parameters(trainer.model).items()
    )


def test_gradient_checkpointing_with_lora(tokenizer, tmp_path):
    trainer = _trainer(
        tokenizer, tmp_path, ["training.gradient_checkpointing=true", "training.max_steps=1"]
    )
    before = {k: v.detach().clone() for k, v in lora.adapter_parameters(trainer.model).items()}
    trainer.train()
    assert any(
        not torch.equal(v, before[k]) for k, v in lora.adapter_parameters(trainer.model).items()
    )


# ------------------------------------------------------------------ 7, 9. bad settings


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.lora.r=-1", "model.lora.r: must be an integer >= 0"),
        ("model.lora.alpha=0", "model.lora.alpha: must be > 0"),
        ("model.lora.dropout=1.0", r"model.lora.dropout: must be in \[0, 1\)"),
        ("model.lora.dropout=-0.1", r"model.lora.dropout: must be in \[0, 1\)"),
        ("model.lora.quantize=2bit", "model.lora.quantize: '2bit' is not one of none, 4bit, 8bit"),
        ("model.lora.target_modules=[]", "model.lora.target_modules: must be a non-empty list"),
    ],
)
def test_bad_lora_settings_are_refused_at_config_time(override, match):
    with pytest.raises(ConfigError, match=match):
        config.from_dict(TOY, [override])


@pytest.mark.parametrize("quantize", ["4bit", "8bit"])
def test_qlora_is_refused_on_the_cpu(quantize):
    with pytest.raises(
        ConfigError, match=f"model.lora.quantize: {quantize} \\(QLoRA\\) is GPU-only"
    ):
        config.from_dict(TOY, [f"model.lora.quantize={quantize}"])
    with pytest.raises(ConfigError, match="training.device is cpu"):
        config.from_dict(TOY, [f"model.lora.quantize={quantize}", "training.device=cpu"])
    with pytest.raises(ConfigError, match="needs adapters to train: set model.lora.r > 0"):
        config.from_dict(TOY, [f"model.lora.quantize={quantize}", "model.lora.r=0"])


def test_target_modules_that_match_nothing_name_the_layers(tokenizer, tmp_path):
    with pytest.raises(
        ConfigError, match=r"model.lora.target_modules: \['qkv'\] match no layer.*q_proj, k_proj"
    ):
        _trainer(tokenizer, tmp_path, ["model.lora.target_modules=[qkv]"])
    model = tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=0)
    with pytest.raises(ConfigError, match="include the output layer"):
        _trainer(tokenizer, tmp_path, ["model.lora.target_modules=[q_proj,lm_head]"], model=model)
    assert not lora.lora_layers(model)  # refused before peft changed the model


def test_named_target_modules_adapt_only_those(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, ["model.lora.target_modules=[q_proj,v_proj]"])
    adapted = {n.split(".")[-3] for n in lora.adapter_parameters(trainer.model)}
    assert adapted == {"q_proj", "v_proj"}


def test_a_peft_model_passed_in_is_refused(tokenizer, tmp_path):
    from peft import get_peft_model

    model = tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=0)
    wrapped = get_peft_model(model, lora.peft_config(LoraConfig(r=2)))
    with pytest.raises(ConfigError, match="a PeftModel was passed"):
        _trainer(tokenizer, tmp_path, model=wrapped)


@pytest.mark.slow
def test_benchmark_has_lora_rows(tmp_path):
    """benchmarks/vs_trl.py --lora: LoRA rows next to full fine-tuning, both sides training
    only the adapters (the same trainable bytes)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("trl")
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "vs_trl.json"
    cmd = [
        sys.executable,
        str(repo / "benchmarks" / "vs_trl.py"),
        "--model",
        "tiny",
        "--precision",
        "fp32",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--lora",
        "4",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LoRA r=4, alpha=16, all-linear" in proc.stdout and "TRL LoRA/full" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"fp32", "fp32-lora4"}
    full, adapted = runs["fp32"]["summary"], runs["fp32-lora4"]["summary"]
    assert (
        adapted["trl"]["trainable_bytes"]
        == adapted["grpo"]["trainable_bytes"]
        < full["grpo"]["trainable_bytes"] / 5
    )
    assert runs["fp32-lora4"]["same_tokens_per_step"]
