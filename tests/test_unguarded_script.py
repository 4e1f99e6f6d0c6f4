"""A training script written the TRL way, with no `if __name__ == "__main__":`, is run once:
no worker (the reward workers, math_answer's math-verify worker) imports the main script.

Each test runs a script as `python script.py`, as a user does; the script appends a line to a
file each time its top level runs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

# The first seed's script (tests/test_trl_api.py's SEED_SCRIPT), unguarded as the seed wrote it, its
# reward replaced by one that calls grpo's math checking: \boxed{\frac{1}{2}} against 0.5, which only
# math-verify, in its worker process, finds equal; its sizes tiny, and no report at the end. A second
# reward, from a module beside the script, records the process it runs in.
SCRIPT = r"""
import json
import os
import sys

with open(sys.argv[1], "a") as f:  # one line each time this top level runs
    f.write(f"{os.getpid()}\n")

from grpo import GRPOConfig, GRPOTrainer
from grpo.rewards.math_answer import MathAnswer

from beside import where_it_runs

math_answer = MathAnswer()
results = []


def math_reward(completions, **kwargs):
    scores = math_answer([r"\boxed{\frac{1}{2}}"] * len(completions), answer=[0.5] * len(completions))
    results.extend(scores)
    return scores


config = GRPOConfig(
    output_dir=sys.argv[2],
    num_generations=2,
    per_device_train_batch_size=4,
    max_completion_length=4,
    learning_rate=1e-3,
    max_steps=2,
    grpo_overrides=["model.tiny_hidden_size=32", "model.tiny_num_layers=1", "logging.sample_every=0"],
)
trainer = GRPOTrainer(
    model="tiny",
    reward_funcs=[math_reward, where_it_runs],
    args=config,
    train_dataset=[{"prompt": f"{a}+{a}="} for a in range(4)],
)
trainer.trainer.log.report = lambda: None  # the run's plots are not the subject here, and take seconds
trainer.train()
with open(sys.argv[3], "w") as f:
    json.dump(results, f)
"""

BESIDE = """
import os
import sys


def where_it_runs(completions, **kwargs):
    with open(os.environ["WHERE_IT_RUNS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return [0.0] * len(completions)
"""


def test_unguarded_seed_script_with_math_checking_runs_once(tmp_path):
    """The script's top level runs once, and every math comparison, in math_answer's worker,
    succeeds (GRPOTrainer runs a script's own rewards in threads: the module's one too, here)."""
    (tmp_path / "seed.py").write_text(SCRIPT)
    (tmp_path / "beside.py").write_text(BESIDE)
    runs, results, where = tmp_path / "runs.txt", tmp_path / "results.json", tmp_path / "where.txt"
    done = subprocess.run(
        [sys.executable, "seed.py", str(runs), str(tmp_path / "out"), str(results)],
        cwd=tmp_path,
        env={**os.environ, "WHERE_IT_RUNS": str(where)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (trainer_pid,) = runs.read_text().split()  # the top level ran once
    # 2 steps x 4 completions, every comparison equal
    assert json.loads(results.read_text()) == [1.0] * 8
    assert set(where.read_text().split()) == {trainer_pid}


UNGUARDED = r"""
import os
import sys

from grpo.rewards.execution import RewardExecutor

from beside import where_it_runs

with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\n")


def in_script(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


inputs = {"prompts": ["p"], "completions": ["a"], "completion_ids": [[1]]}
for _ in range(2):  # two executors (a RewardSet makes a new one after close): one warning
    executor = RewardExecutor(["in_script", "where_it_runs"], [in_script, where_it_runs], workers=1)
    calls = executor(inputs, 1)
    executor.close()
print(executor.in_worker(0), executor.in_worker(1), *[c.status for (c,) in calls], int(calls[0][0].values[0]))
"""


def test_an_unguarded_scripts_functions_run_in_threads_and_its_modules_in_workers(tmp_path):
    """rewards.isolation=process with an unguarded script: the script's function runs in a thread
    of the trainer, with one warning that says why; the function of the user's module beside it
    runs in a worker, which imports that module through the trainer's sys.path; the script's top
    level runs once."""
    (tmp_path / "unguarded.py").write_text(UNGUARDED)
    (tmp_path / "beside.py").write_text(BESIDE)
    runs, where = tmp_path / "runs.txt", tmp_path / "where.txt"
    done = subprocess.run(
        [sys.executable, "unguarded.py", str(runs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "WHERE_IT_RUNS": str(where)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (trainer_pid,) = runs.read_text().split()
    assert done.stdout.split() == ["False", "True", "ok", "ok", trainer_pid]
    pids = where.read_text().split()
    assert len(pids) == 2 and trainer_pid not in pids  # a worker each time
    assert done.stderr.count('no `if __name__ == "__main__":`') == 1
    assert "Put the script's training under" in done.stderr


GUARDED = r"""
import os
import sys

with open(sys.argv[1], "a") as f:  # outside the guard: runs in the trainer and in each worker loading the script
    f.write(f"top {os.getpid()}\n")


def pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


if __name__ == "__main__":
    from grpo.rewards.execution import RewardExecutor

    with open(sys.argv[1], "a") as f:
        f.write(f"main {os.getpid()}\n")
    executor = RewardExecutor(["pid"], [pid], workers=1)
    (call,), = executor({"prompts": ["p"], "completions": ["a"], "completion_ids": [[1]]}, 1)
    executor.close()
    print(executor.in_worker(0), call.status, int(call.values[0]))
"""


def test_a_guarded_scripts_functions_run_in_workers(tmp_path):
    """A script whose training is guarded is loaded in the worker as __mp_main__ (its top level
    runs there, its guarded part does not), as multiprocessing's spawn did."""
    (tmp_path / "guarded.py").write_text(GUARDED)
    runs = tmp_path / "runs.txt"
    done = subprocess.run(
        [sys.executable, str(tmp_path / "guarded.py"), str(runs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    in_worker, status, worker_pid = done.stdout.split()
    assert (in_worker, status) == ("True", "ok")
    lines = Path(runs).read_text().splitlines()
    trainer_pid = lines[0].split()[1]
    assert lines == [f"top {trainer_pid}", f"main {trainer_pid}", f"top {worker_pid}"]
