"""Hostile input: every case ends in exit 2 with one `grpo:` line naming the key, file or row,
within seconds and without the memory growing past a few hundred MB.

All cases run through `grpo.cli.main` in one fresh process (so its imports are paid once and
its peak memory before a case is what that case starts from); each test reads its case's
exit status, stderr, time and peak-memory growth from there.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo.config import loading as config
from grpo.config import safe_yaml
from grpo.config.errors import ConfigError

BASE = {
    "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
    "data": {
        "task": "arithmetic",
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "instruction": "{expression}=",
            "num_train": 20,
            "num_eval": 4,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 2},
    "rewards": {"funcs": ["arithmetic_correct"], "isolation": "thread"},
    "training": {"max_steps": 1, "per_device_train_batch_size": 8},
    "logging": {"log_every": 1, "sample_every": 0},
}
GOOD_ROWS = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(1, 4) for b in range(1, 4)]
MAX_SECONDS = 20.0
MAX_GROWTH_MB = 400


def _bomb(levels: int = 9) -> str:
    """A YAML list whose anchors nest `levels` deep: 9**levels elements from a few hundred bytes."""
    parts = ["&a0 [1,1,1,1,1,1,1,1,1]"] + [
        f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)
    ]
    return "[" + ", ".join(parts) + "]"


def _cases(tmp: Path, write: bool = True) -> dict[str, tuple[list[str], str]]:
    """name -> (grpo's argv, a regex the one stderr line must match); the files they name are
    written into `tmp` when `write`."""
    base = tmp / "base.yaml"
    if write:
        base.write_text(json.dumps({**BASE, "output_dir": str(tmp / "run")}))  # JSON is YAML

    def yaml_file(name: str, text: str | bytes) -> str:
        if write:
            (tmp / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(tmp / name)

    def jsonl(name: str, extra: bytes = b"", rows=GOOD_ROWS) -> list[str]:
        if write:
            (tmp / name).write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + extra)
        return ["data.task=jsonl", f"data.train_file={tmp / name}"]

    def fifo() -> str:  # reading one blocks until a writer comes: it must be refused unread
        path = tmp / "rows.fifo"
        if write and not path.exists():
            os.mkfifo(path)
        return str(path)

    def template_model(name: str, template: str, in_config: bool = False) -> str:
        """A tiny model directory whose tokenizer has `template` as its chat template, in
        chat_template.jinja (as save_pretrained writes it) or in tokenizer_config.json."""
        folder = tmp / name
        if write and not folder.exists():
            from grpo.models.tiny import char_tokenizer, tiny_model

            tok = char_tokenizer()
            tok.chat_template = template
            tiny_model(tok, hidden_size=32, num_layers=1).save_pretrained(folder)
            tok.save_pretrained(folder)
            if in_config:
                (folder / "chat_template.jinja").unlink(missing_ok=True)
                config = json.loads((folder / "tokenizer_config.json").read_text())
                config["chat_template"] = template
                (folder / "tokenizer_config.json").write_text(json.dumps(config))
        return str(folder)

    chats = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in GOOD_ROWS
    ]

    def chat_model(name: str, template: str, in_config: bool = False) -> list[str]:
        return [
            f"model.name={template_model(name, template, in_config)}",
            "data.chat_template=auto",
            *jsonl("chats.jsonl", rows=chats),
            f"data.eval_file={tmp / 'chats.jsonl'}",
        ]

    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    huge = "{{ 'x' * 100000 * 100000 }}"
    pieces = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"
    sections = "\n".join(f"{k}: {json.dumps(v)}" for k, v in BASE.items() if k != "eval")
    train = ["train", str(base)]
    return {
        # the config file
        "yaml bomb in eval.temperatures": (
            ["train", yaml_file("b1.yaml", f"{sections}\neval: {{temperatures: {_bomb()}}}\n")],
            r"b1.yaml: its aliases expand to more than 100,000 values",
        ),
        "yaml bomb in rewards.funcs": (
            ["train", yaml_file("b2.yaml", f"x: &x {_bomb()}\n{sections}\n")],
            r"b2.yaml: its aliases expand",
        ),
        "yaml bomb as a whole section": (
            [
                "train",
                yaml_file(
                    "b3.yaml",
                    "a: &a {"
                    + ", ".join(
                        f"k{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9 if i else ["1"] * 9) + "]"
                        for i in range(9)
                    )
                    + "}\ntraining: *a\n",
                ),
            ],
            r"b3.yaml: its aliases expand",
        ),
        "config that is a list": (
            ["train", yaml_file("list.yaml", "- a\n- b\n")],
            r"config: expected a mapping of sections",
        ),
        "config that is a scalar": (
            ["train", yaml_file("scalar.yaml", "42\n")],
            r"config: expected a mapping of sections",
        ),
        "non-UTF-8 config": (
            ["train", yaml_file("latin1.yaml", b"output_dir: caf\xe9\n")],
            r"latin1.yaml \(line 1\): not UTF-8 text \(byte 0xe9\)",
        ),
        "YAML nested thousands deep": (
            ["train", yaml_file("deep.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n")],
            r"deep.yaml \(line 1\): nested more than 32 levels deep",
        ),
        "override nested thousands deep": (
            [*train, "eval.temperatures=" + "[" * 3000 + "]" * 3000],
            r"override eval.temperatures \(line 1\): nested more than 32 levels",
        ),
        "duplicate keys": (
            ["train", yaml_file("dup.yaml", "training:\n  max_steps: 1\n  max_steps: 2\n")],
            r"dup.yaml \(line 3\): the key 'max_steps' appears twice in one mapping \(first on line 2\)",
        ),
        "huge seed": (
            [*train, f"training.seed={2**70}"],
            r"training.seed: an integer of 71 bits is beyond any setting",
        ),
        "negative seed": ([*train, "data.seed=-1"], r"data.seed: must be in \[0, 2\*\*32\)"),
        "5000-digit integer": (
            [*train, "training.max_steps=" + "9" * 5000],
            r"override training.max_steps: a value cannot be read \(Exceeds the limit",
        ),
        "log_every 0": ([*train, "logging.log_every=0"], r"logging.log_every: must be > 0, got 0"),
        "log_every negative": (
            [*train, "logging.log_every=-3"],
            r"logging.log_every: must be > 0, got -3",
        ),
        "a billion arithmetic rows": (
            [*train, "data.arithmetic.num_train=1000000000"],
            r"data.arithmetic.num_train: 1,000,000,000 problems, more than the 1,000,000",
        ),
        "a million reward workers": (
            [*train, "rewards.workers=1000000"],
            r"rewards.workers: 1000000 worker processes for",
        ),
        "negative worker memory": (
            [*train, "rewards.worker_memory_mb=-1"],
            r"rewards.worker_memory_mb: must be in \[0, 1048576\] MiB",
        ),
        # numbers that become OS limits (prlimit, cgroups) are bounded when the config loads
        "a sandbox timeout of 1e308 s": (
            [*train, "rewards.sandbox.timeout=1e308"],
            r"rewards.sandbox.timeout: must be in \(0, 86400\] seconds, got 1e\+308",
        ),
        "a sandbox memory of 2^62 MiB": (
            [*train, f"rewards.sandbox.memory_mb={2**62}"],
            r"rewards.sandbox.memory_mb: must be in \(0, 1048576\] MiB",
        ),
        "a reward timeout of 1e300 s": (
            [*train, "rewards.timeout=1e300"],
            r"rewards.timeout: must be in \(0, 86400\] seconds",
        ),
        "output_dir under /proc": ([*train, "output_dir=/proc/grpo-test/x"], r"output_dir: "),
        # the dataset
        "/dev/zero as the data file": (
            [*train, "data.task=jsonl", "data.train_file=/dev/zero"],
            r"data file /dev/zero is not a regular file \(a device, FIFO or socket\)",
        ),
        "a FIFO as the data file": (
            [*train, "data.task=jsonl", f"data.train_file={fifo()}"],
            r"data file .*rows.fifo is not a regular file",
        ),
        "a data file named with a terminal escape": (
            [
                "train",
                yaml_file(
                    "escape.yaml",
                    "".join(f"{k}: {json.dumps(v)}\n" for k, v in BASE.items() if k != "data")
                    + f"output_dir: {tmp / 'escape'}\n"
                    # YAML's escapes: the path holds ESC and U+202E themselves
                    + 'data: {task: jsonl, train_file: "/nonexistent/\\x1b[2J\\u202ex.jsonl"}\n',
                ),
            ],
            r"data file /nonexistent/\\x1b\[2J\\u202ex.jsonl does not exist",
        ),
        "a directory as the data file": (
            [*train, "data.task=jsonl", f"data.train_file={tmp}"],
            r"data file .* is a directory, not a file",
        ),
        "non-UTF-8 dataset": (
            [*train, *jsonl("latin1.jsonl", extra=b'{"prompt": "caf\xe9", "answer": 1}\n')],
            r"latin1.jsonl:10: not UTF-8 text \(byte 0xe9 at column 16\)",
        ),
        "answer nested 200,000 deep": (
            [
                *train,
                *jsonl(
                    "deep.jsonl",
                    extra=b'{"prompt": "1+1=", "answer": '
                    + b"[" * 200_000
                    + b"]" * 200_000
                    + b"}\n",
                ),
            ],
            r"deep.jsonl:10: a value nested too deeply to read",
        ),
        "answer nested 200,000 deep, task hf": (
            [*train, "data.task=hf", f"data.train_file={tmp / 'deep.jsonl'}"],
            r"deep.jsonl:10: a value nested too deeply to read",
        ),
        "lone surrogate in a prompt": (
            [*train, *jsonl("surrogate.jsonl", extra=b'{"prompt": "1+1=\\ud800", "answer": 2}\n')],
            r"training rows: row 9 \(counting from 0\), column 'prompt': holds '\\ud800'",
        ),
        "5000-digit answer": (
            [
                *train,
                *jsonl(
                    "digits.jsonl", extra=b'{"prompt": "1+1=", "answer": ' + b"9" * 5000 + b"}\n"
                ),
            ],
            r"digits.jsonl:10: Exceeds the limit \(4300 digits\)",
        ),
        "NaN answer": (
            [*train, *jsonl("nan.jsonl", extra=b'{"prompt": "1+1=", "answer": NaN}\n')],
            r"nan.jsonl:10: NaN is not JSON; write null for a missing value",
        ),
        "dict answer": (
            [*train, *jsonl("dict.jsonl", extra=b'{"prompt": "1+1=", "answer": {"value": 2}}\n')],
            r"training rows: row 9 \(counting from 0\), column 'answer': a dict",
        ),
        "column named completions": (
            [
                *train,
                *jsonl("completions.jsonl", rows=[dict(r, completions="x") for r in GOOD_ROWS]),
            ],
            r"training rows: a column named 'completions', which is the name of an argument",
        ),
        "column named prompts": (
            [*train, *jsonl("prompts.jsonl", rows=[dict(r, prompts="x") for r in GOOD_ROWS])],
            r"training rows: a column named 'prompts'",
        ),
        "a 50 MB prompt line": (
            [
                *train,
                *jsonl(
                    "line50m.jsonl",
                    extra=b'{"prompt": "' + b"a" * 50_000_000 + b'", "answer": 2}\n',
                ),
            ],
            r"line50m.jsonl:10: a line longer than 16 MiB",
        ),
        "a 5 MB prompt": (
            [
                *train,
                *jsonl(
                    "p5m.jsonl", extra=b'{"prompt": "' + b"a" * 5_000_000 + b'", "answer": 2}\n'
                ),
            ],
            r"training rows: row 9 \(counting from 0\): its prompt is 5,000,000 characters",
        ),
        "a 900 KB prompt beyond the context": (
            [
                *train,
                *jsonl(
                    "p900k.jsonl", extra=b'{"prompt": "' + b"a" * 900_000 + b'", "answer": 2}\n'
                ),
            ],
            r"training rows: row 9's prompt is over \d+ tokens.* beyond the model's context",
        ),
        # a model directory's chat template (grpo.rewards.chat_template): code, bounded per rendering
        "a chat template that loops 10^10 times": (
            [*train, *chat_model("loop", loop)],
            r"the chat template of .*loop/chat_template.jinja took over 5 s to render one prompt",
        ),
        "a chat template that writes 10^10 characters at once": (
            [*train, *chat_model("huge", huge, in_config=True)],
            r"the chat template of .*huge/tokenizer_config.json needed more than the 512 MiB",
        ),
        "a chat template that writes 10^10 characters in pieces": (
            [*train, *chat_model("pieces", pieces), "rollout.max_prompt_length=8"],
            r"the chat template of .*pieces/chat_template.jinja wrote more than 4,194,304 characters",
        ),
        "a chat template that writes 10^10 characters, in evaluation": (
            [
                "eval",
                str(base),
                *chat_model("huge", huge, in_config=True),
                "rollout.max_prompt_length=8",
            ],
            r"the chat template of .*huge/tokenizer_config.json needed more than the 512 MiB",
        ),
    }


RUNNER = textwrap.dedent("""
    import contextlib, io, json, resource, sys, time
    from grpo import cli
    import torch, transformers  # noqa: F401 (paid before the first case, as a run pays it before its data)
    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        err = io.StringIO()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.monotonic()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = cli.main(argv)
            except BaseException as e:  # a raw traceback: the case fails, with what it raised
                rc = f"raised {type(e).__name__}: {str(e)[:300]}"
        results[name] = {"rc": rc, "stderr": err.getvalue(), "seconds": time.monotonic() - start,
                         "growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    cases = _cases(tmp)
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps({k: argv for k, (argv, _) in cases.items()})],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (results[name], pattern) for name, (_, pattern) in cases.items()}


@pytest.mark.parametrize("name", list(_cases(Path("unused"), write=False)))
def test_refused_in_one_line_with_exit_2(outcomes, name):
    result, pattern = outcomes[name]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["rc"] == 2, (result["rc"], result["stderr"][-2000:])
    grpo_lines = [line for line in lines if line.startswith("grpo:")]
    assert len(grpo_lines) == 1 and "Traceback" not in result["stderr"], result["stderr"][-2000:]
    assert re.search(pattern, grpo_lines[0]), grpo_lines[0]
    assert len(grpo_lines[0]) < 1000, "a message must not print a whole value"
    assert result["seconds"] < MAX_SECONDS, result
    assert result["growth_mb"] < MAX_GROWTH_MB, result


# ---------------------------------------------------------------- the loader itself


def test_aliases_within_the_bound_still_load():
    data = safe_yaml.parse("base: &b {lr: 0.1}\ncopy: *b\nmerged:\n  <<: *b\n  extra: 1\n", "t")
    assert data == {"base": {"lr": 0.1}, "copy": {"lr": 0.1}, "merged": {"lr": 0.1, "extra": 1}}


def test_expanded_size_counts_aliases_as_copies_and_stops_at_the_limit():
    shared = [1, 2, 3]
    assert safe_yaml.expanded_size([shared, shared]) == 1 + 2 * 4
    nested = [1] * 9
    for _ in range(8):
        nested = [nested] * 9
    assert safe_yaml.expanded_size(nested, limit=1000) == 1001  # counted up to the limit, not 9**9


def test_shown_cuts_long_values():
    assert safe_yaml.shown("x" * 500).endswith("...") and len(safe_yaml.shown("x" * 500)) < 130
    assert safe_yaml.shown([[1] * 100] * 100) == "<a list too large to show>"
    assert safe_yaml.shown([1, 2]) == "[1, 2]"


def test_from_dict_refuses_a_structure_too_large_to_be_a_config():
    nested = [1] * 9
    for _ in range(7):
        nested = [nested] * 9
    with pytest.raises(ConfigError, match=r"config: more than 100,000 values"):
        config.from_dict({"eval": {"temperatures": nested}})


# ---------------------------------------------------------------- a model's own code


def _remote_code_model(tmp_path: Path) -> tuple[Path, Path]:
    from grpo.config.model_data import ModelConfig
    from grpo.models.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(
        ModelConfig(name="tiny", tiny_hidden_size=32, tiny_num_layers=1)
    )
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    marker = tmp_path / "code-ran"
    # its own subclass: loading it registers the class for saving, which must not touch transformers' own
    (folder / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig\n"
        "class CustomConfig(LlamaConfig):\n    pass\n"
    )
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "custom.CustomConfig"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def test_a_local_model_with_its_own_code_is_refused_and_its_code_never_runs(tmp_path):
    folder, marker = _remote_code_model(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps({**BASE, "model": {"name": str(folder)}, "output_dir": str(tmp_path / "run")})
    )
    # a "yes" on stdin, as `yes | grpo train` gives: the terminal is never asked
    done = subprocess.run(
        [sys.executable, "-m", "grpo", "train", str(cfg)],
        input="y\n" * 100,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        "grpo: config error: model.trust_remote_code:" in done.stderr and "custom.py" in done.stderr
    )
    assert not marker.exists()


def test_trust_remote_code_lets_the_model_code_run(tmp_path):
    from grpo.config.model_data import ModelConfig
    from grpo.models.loading import load_model_and_tokenizer

    folder, marker = _remote_code_model(tmp_path)
    with pytest.raises(ConfigError, match=r"model.trust_remote_code: .*config.json's auto_map"):
        load_model_and_tokenizer(ModelConfig(name=str(folder)))
    assert not marker.exists()
    try:
        load_model_and_tokenizer(ModelConfig(name=str(folder), trust_remote_code=True))
    except Exception:
        pass  # the stand-in code is not a whole model; what matters is that it was allowed to run
    assert marker.read_text() == "ran"


def test_a_checkpoints_config_cannot_grant_trust_remote_code_to_export(tmp_path):
    from grpo.run import checkpoint
    from grpo.run.export import export_checkpoint

    folder, marker = _remote_code_model(tmp_path)

    def write(
        tmp: Path,
    ) -> None:  # a shared "checkpoint" whose config asks to run the base model's code
        (tmp / checkpoint.ADAPTER_CONFIG).write_text("{}")
        (tmp / checkpoint.STATE).write_bytes(b"")
        (tmp / checkpoint.CONFIG).write_text(
            json.dumps({"model": {"name": str(folder), "trust_remote_code": True}})
        )

    shared = checkpoint.atomic_directory_write(tmp_path / "shared", write, step=1)
    with pytest.raises(
        ConfigError, match=r"sets model.trust_remote_code, which a checkpoint's config cannot grant"
    ):
        export_checkpoint(shared, tmp_path / "out", merge=True)
    assert not marker.exists()


def test_task_hf_json_files_are_checked_as_one_value_or_as_lines(tmp_path):
    from grpo.tasks.data import check_text_file

    (tmp_path / "array.json").write_text(json.dumps(GOOD_ROWS))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in GOOD_ROWS))
    # a list of rows, and JSON lines under a .json name, both pass
    check_text_file(tmp_path / "array.json")
    check_text_file(tmp_path / "lines.json")
    (tmp_path / "deep.json").write_text(
        json.dumps(GOOD_ROWS[0]) + "\n" + '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    )
    with pytest.raises(ConfigError, match=r"deep.json:2: a value nested too deeply to read"):
        check_text_file(tmp_path / "deep.json")
    (tmp_path / "broken.json").write_text('[{"prompt": "1+1="}, ')
    with pytest.raises(ConfigError, match=r"broken.json: not valid JSON"):
        check_text_file(tmp_path / "broken.json")


def test_a_checkpoints_config_is_read_as_bounded_yaml_on_resume(tmp_path):
    from grpo.run import checkpoint

    def write(tmp: Path) -> None:  # a shared checkpoint whose config.yaml is an alias bomb
        (tmp / checkpoint.STATE).write_bytes(b"")
        (tmp / checkpoint.CONFIG).write_text(f"training: {_bomb()}\n")

    shared = checkpoint.atomic_directory_write(tmp_path / "shared", write, step=1)
    with pytest.raises(
        ConfigError, match=r"--resume .*shared: its config.yaml is unreadable \(.*aliases expand"
    ):
        checkpoint.load_checkpoint(shared, config.from_dict({}))


def test_names_a_user_wrote_reach_the_console_escaped(tokenizer, tmp_path, make_trainer, capsys):
    """A reward named with a terminal's clear-screen sequence and a right-to-left override: the
    step's console line shows them escaped (nothing a terminal would run or reorder)."""
    name = "evil\x1b[2J\u202egnp.exe"

    def reward(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    trainer = make_trainer(
        tokenizer,
        tmp_path,
        ["training.max_steps=1", "training.per_device_train_batch_size=16", "logging.log_every=1"],
        reward_funcs={name: reward},
    )
    trainer.train()
    out = capsys.readouterr()
    console = out.out + out.err
    # (progress bars draw with escape sequences of their own: the name's are what must not be run)
    assert "\x1b[2J" not in console and "\u202e" not in console
    assert "evil\\x1b[2J\\u202egnp.exe" in console  # the line is there, escaped
    assert safe_yaml.escaped("a\tb\nc\x07\u200f") == "a\tb\nc\\x07\\u200f"
