"""Chat templates that fail (grpo.rewards.chat_template): each kind of failure refused with one
line naming the template's file and the fix (a ConfigError; `grpo train` exits 2 with no
traceback), never the exception Jinja raised; a set of renderings bounded in time in all, with
a progress bar when it runs long; a template over the size limit refused before it renders."""

import json
import re
from pathlib import Path

import pytest

from grpo.config.errors import ConfigError
from grpo.models.tiny import char_tokenizer
from grpo.rewards import chat_template
from grpo.tasks.data import PromptEncoder

CHAT = [{"role": "user", "content": "hi"}]
OTHER_TEMPLATE = "or give the tokenizer a chat template you trust (data.chat_template=never"
FAILING = {
    # name: (template, what the line must say after the file's name, the fix it must name)
    "raise_exception": (
        "{% if messages[0].role != 'system' %}\n{{ raise_exception('the first message must be the "
        "system prompt') }}{% endif %}",
        r" refused a prompt at line 2 with its own error: 'the first message must be the system "
        r"prompt'; make the prompts what the template accepts",
        OTHER_TEMPLATE,
    ),
    "undefined name": (
        "{{ bos_token }}\n{{ format_date(today) }}",
        r" uses a name it does not define at line 2 \('format_date' is undefined\)",
        "give it in data.chat_template_kwargs (e.g. data.chat_template_kwargs.format_date=...)",
    ),
    "syntax error": (
        "{% for m in messages %}\n{{ m.content }}\n{% if %}",
        r" is not valid Jinja at line 3 \(",
        "correct the template at line 3",
    ),
    "recursion": (
        "{% macro again(x) %}{{ again(x) }}{% endmacro %}\n{{ again(messages) }}",
        r" recursed without end at line 1 \(a macro that calls itself: maximum recursion depth",
        "correct the template at line 1",
    ),
    "1/0": (
        "{{ messages[0].content }}\n{{ 1 / 0 }}",
        r" failed at line 2 with ZeroDivisionError: division by zero",
        "correct the template at line 2",
    ),
    "the sandbox's SecurityError": (
        "{{ messages.append({'role': 'system', 'content': 'x'}) }}",
        r" did what Jinja's sandbox forbids at line 1 \(access to attribute 'append' of 'list' "
        r"object is unsafe\.\): a template may not change its inputs",
        OTHER_TEMPLATE,
    ),
}


def _model_dir(folder: Path, template: str, in_config: bool = False) -> Path:
    """A tiny model's directory whose chat template is `template`, in chat_template.jinja (as
    save_pretrained writes it) or in tokenizer_config.json (as older directories keep it)."""
    from grpo.models.tiny import tiny_model

    tok = char_tokenizer()
    tok.chat_template = template
    tiny_model(tok, hidden_size=32, num_layers=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    if in_config:
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": template})
        )
    return folder


def _loaded(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("kind", list(FAILING))
def test_a_failing_template_is_refused_with_one_line_naming_its_file_and_the_fix(kind, tmp_path):
    template, says, fix = FAILING[kind]
    in_config = kind in ("syntax error", "1/0")  # both places a model directory keeps it
    folder = _model_dir(tmp_path / "model", template, in_config)
    file = folder / ("tokenizer_config.json" if in_config else "chat_template.jinja")
    prompts = PromptEncoder(_loaded(folder), True, None, None)
    rows = [{"prompt": [{"role": "system", "content": "s"}, *CHAT]}, {"prompt": CHAT}]
    with pytest.raises(ConfigError) as refused:  # set-up's rendering of every row's prompt
        prompts.check_fits(rows, 4, 512, "training rows")
    line = str(refused.value)
    assert isinstance(refused.value, chat_template.TemplateFailed)
    assert "\n" not in line
    assert re.match(re.escape(f"the chat template of {file}") + says, line), line
    assert fix in line


def test_a_templates_own_error_is_refused_wherever_it_renders():
    """A step's prompts, a tool result's rendering and a reward model's texts all go through
    `render`; a tokenizer built in memory is named as such."""
    tok = char_tokenizer()
    tok.chat_template = "{{ raise_exception('only user messages') }}"
    with pytest.raises(chat_template.TemplateFailed) as refused:
        chat_template.render(tok, [CHAT])
    assert refused.value.kind == "raised" and refused.value.detail == "only user messages"
    assert str(refused.value).startswith(
        "the chat template of the tokenizer (built in memory) refused a prompt at line 1"
    )
    # an argument apply_chat_template takes that grpo does not send to the worker: in-process,
    # refused the same way
    with pytest.raises(chat_template.TemplateFailed, match="its own error: 'only user messages'"):
        chat_template.render(tok, [CHAT], continue_final_message=False)


def test_a_template_given_in_the_config_is_named_by_its_key():
    tok = char_tokenizer()
    tok.chat_template = "{{ messages[0].content }}"
    with pytest.raises(
        chat_template.TemplateFailed,
        match=r"^the chat template given as data.chat_template_kwargs.chat_template uses a name",
    ):
        chat_template.render(tok, [CHAT], chat_template="{{ nothing.here }}")


def test_grpo_train_with_a_failing_template_exits_2_with_one_line(tmp_path, capsys):
    from grpo.cli import main

    folder = _model_dir(tmp_path / "model", FAILING["raise_exception"][0])
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": CHAT, "answer": i}) + "\n" for i in range(8)))
    capsys.readouterr()  # save_pretrained's bars
    rc = main(
        [
            "train",
            str(_config(tmp_path)),
            f"model.name={folder}",
            f"data.train_file={rows}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith(
        f"grpo: config error: the chat template of {folder / 'chat_template.jinja'} refused a prompt "
        "at line 2 with its own error: 'the first message must be the system prompt'"
    )


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    config = {
        "output_dir": str(tmp_path / "run"),
        "data": {"task": "jsonl", "chat_template": "auto"},
        "rollout": {"num_generations": 2, "max_completion_length": 2},
        "rewards": {"funcs": ["arithmetic_correct"], "isolation": "thread"},
        "training": {"max_steps": 1, "per_device_train_batch_size": 4},
        "eval": {"before": False, "after": False},
        "logging": {"sample_every": 0},
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


SLOW = "{% for i in range(100000) %}{% for j in range(10) %}{% endfor %}{% endfor %}x"
"""A million loop steps: some 30 ms a prompt here, far under the limit per rendering."""


def test_a_set_of_renderings_is_bounded_in_all_not_only_each(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 60.0)  # only the total can stop it
    monkeypatch.setattr(chat_template, "TOTAL_SECONDS", 1.0, raising=False)
    tok = char_tokenizer()
    tok.chat_template = SLOW
    prompts = PromptEncoder(tok, True, None, None)
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(400)]
    with pytest.raises(chat_template.TemplateRefused) as refused:
        prompts.check_fits(rows, 4, 512, "training rows")
    line = str(refused.value)
    assert re.match(
        r"the chat template of the tokenizer \(built in memory\) took over 1 s in all to render "
        r"the prompts of set-up \(the training and held-out rows\) \([\d,]+ prompts rendered",
        line,
    ), line
    # set-up's renderings share the budget: the held-out rows' check has none left
    with pytest.raises(chat_template.TemplateRefused, match="took over 1 s in all"):
        prompts.check_fits(rows[:1], 4, 512, "held-out rows")
    # a call of its own has a budget of its own
    assert chat_template.render(tok, [[{"role": "user", "content": "a"}]]) == ["x"]


def test_a_long_rendering_shows_progress_and_a_short_one_prints_nothing(monkeypatch, capsys):
    tok = char_tokenizer()
    tok.chat_template = "{{ messages[0].content }}"
    chats = [[{"role": "user", "content": str(i)}] for i in range(3)]
    assert chat_template.render(tok, chats) == ["0", "1", "2"]
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(chat_template, "PROGRESS_AFTER", 0.0, raising=False)
    assert chat_template.render(tok, chats) == ["0", "1", "2"]
    out = capsys.readouterr().out
    assert "chat template" in out and "3/3" in out and "prompt" in out, out


def test_a_template_over_the_size_limit_is_refused_before_it_renders(tmp_path, monkeypatch):
    limit = getattr(chat_template, "MAX_TEMPLATE_CHARS", 1 << 20)
    assert limit == 1 << 20
    big = "{{ messages[0].content }}" + "{# padding #}" * (limit // 13 + 1)
    folder = _model_dir(tmp_path / "model", big)
    tok = _loaded(folder)
    sent = []
    monkeypatch.setattr(chat_template._Renderer, "ask", lambda *a: sent.append(a) or [])
    expected = re.escape(
        f"the chat template of {folder / 'chat_template.jinja'} is {len(big):,} characters, more "
        f"than the 1,048,576 a chat template may have"
    )
    with pytest.raises(chat_template.TemplateRefused, match=expected):
        PromptEncoder(tok, True, None, None)  # at set-up, before anything renders
    with pytest.raises(chat_template.TemplateRefused, match=expected):
        chat_template.render(tok, [CHAT])
    assert sent == []  # never sent to the renderer
    # a template of the limit's size is accepted
    tok.chat_template = big[:limit]
    PromptEncoder(tok, True, None, None)
    # with data.chat_template=never the tokenizer's template is not used, so not refused
    tok.chat_template = big
    PromptEncoder(tok, False, None, None)
