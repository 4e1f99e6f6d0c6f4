import subprocess
import sys

import pytest

from grpo.config import loading as config
from grpo.config.errors import ConfigError


def test_defaults_follow_trl():
    cfg = config.from_dict({})
    assert (
        cfg.algorithm.beta == 0.0
        and cfg.algorithm.epsilon == 0.2
        and cfg.algorithm.loss_type == "dapo"
    )
    assert cfg.rollout.num_generations == 8 and cfg.rollout.temperature == 1.0
    assert cfg.epsilon_high == 0.2
    assert config.from_dict({"algorithm": {"epsilon_high": 0.28}}).epsilon_high == 0.28


def test_overrides_are_typed_yaml():
    cfg = config.from_dict(
        {},
        [
            "algorithm.beta=0.04",
            "training.max_steps=50",
            "training.bf16=true",
            "training.learning_rate=1e-5",
            "rewards.funcs=[arithmetic_correct, arithmetic_format]",
            "algorithm.delta=null",
        ],
    )
    assert cfg.algorithm.beta == 0.04 and cfg.training.max_steps == 50 and cfg.training.bf16 is True
    assert cfg.training.learning_rate == 1e-5  # YAML 1.1 reads 1e-5 as a string
    assert cfg.rewards.funcs == ["arithmetic_correct", "arithmetic_format"]
    assert cfg.algorithm.delta is None


def test_overrides_do_not_mutate_input():
    data = {"training": {"max_steps": 5}}
    config.from_dict(data, ["training.max_steps=7"])
    assert data == {"training": {"max_steps": 5}}


@pytest.mark.parametrize(
    "data, overrides, expected",
    [
        ({"trainig": {}}, [], "unknown config key 'trainig'; did you mean 'training'"),
        (
            {},
            ["algorithm.betta=0.1"],
            "unknown config key 'algorithm.betta'; did you mean 'algorithm.beta'",
        ),
        ({}, ["training.max_steps=ten"], "training.max_steps: expected an integer"),
        ({}, ["training.bf16=yes please"], "training.bf16: expected true, false or auto"),
        ({}, ["rollout.num_generations=1"], "rollout.num_generations: must be >= 2"),
        (
            {},
            ["training.per_device_train_batch_size=12"],
            "not a multiple of rollout.num_generations=8",
        ),
        (
            {},
            ["algorithm.loss_type=grpoo"],
            "algorithm.loss_type: 'grpoo' is not one of grpo, bnpo, dr_grpo, dapo, luspo (did you mean 'grpo'?)",
        ),
        ({}, ["algorithm.delta=1.1"], "algorithm.delta: must be > 1 + epsilon_high"),
        ({}, ["training.microbatch_tokens=-1"], "training.microbatch_tokens: must be >= 0"),
        ({}, ["rewards.weights=[1.0, 2.0]"], "rewards.weights: 2 weights for 1 functions"),
        ({}, ["algorithm.ref_sync_steps=10"], "algorithm.ref_sync_steps: set with beta = 0"),
        ({}, ["data.arithmetic.operators=[+]"], "data.arithmetic.operators: need 2 operators"),
        ({}, ["data.task=jsonl"], "data.train_file: task 'jsonl' needs a JSONL file"),
        ({}, ["training.max_steps"], "expected key=value"),
        ({"model": "gpt2"}, [], "model: expected a mapping"),
        ({}, ["rollout.engine=sglang"], "rollout.engine: 'sglang' is not one of hf"),
        ({}, ["cpu.decoding=fast"], "cpu.decoding: 'fast' is not one of auto, fused, plain"),
        (
            {},
            ["algorithm.advantage_estimator=rlo"],
            "algorithm.advantage_estimator: 'rlo' is not one of grpo, dr_grpo, rloo, reinforce_pp, gae (did you mean 'rloo'?)",
        ),
        (
            {},
            ["algorithm.policy_loss=clip"],
            "algorithm.policy_loss: 'clip' is not one of clipped, cispo, sapo, vespo (did you mean 'clipped'?)",
        ),
        ({}, ["data.task=json"], "data.task: 'json' is not one of arithmetic, jsonl, gsm8k, math"),
        ({}, ["eval.num_problems=0"], "eval.num_problems: must be > 0"),
        ({}, ["rollout.min_p=1.0"], "rollout.min_p: must be in [0, 1)"),
        ({}, ["rollout.repetition_penalty=0"], "rollout.repetition_penalty: must be > 0"),
        (
            {},
            ["data.chat_template_kwargs=[a]"],
            "data.chat_template_kwargs: expected a mapping of names to values",
        ),
        (
            {},
            ["data.chat_template_kwargs={tools: [a]}"],
            "data.chat_template_kwargs.tools: expected a string, number, true/false or null",
        ),
    ],
)
def test_bad_config_names_the_key(data, overrides, expected):
    with pytest.raises(ConfigError) as err:
        config.from_dict(data, overrides)
    assert expected in str(err.value)


MOVED = [
    ("model.cpu_kernels", "false", "cpu.kernels"),
    ("training.kernels", "eager", "cpu.compile"),
    ("rollout.decoding", "plain", "cpu.decoding"),
]


@pytest.mark.parametrize("old, value, new", MOVED)
def test_a_moved_key_is_refused_naming_its_new_key(old, value, new, tmp_path):
    """The CPU layer's settings moved under cpu:; a config of an earlier version (an override or a
    file) is refused with the key to write instead, never silently ignored or guessed."""
    assert config.MOVED_KEYS[old] == new
    with pytest.raises(ConfigError) as err:
        config.from_dict({}, [f"{old}={value}"])
    message = str(err.value)
    assert f"{old} is now {new}" in message
    # and the value to write there
    assert message.split(f"write {new}: ")[1].strip("'").lower() == value
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        config.load(path)
    # the new key takes the same value
    cpu = config.from_dict({}, [f"{new}={value}"]).cpu
    assert str(getattr(cpu, new.split(".")[1])).lower() == value


def test_every_moved_key_is_covered():
    assert sorted(config.MOVED_KEYS.items()) == sorted((old, new) for old, _, new in MOVED)


def test_indivisible_batch_suggests_a_fix():
    with pytest.raises(ConfigError) as err:
        config.from_dict({}, ["training.per_device_train_batch_size=12"])
    assert "use a batch of 8 or 16" in str(err.value)


def test_yaml_round_trip(tmp_path):
    cfg = config.from_dict({"algorithm": {"beta": 0.04}, "output_dir": str(tmp_path)})
    config.save(cfg, tmp_path / "c.yaml")
    again = config.load(tmp_path / "c.yaml")
    assert again == cfg


def test_cli_bad_config_fails_before_loading_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  per_device_train_batch_size: 7\n")
    code = (
        "import sys; from grpo.cli import main; rc = main(['train', sys.argv[1]]); "
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'loaded before the config check'; "
        "sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "training.per_device_train_batch_size" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "grpo.cli", "train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_every_registered_name_resolves():
    """Each registry entry imports to what its kind needs (a typo in a module path fails here)."""
    from grpo import registry

    for reg in (
        registry.ADVANTAGE_ESTIMATORS,
        registry.POLICY_LOSSES,
        registry.LOSS_AGGREGATIONS,
        registry.ROLLOUT_ENGINES,
        registry.TASKS,
    ):
        for name in reg.names():
            assert callable(reg.get(name)), (reg.key, name)


def test_registered_names_are_config_choices():
    """A name registered from user code is accepted by the config check, and unregistered again refused."""
    from grpo import registry

    with pytest.raises(ConfigError, match="is not one of grpo"):
        config.from_dict({}, ["algorithm.advantage_estimator=mine"])
    registry.ADVANTAGE_ESTIMATORS.register("mine")(
        lambda inputs: inputs.rewards * 0  # an estimator takes one AdvantageInputs
    )
    try:
        assert (
            config.from_dict(
                {}, ["algorithm.advantage_estimator=mine"]
            ).algorithm.advantage_estimator
            == "mine"
        )
    finally:
        registry.ADVANTAGE_ESTIMATORS.unregister("mine")
