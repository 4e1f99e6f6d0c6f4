"""Data parallelism: `torchrun --nproc_per_node 2` (gloo, CPU) computes the run one process
computes on the same global batch and seed: the same completions, rewards, metrics and
evaluation, and weights equal to float tolerance, for the grpo and dapo losses, with and
without dynamic sampling; a distributed run killed mid-run and resumed ends exactly where the
uninterrupted one does; both ranks generating through one generation server (`grpo serve
--engine hf`, in a thread of the test process) compute the 2-rank in-process run bitwise.

The 2-process runs are one torchrun launch of tests/backends/distributed_driver.py for every case (a
launch costs seconds of imports), plus a killed and a resumed `torchrun -m grpo train`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from serve_settings import SERVE_KEY

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.config.schema import validate
from grpo.training.batching import choose_groups
from grpo.training.evaluate import shard
from grpo.training.metrics import sum_counts
from grpo.training.trainer import Trainer

HERE = Path(__file__).resolve().parent
# tools/seconds: the seconds spent in tool calls, a timing like those under time/
TIMING = ("time/", "tokens_per_second", "tools/seconds")

REWARDS = '''
def third(completions, **kwargs):
    """1 for a third of all first characters: groups with spread and groups without."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(bool(t) and ord(t[0]) % 3 == 0) for t in texts]
'''

BASE = {
    "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "instruction": "{expression}=",
            "num_train": 200,
            "num_eval": 6,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 3, "temperature": 1.0},
    "rewards": {"isolation": "thread"},
    # 16 completions a step: one process with minibatches of 16, or 2 ranks of 8 (2 groups each)
    "training": {
        "max_steps": 4,
        "per_device_train_batch_size": 16,
        "learning_rate": 0.003,
        "save_steps": 1,
    },
    "eval": {"after": True, "temperatures": [0.0, 1.0]},
    "logging": {"log_every": 100, "sample_every": 2},
}

CASES = {
    # the grpo loss with a KL reference, two passes per batch and batch-wide reward scaling
    "grpo": [
        "algorithm.loss_type=grpo",
        "algorithm.beta=0.04",
        "algorithm.num_iterations=2",
        "algorithm.scale_rewards=batch",
    ],
    "grpo_dynamic": [
        "algorithm.loss_type=grpo",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=3",
    ],
    "dapo": ["algorithm.loss_type=dapo"],
    # the preset: dapo's loss, clip-higher, overlong penalty and dynamic sampling
    "dapo_dynamic": ["algorithm.preset=dapo", "algorithm.max_sampling_rounds=3"],
    # a tied output layer: its sparse embedding rows and the output layer's gradient sink under the gradient sum
    "tied": ["algorithm.loss_type=dapo", "model.name=TIED"],
    # LoRA (only the adapters' gradients summed; the reference is the adapter disabled) and PPO's critic
    "lora": [
        "algorithm.loss_type=dapo",
        "model.lora.r=4",
        "algorithm.beta=0.04",
        "training.learning_rate=0.01",
    ],
    "gae": ["algorithm.advantage_estimator=gae"],
    # FSDP2: old logprobs (two passes), micro-batches by a token budget, dynamic sampling's uneven ranks
    "fsdp_grpo_dynamic": [
        "algorithm.loss_type=grpo",
        "algorithm.num_iterations=2",
        "algorithm.scale_rewards=batch",
        "algorithm.dynamic_sampling=true",
        "training.microbatch_tokens=20",
    ],
    "fsdp_dapo_dynamic": ["algorithm.preset=dapo", "algorithm.max_sampling_rounds=3"],
    "fsdp_tied": ["algorithm.loss_type=dapo", "model.name=TIED"],
}

TWO_RANKS = ["training.per_device_train_batch_size=8"]

# A run whose model calls a tool (tests/conftest.py's save_tool_model: each call one added token
# a random model samples; the tool a file beside the config, loaded by every rank), trained in
# the same torchrun launch as CASES. dapo's token count, two passes' old log-probs and the KL
# reference all run over completions whose tool results are masked out of the loss.
TOOLS = [
    "data.chat_template=auto",
    "rollout.tools=[mytools.py:lookup]",
    "rollout.max_completion_length=24",  # a call and its result (18 tokens), and a reply
    "algorithm.loss_type=dapo",
    "algorithm.num_iterations=2",
    "algorithm.beta=0.04",
    "eval.every=2",  # the held-out completions call the tool too, between steps
]


def _two_ranks(name: str) -> list[str]:
    return CASES[name] + TWO_RANKS + (["training.sharding=fsdp"] if name.startswith("fsdp") else [])


def _tied_model(tmp: Path) -> Path:
    """A tiny Llama whose output layer is its input embedding (as Gemma's and Qwen2.5-0.5B's)."""
    from grpo.models.tiny import char_tokenizer, tiny_model

    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    directory = tmp / "tied-model"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _config(tmp: Path, name: str, overrides: list[str]) -> Path:
    rewards = tmp / "rewards.py"
    rewards.write_text(REWARDS)
    if "model.name=TIED" in overrides:
        overrides = [o for o in overrides if o != "model.name=TIED"] + [
            f"model.name={_tied_model(tmp)}"
        ]
    cfg = config.from_dict(
        {
            **BASE,
            "output_dir": str(tmp / name),
            "rewards": {**BASE["rewards"], "funcs": [f"{rewards}:third"]},
        },
        overrides,
    )
    path = tmp / f"{name}.yaml"
    config.save(cfg, path)
    return path


def _torchrun(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *args,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, save_tool_model):
    """Every case trained on 2 ranks (and the resume case's uninterrupted run), the run with
    tools, and the `grpo` case generated through a server: name -> run dir; "server" -> what
    that server held at the end (its weights' version and checksum)."""
    from grpo.rollout import weight_transfer
    from grpo.serve import hf

    tmp = tmp_path_factory.mktemp("two_ranks")
    paths = [_config(tmp, name, _two_ranks(name)) for name in CASES]
    tools = [*TOOLS, *TWO_RANKS, f"model.name={save_tool_model(tmp)}"]
    paths.append(_config(tmp, "tools", tools))
    # the server the ranks reach over HTTP, and rank 0's pushes over the weight-transfer group
    server = hf.start(config.from_dict(BASE), "127.0.0.1", 0, SERVE_KEY).start_thread()
    try:
        served = [*_two_ranks("grpo"), "rollout.engine=server", f"rollout.server.url={server.url}"]
        paths.append(_config(tmp, "grpo_served", served))
        done = _torchrun(
            [str(HERE / "distributed_driver.py"), *map(str, paths)],
            env={"GRPO_SERVE_API_KEY": SERVE_KEY},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        with server.app.lock:
            held = server.app.version, weight_transfer.checksum(server.app.tensors.items())
    finally:
        server.shutdown()
    runs = {name: tmp / name for name in [*CASES, "tools", "grpo_served"]}
    return {**runs, "server": held}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_close_metrics(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        keys = {k for k in b if not k.startswith(TIMING)}
        assert {k for k in a if not k.startswith(TIMING)} == keys
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5, nan_ok=True), (a["step"], k)


def _assert_close_weights(got: Path, expected: Path, atol: float, mean_atol: float = 0.0) -> None:
    """Every weight within `atol`, and each tensor's mean difference within `mean_atol`. AdamW turns a
    float-sized error in a near-zero gradient into up to a learning rate's step (here 3e-3), so a few
    elements may move by 1e-5; a gradient that is wrong moves most of a tensor's elements."""

    def weights(run: Path) -> dict:  # the model's, or a LoRA run's adapter
        files = sorted((run / "final").glob("*.safetensors"))
        assert files, run
        return {name: t for f in files for name, t in load_file(f).items()}

    a, b = weights(got), weights(expected)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)
        assert float((a[name] - b[name]).abs().mean()) <= mean_atol, name


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_compute_one_process_run(name, two_ranks, tmp_path):
    one = tmp_path / name
    Trainer.from_config(config.load(_config(tmp_path, name, CASES[name]))).train()
    two = two_ranks[name]
    # the same completions and rewards: the samples, the evaluation, every count in the metrics
    samples = _rows(two / "samples.jsonl")
    if (
        "dynamic" in name
    ):  # the same groups are kept, but one process lists them round by round, 2 ranks rank by rank
        assert len(samples) == len(_rows(one / "samples.jsonl"))
    else:
        assert samples == _rows(one / "samples.jsonl")
    assert _rows(two / "eval.jsonl") == _rows(one / "eval.jsonl")
    _assert_close_metrics(_rows(two / "metrics.jsonl"), _rows(one / "metrics.jsonl"))
    _assert_close_weights(two, one, atol=1e-4, mean_atol=1e-6)
    history = _rows(one / "metrics.jsonl")
    # it did learn something
    assert any(h["reward_std"] > 0 for h in history) and history[-1]["grad_norm"] > 0
    if "dynamic" in name:  # dynamic sampling drew more than one round at least once
        assert max(h["sampling/rounds"] for h in history) > 1


def test_two_ranks_through_one_server_are_two_ranks_in_process(two_ranks):
    """Both ranks generate their share through one `grpo serve --engine hf` (rank 0 pushes once a
    step, rank 1 waits for the push to land): the 2-rank in-process run, bitwise (the server
    builds the engine as the trainer does and holds the trainer's weights bitwise)."""
    from grpo.rollout import weight_transfer

    served, in_process = two_ranks["grpo_served"], two_ranks["grpo"]
    untimed = ("time/", "tokens_per_second", "weight_sync/")

    def rows(run):
        metrics = _rows(run / "metrics.jsonl")
        return [{k: v for k, v in r.items() if not k.startswith(untimed)} for r in metrics]

    assert rows(served) == rows(in_process)
    for log in ("samples.jsonl", "eval.jsonl"):
        assert _rows(served / log) == _rows(in_process / log), log
    got, expected = (
        {
            n: t
            for f in sorted((run / "final").glob("*.safetensors"))
            for n, t in load_file(f).items()
        }
        for run in (served, in_process)
    )
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # the start's push and one a step: the server holds version 5, the final weights
    version, checksum = two_ranks["server"]
    assert version == 5
    assert checksum["digest"] == weight_transfer.checksum(expected.items())["digest"]
    history = _rows(served / "metrics.jsonl")
    assert all(h["weight_sync/bytes"] > 0 for h in history)


def test_two_ranks_with_tools_compute_one_process_run(two_ranks, save_tool_model, tmp_path):
    """Each rank runs its own completions' calls (in processes forked from it): the same calls,
    results, completions and tool metrics as one process, and the same training."""
    one = tmp_path / "tools"
    Trainer.from_config(
        config.load(_config(tmp_path, "tools", [*TOOLS, f"model.name={save_tool_model(tmp_path)}"]))
    ).train()
    two = two_ranks["tools"]
    assert _rows(two / "samples.jsonl") == _rows(one / "samples.jsonl")
    assert _rows(two / "eval.jsonl") == _rows(one / "eval.jsonl")
    history = _rows(one / "metrics.jsonl")
    # calls happened, some failed (key z): the tool metrics compared below count both
    assert all(h["tools/call_frequency"] > 0 for h in history), history
    assert any(h["tools/failure_frequency"] > 0 for h in history), history
    tools = lambda rows: [  # noqa: E731
        {k: v for k, v in r.items() if k.startswith("tools/") and k != "tools/seconds"}
        for r in rows
    ]
    assert tools(_rows(two / "metrics.jsonl")) == tools(history)
    _assert_close_metrics(_rows(two / "metrics.jsonl"), history)
    _assert_close_weights(two, one, atol=1e-4, mean_atol=1e-6)
    assert any(h["reward_std"] > 0 for h in history) and history[-1]["grad_norm"] > 0


@pytest.mark.parametrize(
    "name",
    [
        # a kill and a resume under torchrun: about half a minute each, in make test-slow (the
        # single-process kill-and-resume tests, tests/run/test_resume.py, are in the default suite)
        pytest.param("dapo_dynamic", marks=pytest.mark.slow),
        pytest.param("fsdp_dapo_dynamic", marks=pytest.mark.slow),
    ],
)
def test_distributed_resume_is_exact(name, two_ranks, tmp_path):
    """Both ranks SIGKILLed after step 3 is logged (its checkpoint not yet written), then
    `torchrun -m grpo train --resume`: the same logs and bitwise the same weights as the
    uninterrupted 2-rank run (with FSDP: from the gathered weights and optimizer state)."""
    path = _config(tmp_path, name, _two_ranks(name))
    killed = _torchrun(["-m", "grpo", "train", str(path)], env={"GRPO_KILL_AT": "logged:3"})
    assert killed.returncode != 0
    run = tmp_path / name
    assert (run / "checkpoint-2").is_dir() and not (run / "final").exists()
    resumed = _torchrun(["-m", "grpo", "train", str(path), "--resume"])
    if resumed.returncode != 0 and "terminate called without an active exception" in resumed.stderr:
        # a gloo rank's intermittent abort, cause not found yet (README, "Not yet"; seen once in
        # about ten runs of this test): resumed again, as a user would, the run must still be exact
        resumed = _torchrun(["-m", "grpo", "train", str(path), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("run directory:") == 1  # rank 0 alone speaks
    expected = two_ranks[name]
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]  # noqa: E731
    for log in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
        assert untimed(_rows(run / log)) == untimed(_rows(expected / log)), log
    _assert_close_weights(run, expected, atol=0)
    # one process cannot continue it: the global batch would change (and FSDP needs torchrun)
    refusal = (
        "shards over torchrun's processes"
        if "fsdp" in name
        else r"ran on 2 process\(es\), this one has 1.*torchrun --nproc_per_node 2"
    )
    with pytest.raises(ConfigError, match=refusal):
        Trainer.from_config(
            config.load(path, ["overwrite_output_dir=true"]), resume=run / "checkpoint-2"
        )


def test_what_fsdp_does_not_cover_is_refused():
    from grpo.backends import create_backend

    base = {**BASE, "output_dir": "/tmp/unused", "rewards": {"isolation": "thread"}}
    for override, named in [
        ("algorithm.beta=0.04", "algorithm.beta"),
        ("model.lora.r=8", "LoRA"),
        ("algorithm.advantage_estimator=gae", "gae"),
        ("cpu.decoding=fused", "fused"),
    ]:
        with pytest.raises(ConfigError, match=f"training.sharding=fsdp does not support .*{named}"):
            config.from_dict(base, ["training.sharding=fsdp", override])
    with pytest.raises(ConfigError, match="shards over torchrun's processes"):
        create_backend(config.from_dict(base, ["training.sharding=fsdp"]))


def test_a_group_never_straddles_ranks():
    cfg = config.from_dict(
        {**BASE, "output_dir": "/tmp/unused", "rewards": {"isolation": "thread"}}
    )
    validate(cfg, 2)  # 16 completions a rank: 4 whole groups each
    cfg.training.per_device_train_batch_size = (
        6  # 2 ranks' 12 completions are 3 groups, but not 1.5 a rank
    )
    with pytest.raises(ConfigError, match="a group never straddles ranks.*make it 4 or 8"):
        validate(cfg, 2)
    cfg.training.per_device_train_batch_size = 16
    cfg.rollout.engine = "vllm"
    with pytest.raises(ConfigError, match="rollout.engine: vllm .* does not run under torchrun"):
        validate(cfg, 2)
    cfg.rollout.engine = "hf"
    cfg.training.per_device_train_batch_size = 2
    with pytest.raises(
        ConfigError,
        match="per_device_train_batch_size x gradient_accumulation_steps = 2 .*make it 4$",
    ):
        validate(cfg, 2)


def test_dynamic_sampling_choice_in_global_order():
    # groups with spread first, in the order drawn (round by round, rank by rank), then the rest
    assert choose_groups([[False, True], [True, True]], 2) == ([(0, 1), (1, 0)], 0)
    assert choose_groups([[False, True], [False, False]], 3) == ([(0, 1), (0, 0), (1, 0)], 2)


def test_counts_and_shards():
    assert sum_counts(
        [{"a": 1, "b": {"errors": 2}}, {"a": 3, "b": {"errors": 1, "timeouts": 4}}]
    ) == {"a": 4, "b": {"errors": 3, "timeouts": 4}}
    assert [shard(7, 2, r) for r in range(2)] == [slice(0, 3), slice(3, 7)]
    assert [shard(1, 2, r) for r in range(2)] == [slice(0, 0), slice(0, 1)]
