"""Generation ahead of training (rollout.max_staleness > 0, grpo.training.ahead) against a
`grpo serve --engine hf` in a thread of this process (tests/conftest.py's serve_in_thread):

- the same config run twice gives the same metrics (timings aside) and final weights: the
  schedule is fixed, whatever the timing; every step's batch is sampled from the weights the
  schedule names (async/staleness_max = min(step - 1, k), never above k), and the first step's is
  the synchronous run's own (the same prompts, seeds and initial weights);
- generating ahead is refused with an in-process engine, with dynamic sampling, with tools;
  a checkpoint of a config from before the keys existed still resumes;
- the server stopped mid-run: the trainer saves the step and stops with one grpo: line (exit 6),
  and --resume against a new server finishes the run;
- rollout_wait fires on a generator slowed on purpose, and the trainer says once that it waits;
  it stays silent when the update is the longer part;
- TRL's asynchronous trainer by its import: a TRL-style script trains against the server;
- the push of step t's weights runs beside step t + 1's first phases and sends step t's weights,
  however late it reads them (the update waits for it); its metrics are step t + 1's row.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from serve_settings import SERVED_TINY

from grpo.cli import main
from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.run import checkpoint
from grpo.training import ahead
from grpo.training.trainer import Trainer

# a third of all first characters rewarded: most groups have spread, the weights move every step;
# a reward that sleeps makes the update the longer part of a step (the generator is hidden)
REWARDS = """
import time


def third(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(bool(t) and ord(t[0]) % 3 == 0) for t in texts]


def slow_third(completions, **kwargs):
    time.sleep(0.3)
    return third(completions)
"""
# timings, and the one health check that reads them (rollout_wait fires by how long steps took)
TIMING = ("time/", "tokens_per_second", "health/rollout_wait")


def _data(tmp_path, url: str, name: str, k: int, reward: str = "third", **sections) -> dict:
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    data = copy.deepcopy(SERVED_TINY)
    data.update(
        output_dir=str(tmp_path / name),
        rewards={**data["rewards"], "funcs": [f"{rewards}:{reward}"]},
        training={"max_steps": 5, "per_device_train_batch_size": 16, "learning_rate": 0.01},
        eval={"after": False},
        logging={"sample_every": 1},
    )
    data["rollout"] = {
        **data["rollout"],
        "engine": "server",
        "server": {"url": url, "timeout": 5},
        "max_staleness": k,
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return data


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _train(data: dict) -> list[dict]:
    Trainer.from_config(loading.from_dict(data)).train()
    return _rows(Path(data["output_dir"]) / "metrics.jsonl")


def test_two_runs_with_max_staleness_2_are_the_same_and_keep_the_bound(tmp_path, serve_in_thread):
    url = serve_in_thread().url
    first = _train(_data(tmp_path, url, "first", 2, training={"save_steps": 2}))
    second = _train(_data(tmp_path, url, "second", 2))
    assert _untimed(first) == _untimed(second)
    wa = load_file(tmp_path / "first" / "final" / "model.safetensors")
    wb = load_file(tmp_path / "second" / "final" / "model.safetensors")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    # the schedule: step s's batch from the weights after step max(0, s - 1 - 2)
    assert [r["async/staleness_max"] for r in first] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(r["async/staleness_mean"] <= 2 for r in first)
    # corrected by default (rollout_correction auto -> token_truncate): the weights are logged,
    # and once the policy moved they are not all 1
    assert all("rollout/is_weight" in r for r in first)
    assert any(r["rollout/logprob_diff_max"] > 0 for r in first[2:])

    # the first step's batch is the synchronous run's: same prompts, seeds and initial weights
    sync = _train(_data(tmp_path, url, "sync", 0))
    samples = [_rows(tmp_path / n / "samples.jsonl") for n in ("first", "sync")]
    assert samples[0][0] == samples[1][0]
    assert first[0]["reward"] == sync[0]["reward"] and "async/staleness_max" not in sync[0]
    # later ones are sampled from older weights than the synchronous run's: the same prompts
    prompts = [[row["prompt"] for row in s] for s in samples]
    assert prompts[0] == prompts[1]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["rollout.max_staleness=2"],
            r"rollout.max_staleness=2: .*set rollout.engine: server and start `grpo serve`",
        ),
        (
            ["rollout.engine=server", "rollout.max_staleness=1", "rollout.weight_sync_steps=3"],
            r"rollout.weight_sync_steps: must be in \[1, rollout.max_staleness \+ 1 = 2\]",
        ),
        (
            ["rollout.engine=server", "rollout.max_staleness=2", "algorithm.dynamic_sampling=true"],
            r"rollout.max_staleness=2 with algorithm.dynamic_sampling",
        ),
        (
            ["rollout.engine=server", "rollout.max_staleness=2", "rollout.tools=[python]"],
            r"tools and environments run in the trainer's process",
        ),
        (
            ["rollout.engine=server", "rollout.max_staleness=33"],
            r"rollout.max_staleness: steps in \[0, 32\]",
        ),
    ],
)
def test_what_generating_ahead_cannot_run_with_is_refused_at_load(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        loading.from_dict({}, overrides)


def test_an_in_process_engine_with_max_staleness_is_one_grpo_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path / "run"), "rollout": {"max_staleness": 1}})
    )
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo: config error: rollout.max_staleness=1:"), err
    assert "grpo serve" in err[0] and not (tmp_path / "run").exists()


def test_a_checkpoint_from_before_the_keys_existed_is_the_same_config():
    now = yaml.safe_load(yaml.safe_dump(loading.from_dict({}).to_dict()))
    saved = copy.deepcopy(now)
    del saved["rollout"]["max_staleness"], saved["rollout"]["weight_sync_steps"]
    saved["algorithm"]["rollout_correction"] = "none"  # the default before `auto`
    assert now["algorithm"]["rollout_correction"] == "auto"
    assert checkpoint.config_differences(saved, now) == []
    ahead_now = yaml.safe_load(
        yaml.safe_dump(
            loading.from_dict({}, ["rollout.engine=server", "rollout.max_staleness=2"]).to_dict()
        )
    )
    assert checkpoint.config_differences(ahead_now, now) != []  # a real change is still named
    explicit = copy.deepcopy(ahead_now)
    explicit["algorithm"]["rollout_correction"] = "token_truncate"  # what auto means there
    assert checkpoint.config_differences(explicit, ahead_now) == []


def test_a_lost_server_saves_the_step_and_stops_with_one_line(tmp_path, serve_in_thread, capsys):
    serving = serve_in_thread()
    port = int(serving.url.rsplit(":", 1)[1])
    data = _data(tmp_path, serving.url, "run", 2, training={"max_steps": 6})
    data["rollout"]["server"]["timeout"] = 1  # the push that finds the server gone waits this long
    path = tmp_path / "run.yaml"
    loading.save(loading.from_dict(data), path)

    # the server goes away as step 3 ends: the push of its weights fails beside step 4 (whose batch
    # was generated before), the batch drawn for those weights is never made, and step 5 stops
    original = ahead.AheadSource.policy_changed

    def stop_server_at_3(source, model):
        if source.trained == 2:
            with source.cond:  # no generation in flight: the push is what finds the server gone
                source._wait(source._all_generated, "the batches drawn")
            serving.shutdown()
        original(source, model)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ahead.AheadSource, "policy_changed", stop_server_at_3)
        assert main(["train", str(path)]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo: training stopped: while generating ahead"), (
        err
    )
    assert "checkpoint-4" in err[0] and "--resume" in err[0]
    assert checkpoint.verify(tmp_path / "run" / "checkpoint-4") == ""

    serve_in_thread(port=port)  # started again where the config says
    assert main(["train", str(path), "--resume"]) == 0
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # the batches the failure left ungenerated come from the weights resumed: never staler than k
    assert all(r["async/staleness_max"] <= 2 for r in rows)


def test_a_slow_generator_fires_rollout_wait_and_is_said_once(
    tmp_path, serve_in_thread, monkeypatch, caplog
):
    from grpo.serve import hf

    generate = hf.HFServer._generate

    def slowly(self, request):
        import time

        time.sleep(0.4)  # a server slowed on purpose
        return generate(self, request)

    url = serve_in_thread().url
    monkeypatch.setattr(ahead, "SAY_WAITING_AFTER", 0.1)
    monkeypatch.setattr(hf.HFServer, "_generate", slowly)
    data = _data(tmp_path, url, "slow", 1, health={"patience": 2})
    with caplog.at_level(logging.WARNING):
        rows = _train(data)
    assert sum(r["health/rollout_wait"] for r in rows) >= 2  # fired at step 2 and held
    assert caplog.text.count("waiting for the generation server") == 1
    assert caplog.text.count("rollout_wait") >= 1

    # the update the longer part of each step: the generator is hidden, the check silent
    monkeypatch.setattr(hf.HFServer, "_generate", generate)
    rows = _train(_data(tmp_path, url, "healthy", 1, "slow_third", health={"patience": 2}))
    assert all(r["health/rollout_wait"] == 0 for r in rows)
    assert all(r["health/stale_ratio_drift"] == 0 for r in rows)


def test_weight_sync_steps_2_keeps_the_bound_and_evaluates_the_trained_weights(
    tmp_path, serve_in_thread
):
    from grpo.rollout.server import weights_checksum

    serving = serve_in_thread()
    data = _data(
        tmp_path,
        serving.url,
        "every2",
        2,
        rollout={"weight_sync_steps": 2},
        eval={"every": 1, "after": True},
    )
    trainer = Trainer.from_config(loading.from_dict(data))
    trainer.train()
    rows = _rows(tmp_path / "every2" / "metrics.jsonl")
    # step s from the weights after step 2 * ceil(max(0, s - 3) / 2): 0, 0, 0, 2, 2
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 1.0, 2.0]
    # every evaluation is of the trained weights: the last one left the server holding step 5's,
    # which the schedule never pushes (it pushes after steps 2 and 4)
    status, held = serving.app.weights_checksum(None, None)
    assert status == 200 and held["digest"] == weights_checksum(trainer.model)["digest"]
    assert (
        len(_rows(tmp_path / "every2" / "eval.jsonl")) == 2 * 5
    )  # greedy and sampled, steps 1-4 and after


def test_a_checkpoints_batches_are_checked_as_untrusted_input(tmp_path, serve_in_thread):
    from grpo.training.build import build_parts

    url = serve_in_thread().url
    _train(_data(tmp_path, url, "run", 2, training={"max_steps": 6, "save_steps": 2}))
    state = torch.load(tmp_path / "run" / "checkpoint-2" / "train_state.pt", weights_only=True)
    queue = state["rollout_source"]
    assert [b["index"] for b in queue["batches"]] == [2, 3, 4]  # k + 1 drawn, all generated
    assert all(b["rollout"] is not None for b in queue["batches"])
    cfg = loading.from_dict(_data(tmp_path, url, "again", 2, training={"max_steps": 6}))
    queue["batches"][1]["rollout"]["completion_ids"][0, 0] = 10**6
    with pytest.raises(
        ConfigError, match="do not fit this run: ValueError: rollout completion_ids"
    ):
        build_parts(cfg, restore=state)
    queue["batches"].pop()
    with pytest.raises(ConfigError, match="next batch 5 after 2 batches from step 2"):
        build_parts(cfg, restore=state)

    # the push not yet in a row: the one of step 2's weights, which step 3's row gives
    state = torch.load(tmp_path / "run" / "checkpoint-2" / "train_state.pt", weights_only=True)
    pushes = state["rollout_source"]["pushes"]
    assert [version for version, _ in pushes] == [2] and pushes[0][1]["weight_sync/bytes"] > 0
    for bad, why in (
        ([[3, {}]], "a push of the weights after step 3, after step 2"),
        ([[2, {"weight_sync/bytes": float("nan")}]], "not a few named finite numbers"),
        ([[2, {"x" * 65: 1.0}]], "not a few named finite numbers"),
        ([[2, {}]] * 5, "pushes: not a list of at most 4"),
        ("pushes", "pushes: not a list"),
    ):
        state["rollout_source"]["pushes"] = bad
        with pytest.raises(ConfigError, match=why):
            build_parts(cfg, restore=state)


def test_a_slow_push_sends_its_steps_weights_beside_the_next_steps_start(
    tmp_path, serve_in_thread, monkeypatch
):
    import time

    from grpo.rollout.server import ServerEngine, weights_checksum

    serving = serve_in_thread()
    after: dict[int, str] = {}  # the trainer's weights after each step
    pushed: list[str] = []  # what the server held after each scheduled push
    pushing: list[tuple[float, float]] = []
    taken: list[float] = []
    changed, sync, next_batch = (
        ahead.AheadSource.policy_changed,
        ServerEngine.sync_weights,
        ahead.AheadSource.next_batch,
    )

    def record_changed(source, model):
        after[source.trained + 1] = weights_checksum(model)["digest"]
        changed(source, model)

    def slow_sync(engine, policy):
        start = time.monotonic()
        time.sleep(0.3)  # a push that reads the weights late: the next step has begun by then
        sync(engine, policy)
        pushing.append((start, time.monotonic()))
        pushed.append(serving.app.weights_checksum(None, None)[1]["digest"])

    def record_next_batch(source, step):
        generated = next_batch(source, step)
        taken.append(time.monotonic())
        return generated

    monkeypatch.setattr(ahead.AheadSource, "policy_changed", record_changed)
    monkeypatch.setattr(ServerEngine, "sync_weights", slow_sync)
    monkeypatch.setattr(ahead.AheadSource, "next_batch", record_next_batch)
    rows = _train(_data(tmp_path, serving.url, "slow_push", 1))
    # k = 1, 5 steps: pushes after steps 1-3 (step 5's batch is the last one), each of its own
    # step's weights, though the update that follows it was ready to change them
    assert pushed == [after[1], after[2], after[3]]
    # the next step took its batch while the push ran: it overlapped
    assert any(start < t < end for start, end in pushing for t in taken)
    # a push is the row of the step it ran beside
    assert ["weight_sync/bytes" in r for r in rows] == [False, True, True, True, False]
