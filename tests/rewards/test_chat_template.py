"""Chat templates rendered within limits (grpo.rewards.chat_template): exactly what transformers
renders, for the project's templates and the ones TRL ships (and the same errors, refused); a
template past its time, output or memory limit refused naming its file; the worker shared, restarted after a kill, and kept by a
fork to its parent."""

import json
import os
import re
import threading
from pathlib import Path

import pytest

from grpo.config.errors import ConfigError
from grpo.models.tiny import char_tokenizer
from grpo.rewards import chat_template
from grpo.rewards.chat_template import TemplateFailed, TemplateRefused, render, render_ids
from grpo.tasks.data import MAX_PROMPT_CHARS

try:
    import trl

    TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
except ImportError:  # the oldest versions' venv has no TRL: the tests' own template only
    TRL_TEMPLATES = Path("/nonexistent")
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
"""10^10 iterations that write nothing (the sandbox's range stops at 100,000 items each)."""
HUGE = "{{ 'x' * 100000 * 100000 }}"
"""10^10 characters in one expression."""
PIECES = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"
"""10^10 characters written 100,000 at a time."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALLS = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "1+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": CALLS},
        {"role": "tool", "name": "add", "content": "3"},
    ],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nhello"},
        {"role": "user", "content": "ünïcode ✓"},
    ],
]


def _tokenizer(template: str):
    tok = char_tokenizer()
    tok.chat_template = template
    return tok


def _real_templates() -> list[tuple[str, str]]:
    names = [
        "qwen2_5",
        "qwen3",
        "qwen3_instruct_2507",
        "gemma",
        "gemma3",
        "llama3_2",
        "phi3",
        "gptoss",
    ]
    return [
        (n, (TRL_TEMPLATES / f"{n}.jinja").read_text())
        for n in names
        if (TRL_TEMPLATES / f"{n}.jinja").is_file()
    ]


def _outcome(fn, *args, **kwargs):
    """("ok", result), or the error: the template's own, as transformers raises it or as grpo
    refuses it (TemplateFailed, which keeps its type and its message on one line)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except TemplateFailed as e:
        return ("raised", e.error_type, e.detail)
    except Exception as e:
        return ("raised", type(e).__name__, " ".join(str(e).split()))


@pytest.mark.parametrize("name", [n for n, _ in _real_templates()] + ["tool template"])
def test_renders_exactly_what_transformers_renders(name, tool_tokenizer):
    template = dict(_real_templates()).get(name) or tool_tokenizer.chat_template
    tok = _tokenizer(template)
    for tools in (None, TOOLS):
        for flag in (True, False):
            for extra in ({}, {"enable_thinking": False}):
                kwargs = {"add_generation_prompt": flag, **extra}
                if tools:
                    kwargs["tools"] = tools
                expected = []
                for c in CONVERSATIONS:
                    want = _outcome(tok.apply_chat_template, c, tokenize=False, **kwargs)
                    assert _outcome(lambda *a, **k: render(*a, **k)[0], tok, [c], **kwargs) == want
                    ids = _outcome(
                        tok.apply_chat_template, c, tokenize=True, return_dict=False, **kwargs
                    )
                    assert _outcome(render_ids, tok, c, **kwargs) == ids
                    expected.append(want)
                if all(w[0] == "ok" for w in expected):  # a batch at once, as the trainer sends it
                    assert render(tok, CONVERSATIONS, **kwargs) == [w[1] for w in expected]


def test_a_template_that_loops_without_end_is_refused_at_the_time_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)
    tok = _tokenizer(LOOP)
    with pytest.raises(
        TemplateRefused, match=r"took over 0.5 s to render one prompt \(a loop without end\?\)"
    ):
        render(tok, [[{"role": "user", "content": "hi"}]])
    # the killed worker is replaced for the next rendering
    assert render(
        _tokenizer("{{ messages[0].content }}"), [[{"role": "user", "content": "hi"}]]
    ) == ["hi"]


def test_a_loop_over_the_messages_is_bounded_from_a_thread_too(monkeypatch):
    """A reward model's texts are rendered from the reward executor's threads (no SIGALRM there)."""
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)
    tok = _tokenizer(
        "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% for c in m.content %}"
        "{% endfor %}{% endfor %}{% endfor %}{% endfor %}"
    )
    errors = []

    def run():
        try:
            render(tok, [[{"role": "user", "content": "x" * 5000}]])
        except TemplateRefused as e:
            errors.append(str(e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert len(errors) == 1 and "took over 0.5 s" in errors[0]


def test_output_past_the_limit_is_refused_and_output_within_it_kept():
    with pytest.raises(
        TemplateRefused, match=r"wrote more than 4,194,304 characters for one prompt"
    ):
        render(_tokenizer(PIECES), [[{"role": "user", "content": "hi"}]])
    # a million characters of template text around a prompt: within the limit, rendered whole
    big = render(
        _tokenizer("{% for i in range(1000) %}{{ 'y' * 1000 }}{% endfor %}"),
        [[{"role": "user", "content": "hi"}]],
    )
    assert big == ["y" * 1_000_000]
    assert chat_template.MAX_RENDERED_CHARS == 4 * MAX_PROMPT_CHARS


def test_memory_past_the_limit_is_refused_and_the_worker_stays_within_it():
    with pytest.raises(TemplateRefused, match=r"needed more than the 512 MiB its renderer may use"):
        render(_tokenizer(HUGE), [[{"role": "user", "content": "hi"}]])
    worker = chat_template._SHARED.worker
    status = Path(f"/proc/{worker.pid}/status").read_text()
    peak_kb = int(status.split("VmHWM:")[1].split()[0])
    assert peak_kb < (chat_template.MEMORY_MB + 64) << 10, status


def test_a_refusal_names_the_file_the_template_came_from(tmp_path):
    tok = _tokenizer(HUGE)
    tok.save_pretrained(tmp_path / "jinja")
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path / "jinja")
    with pytest.raises(
        TemplateRefused,
        match=f"the chat template of {re.escape(str(tmp_path / 'jinja' / 'chat_template.jinja'))} needed",
    ):
        render(loaded, [[{"role": "user", "content": "hi"}]])
    # a template kept in tokenizer_config.json, as older model directories keep it
    folder = tmp_path / "config"
    tok.save_pretrained(folder)
    for jinja in folder.glob("chat_template.jinja"):
        jinja.unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HUGE}))
    loaded = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(
        TemplateRefused,
        match=f"the chat template of {re.escape(str(folder / 'tokenizer_config.json'))} needed",
    ):
        render(loaded, [[{"role": "user", "content": "hi"}]])
    # set in memory over a directory's tokenizer: not blamed on its files
    loaded.chat_template = PIECES
    with pytest.raises(TemplateRefused, match=r"the tokenizer of .*config \(set in memory"):
        render(loaded, [[{"role": "user", "content": "hi"}]])


def test_a_templates_own_error_is_refused_with_its_message():
    tok = _tokenizer("{{ raise_exception('only user messages') }}")
    with pytest.raises(TemplateFailed, match="with its own error: 'only user messages'"):
        render(tok, [[{"role": "user", "content": "hi"}]])
    with pytest.raises(ConfigError, match="a chat prompt with no messages cannot be rendered"):
        render(tok, [[]])


def test_no_template_and_plain_text_start_no_worker(monkeypatch):
    from grpo.tasks.data import render_prompts

    monkeypatch.setattr(chat_template, "_SHARED", chat_template._Renderer())
    tok = char_tokenizer()
    assert render_prompts([[{"role": "user", "content": "hi"}], "2+2="], tok, True, None) == [
        ("hi\n", False),
        ("2+2=", False),
    ]
    tok.chat_template = "{{ messages[0].content }}!"
    assert render_prompts(["2+2="], tok, True, None) == [("2+2=", False)]
    assert chat_template._SHARED.worker is None
    assert render_prompts([[{"role": "user", "content": "hi"}]], tok, True, None) == [("hi!", True)]
    assert chat_template._SHARED.worker is not None
    chat_template._SHARED.close()


def test_a_fork_starts_its_own_worker_and_leaves_its_parents():
    tok = _tokenizer("{{ messages[0].content }}")
    assert render(tok, [[{"role": "user", "content": "a"}]]) == ["a"]
    parent = chat_template._SHARED.worker.pid
    pid = os.fork()
    if pid == 0:
        ok = chat_template._SHARED.worker is None and render(
            tok, [[{"role": "user", "content": "b"}]]
        ) == ["b"]
        ok = ok and chat_template._SHARED.worker.pid != parent
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert chat_template._SHARED.worker.pid == parent and render(
        tok, [[{"role": "user", "content": "c"}]]
    ) == ["c"]


def test_a_reward_models_template_is_bounded_and_named(tmp_path, save_reward_model):
    from grpo.rewards.reward_model import RewardModel

    save_reward_model(tmp_path / "rm", chat_template=PIECES)
    rm = RewardModel(tmp_path / "rm", device="cpu")
    prompt = [{"role": "user", "content": "2+2?"}]
    with pytest.raises(
        TemplateRefused, match=rf"of {re.escape(str(tmp_path / 'rm'))}/\S+ wrote more than"
    ):
        rm([prompt], [" 4"], [[0]])
    # a batch's texts rendered together equal each rendered alone, plain ones untouched
    rm.tokenizer.chat_template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    prompts = [prompt, "3+3?", [{"role": "user", "content": "1+1?"}]]
    assert rm.texts(prompts, [" 4", " 6", " 2"]) == [
        rm.text(p, c) for p, c in zip(prompts, [" 4", " 6", " 2"])
    ]
    assert rm.texts(prompts, [" 4", " 6", " 2"])[1] == ("3+3? 6", False)
