"""Bad input fails at start-up, naming the problem and the fix (issue #13)."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.config.model_data import ModelConfig
from grpo.models.loading import load_model_and_tokenizer
from grpo.models.tiny import tiny_model
from grpo.rewards.reward_set import resolve
from grpo.tasks.data import PromptEncoder, truncate_prompt
from grpo.training.trainer import Trainer

FAST = {
    "output_dir": "UNSET",
    "model": {"name": "tiny"},
    "data": {"chat_template": "never"},
    "rollout": {"num_generations": 4, "max_completion_length": 2},
    "training": {"max_steps": 1, "per_device_train_batch_size": 8, "learning_rate": 1e-3},
    "logging": {"log_every": 1000, "sample_every": 0},
    "rewards": {"isolation": "thread"},
}


def any_reward(completions, **kwargs):
    return [1.0] * len(completions)


def make(tokenizer, tmp_path, rows, overrides=()):
    cfg = config.from_dict({**FAST, "output_dir": str(tmp_path / "run")}, list(overrides))
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
    return Trainer.from_config(
        cfg, model=model, tokenizer=tokenizer, train_rows=rows, reward_funcs={"any": any_reward}
    )


# ---------------------------------------------------------------- rows


def test_rows_with_different_columns_are_refused_naming_column_and_row(tokenizer, tmp_path):
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}, {"prompt": "3+3="}]
    with pytest.raises(
        ConfigError,
        match=r"training rows: row 2 .* no 'answer' column, which row 0 has; give every row",
    ):
        make(tokenizer, tmp_path, rows)
    # the first row lacks what a later one has
    rows = [
        {"prompt": "1+1="},
        {"prompt": "2+2=", "answer": 4},
    ]
    with pytest.raises(ConfigError, match=r"row 0 .* no 'answer' column, which row 1 has"):
        make(tokenizer, tmp_path, rows)


# ---------------------------------------------------------------- long prompts


def test_truncation_keeps_bos_and_the_end():
    assert truncate_prompt([1, 10, 11, 12, 13], 3, bos_token_id=1) == [1, 12, 13]
    assert truncate_prompt([10, 11, 12, 13], 3, bos_token_id=1) == [11, 12, 13]
    assert truncate_prompt([1, 10], 3, bos_token_id=1) == [1, 10]
    assert truncate_prompt([1, 10, 11], 1, bos_token_id=1) == [11]
    assert truncate_prompt([1, 10, 11], None, bos_token_id=1) == [1, 10, 11]


def test_long_prompts_are_counted_and_warned_about_once(tokenizer, tmp_path, caplog):
    rows = [{"prompt": "a long few-shot preamble. Question: 1+1="}, {"prompt": "2+2="}] * 4
    encoder = PromptEncoder(tokenizer, False, None, max_prompt_length=8)
    with caplog.at_level(logging.WARNING):
        ids = encoder(rows)
        encoder(rows)
    assert tokenizer.decode(ids[0]) == "on: 1+1=" and tokenizer.decode(ids[1]) == "2+2="
    assert encoder.take_truncated() == 8 and encoder.take_truncated() == 0
    assert caplog.text.count("longer than rollout.max_prompt_length=8") == 1
    trainer = make(tokenizer, tmp_path, rows, ["rollout.max_prompt_length=8"])
    metrics, batch = trainer.train_step()
    # one prompt per group of 4
    assert metrics["prompts/truncated"] == sum(len(p) > 8 for p in batch.prompts[::4])


def test_prompt_plus_completion_beyond_the_context_is_refused(tokenizer, tmp_path):
    rows = [{"prompt": "x" * 1000}, {"prompt": "y"}]  # the tiny model has 1024 positions
    with pytest.raises(
        ConfigError,
        match=r"row 0's prompt is 1000 tokens.*1032 tokens, beyond the model's context of "
        r"1024 \(max_position_embeddings\); set rollout.max_prompt_length to at most 992",
    ):
        make(tokenizer, tmp_path, rows, ["rollout.max_completion_length=32"])
    make(
        tokenizer,
        tmp_path,
        rows,
        ["rollout.max_completion_length=32", "rollout.max_prompt_length=992"],
    )


# ---------------------------------------------------------------- model directories


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("model") / "good"
    tiny_model(tokenizer, hidden_size=32, num_layers=1).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _break_config(d):
    (d / "config.json").write_text("{not json")


def _unknown_type(d):
    (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "model_type": "nosuch"})
    )


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _truncated_weights(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _no_tokenizer(d):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_break_config, r"config\.json is not valid JSON .*copy it again from the model's source"),
        (
            _unknown_type,
            r"config\.json has model_type 'nosuch', which transformers .* does not know; correct model_type",
        ),
        (
            _no_weights,
            r"has config\.json but no weights \(model\.safetensors or pytorch_model\.bin\); copy it again",
        ),
        (
            _truncated_weights,
            r"cannot load the weights in .* \(model\.safetensors\).*truncated or corrupt",
        ),
        (
            _no_tokenizer,
            r"cannot load the tokenizer from .*no tokenizer files.*copy the tokenizer files",
        ),
    ],
)
def test_broken_model_directory_names_the_file_and_the_fix(saved_model, tmp_path, damage, message):
    directory = tmp_path / "model"
    shutil.copytree(saved_model, directory)
    damage(directory)
    with pytest.raises(ConfigError, match=f"model.name: .*{message}"):
        load_model_and_tokenizer(ModelConfig(name=str(directory)))


def test_a_model_with_nan_weights_is_refused_at_load(saved_model, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "model"
    shutil.copytree(saved_model, directory)
    weights = load_file(directory / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"parameter model\.norm\.weight holds NaN or inf.*load another checkpoint",
    ):
        load_model_and_tokenizer(ModelConfig(name=str(directory)))


def test_a_whole_model_directory_loads(saved_model):
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name=str(saved_model)))
    assert model.config.model_type == "llama" and tokenizer.pad_token == "<pad>"


# ---------------------------------------------------------------- reward files and the command line


def test_reward_file_resolves_beside_the_config(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_rewards.py").write_text(
        "def score(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    (project / "run.yaml").write_text("rewards:\n  funcs: ['my_rewards.py:score']\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = config.load("../project/run.yaml")
    assert (
        Path(cfg.rewards.funcs[0].rsplit(":", 1)[0]).resolve()
        == (project / "my_rewards.py").resolve()
    )
    name, fn = resolve(cfg.rewards.funcs[0], cfg.rewards)
    assert name == "score" and fn(["a", "b"]) == [1.0, 1.0]
    (project / "bad.yaml").write_text("rewards:\n  funcs: ['missing.py:score']\n")
    with pytest.raises(
        ConfigError, match="missing.py does not exist .*then beside the config file"
    ):
        resolve(config.load("../project/bad.yaml").rewards.funcs[0])


def test_eval_takes_overrides_after_the_checkpoint_option(tmp_path, capsys):
    from grpo.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  name: tiny\n")
    # the override is read (and refused by name) although it comes after --checkpoint
    assert (
        main(["eval", str(cfg), "--checkpoint", str(tmp_path), "training.learning_rate=nan"]) == 2
    )
    assert "training.learning_rate: must be a finite number" in capsys.readouterr().err
    assert main(["eval", str(cfg), "--checkpoint", str(tmp_path), f"output_dir={tmp_path}"]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", str(cfg), "--checkpoint", str(tmp_path), "--bogus"])
    # the context check holds for evaluation too, before any generation
    assert (
        main(["eval", str(cfg), f"output_dir={tmp_path}", "eval.max_completion_length=1100"]) == 2
    )
    assert "leaves no room for a prompt in the model's context of 1024" in capsys.readouterr().err
