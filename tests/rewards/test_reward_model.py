"""`reward_model:PATH`: a tiny random sequence-classification model scores prompt + completion
exactly as a hand-written forward pass does, batched or not, padded or not, without
gradients, on its own dtype and device; bad paths and labels fail at start-up."""

import pytest
import torch

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import RewardsConfig
from grpo.models.tiny import char_tokenizer
from grpo.rewards.reward_model import RewardModel, from_spec
from grpo.rewards.reward_set import check_signature

TEXTS = [
    ("What is 2+3?", " 5"),
    ("Name a colour.", " Blue, or perhaps a much longer answer than the others here."),
    ("Hi", ""),
    ("Count: 1 2 3", " 4 5 6 7"),
    ("x", " y"),
]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def hand_scores(model, tok, texts, label=0, add_special_tokens=True):
    """Each text alone, unpadded: the model's logit `label` at the last token."""
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
            out.append(model(torch.tensor([ids])).logits[0, label].item())
    return out


@pytest.mark.parametrize("pad", [True, False])
def test_scores_equal_a_hand_forward_batched_or_not(tmp_path, pad, save_reward_model):
    model, tok = save_reward_model(tmp_path / "rm", pad=pad)
    prompts, completions = [p for p, _ in TEXTS], [c for _, c in TEXTS]
    expected = hand_scores(model, tok, [p + c for p, c in TEXTS])
    for batch_size in (1, 2, 8):
        rm = RewardModel(tmp_path / "rm", device="cpu", batch_size=batch_size)
        scores = rm(
            prompts=prompts,
            completions=completions,
            completion_ids=[[0]] * len(TEXTS),
            answer=[None] * 5,
        )
        assert all(isinstance(s, float) for s in scores)
        assert scores == pytest.approx(expected, abs=1e-5)
    # a random model tells the texts apart
    assert len(set(round(s, 4) for s in expected)) == len(expected)
    # padding next to a much longer text changes nothing
    alone = rm(["x"], [" y"], [[0]])
    padded = rm(["x", "a" * 100], [" y", "b" * 100], [[0], [0]])
    assert padded[0] == pytest.approx(alone[0], abs=1e-5)


def test_conversational_prompts_use_the_reward_models_chat_template(tmp_path, save_reward_model):
    model, tok = save_reward_model(tmp_path / "rm", chat_template=TEMPLATE)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    rm = RewardModel(tmp_path / "rm", device="cpu")
    assert rm.text(prompt, completion) == ("[system] Be brief.\n[user] 2+2?\n[assistant] 4\n", True)
    expected = hand_scores(
        model, tok, ["[system] Be brief.\n[user] 2+2?\n[assistant] 4\n"], add_special_tokens=False
    )
    assert rm([prompt], [completion], [[0]]) == pytest.approx(expected, abs=1e-5)
    assert rm.text("2+2?", "4") == ("2+2?4", False)  # a plain prompt is concatenated

    save_reward_model(tmp_path / "plain")
    plain = RewardModel(tmp_path / "plain", device="cpu")
    # no template: the contents joined
    assert plain.text(prompt, completion) == (
        "Be brief.\n2+2?\n4",
        False,
    )


def test_no_gradients_and_truncation(tmp_path, save_reward_model):
    model, tok = save_reward_model(tmp_path / "rm")
    rm = RewardModel(tmp_path / "rm", device="cpu", max_length=6)
    grad_enabled = []
    rm.model.register_forward_hook(lambda *args: grad_enabled.append(torch.is_grad_enabled()))
    with torch.enable_grad():
        rm(["a long prompt"], [" and its end"], [[0]])
    assert grad_enabled == [False]
    assert not any(p.requires_grad for p in rm.model.parameters())
    # cut from the left: the last 6 characters are what is scored
    assert rm(["a long prompt"], [" and its end"], [[0]]) == pytest.approx(
        hand_scores(model, tok, ["ts end"]), abs=1e-5
    )


def test_dtype_and_device_are_its_own(tmp_path, save_reward_model):
    model, tok = save_reward_model(tmp_path / "rm")
    rm = RewardModel(tmp_path / "rm", device="cpu", dtype="bfloat16")
    assert rm.model.dtype == torch.bfloat16 and rm.model.device.type == "cpu"
    expected = hand_scores(model, tok, [p + c for p, c in TEXTS])
    scores = rm([p for p, _ in TEXTS], [c for _, c in TEXTS], [[0]] * len(TEXTS))
    assert scores == pytest.approx(expected, abs=0.1)  # bf16 rounding, same model
    assert RewardModel(tmp_path / "rm", device="auto").device.type == (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    if not torch.cuda.is_available():
        with pytest.raises(
            ConfigError, match="rewards.reward_model_device: 'cuda', but no CUDA device"
        ):
            RewardModel(tmp_path / "rm", device="cuda")
    assert model.dtype == torch.float32  # the model it was saved from is untouched


def test_labels_of_a_multi_output_model(tmp_path, save_reward_model):
    model, tok = save_reward_model(tmp_path / "rm3", num_labels=3)
    rm = RewardModel(tmp_path / "rm3", device="cpu", label=2)
    assert rm(["q"], [" a"], [[0]]) == pytest.approx(
        hand_scores(model, tok, ["q a"], label=2), abs=1e-5
    )
    with pytest.raises(
        ConfigError,
        match=r"label 3 is out of range; the model has 3 output\(s\), so pick a label in 0..2",
    ):
        RewardModel(tmp_path / "rm3", label=3)
    save_reward_model(tmp_path / "rm1")
    with pytest.raises(ConfigError, match="label 1 is out of range"):
        RewardModel(tmp_path / "rm1", label=1)


def test_bad_paths_are_config_errors(tmp_path):
    from grpo.models.tiny import tiny_model

    with pytest.raises(
        ConfigError, match=r"reward model '.*nope': no such directory.*sequence-classification"
    ):
        RewardModel(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json in that directory"):
        RewardModel(tmp_path / "empty")
    tok = char_tokenizer()
    tiny_model(tok, hidden_size=32, num_layers=1).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    with pytest.raises(
        ConfigError, match=r"expected a sequence-classification model .*LlamaForCausalLM"
    ):
        RewardModel(tmp_path / "lm")


def test_spec_and_config_keys(tmp_path, save_reward_model):
    save_reward_model(tmp_path / "my-rm")
    cfg = config.from_dict(
        {
            "rewards": {
                "reward_model_device": "cpu",
                "reward_model_batch_size": 3,
                "reward_model_dtype": "bfloat16",
            }
        }
    ).rewards
    name, fn = from_spec(f"reward_model:{tmp_path / 'my-rm'}", cfg)
    assert name == "my-rm" and fn.runs_in_process is True
    assert (fn.batch_size, fn.model.dtype, fn.device.type) == (3, torch.bfloat16, "cpu")
    check_signature(name, fn, {"answer"})  # TRL's calling convention: every column as a keyword
    assert RewardsConfig().reward_model_device == "auto"
    for key, value in [
        ("reward_model_device", "gpu"),
        ("reward_model_dtype", "fp8"),
        ("reward_model_batch_size", 0),
    ]:
        with pytest.raises(ConfigError, match=f"rewards.{key}"):
            config.from_dict({"rewards": {key: value}})
    with pytest.raises(ConfigError, match="names no model"):
        from_spec("reward_model:", cfg)


def test_rewards_funcs_names_a_reward_model(tmp_path, save_reward_model):
    from grpo.config.rollout_rewards import RewardsConfig
    from grpo.rewards.reward_set import resolve

    model, tok = save_reward_model(tmp_path / "rm")
    name, fn = resolve(f"reward_model:{tmp_path / 'rm'}", RewardsConfig(reward_model_device="cpu"))
    assert name == "rm" and isinstance(fn, RewardModel) and fn.runs_in_process
    assert fn(["x"], [" y"], [[0]]) == pytest.approx(hand_scores(model, tok, ["x y"]), abs=1e-5)


def test_a_reward_passed_from_python_is_resolved_as_trl_reads_it(tmp_path, save_reward_model):
    """reward_function: a built-in's name, a reward model by path (no prefix, as TRL reads a
    string) or by object, with its own tokenizer, and a plain callable under its name."""
    from grpo.rewards.reward_set import BUILTIN, reward_function

    model, tok = save_reward_model(tmp_path / "rm")
    cfg = RewardsConfig(reward_model_device="cpu", reward_model_batch_size=2)
    assert reward_function("arithmetic_correct", cfg) == (
        "arithmetic_correct",
        BUILTIN["arithmetic_correct"],
    )
    name, by_path = reward_function(tmp_path / "rm", cfg, tok)
    assert name == "rm" and isinstance(by_path, RewardModel) and by_path.tokenizer is tok
    name, by_object = reward_function(model, cfg, tok)
    assert isinstance(by_object, RewardModel) and by_object.model is model
    assert (by_object.batch_size, by_object.device.type) == (2, "cpu")
    assert by_path(["2+3?"], [" 5"]) == pytest.approx(by_object(["2+3?"], [" 5"]))

    def brevity(completions, **kwargs):
        return [-len(c) for c in completions]

    assert reward_function(brevity, cfg) == ("brevity", brevity)
    with pytest.raises(TypeError, match="neither a callable nor a model id/path"):
        reward_function(3, cfg)
