import json

import pytest

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.config.model_data import ArithmeticConfig
from grpo.tasks import load_task
from grpo.tasks.data import (
    PromptSampler,
    arithmetic_splits,
    encode_prompts,
    evaluate_expression,
    read_jsonl,
    render_prompt,
)

SEED_INSTRUCTION = 'Calculate {expression}. Show your work briefly, then write the last line as "Answer: <number>".'


def test_seed_task_by_default():
    cfg = ArithmeticConfig()
    assert cfg.instruction == SEED_INSTRUCTION
    train, held_out = arithmetic_splits(cfg, seed=0)
    assert len(train) == 4000 and len(held_out) == 200
    for row in train[:50] + held_out:
        a, star, b, plus, c = row["expression"].split()
        a, b, c = int(a), int(b), int(c)
        assert (star, plus) == ("*", "+")
        assert 11 <= a <= 99 and 2 <= b <= 9 and 11 <= c <= 99
        assert row["answer"] == a * b + c
        assert row["prompt"] == [
            {"role": "user", "content": SEED_INSTRUCTION.format(expression=row["expression"])}
        ]


def test_held_out_is_distinct_and_disjoint_from_training():
    cfg = ArithmeticConfig(
        operands=[[1, 9], [1, 9], [1, 9]], operators=["+", "+"], num_train=3000, num_eval=200
    )
    train, held_out = arithmetic_splits(cfg, seed=3)
    held = [r["expression"] for r in held_out]
    assert len(set(held)) == 200
    assert not set(held) & {r["expression"] for r in train}


def test_splits_are_deterministic_in_seed():
    cfg = ArithmeticConfig(num_train=50, num_eval=20)
    assert arithmetic_splits(cfg, 1) == arithmetic_splits(cfg, 1)
    assert arithmetic_splits(cfg, 1) != arithmetic_splits(cfg, 2)


def test_too_small_space_is_a_config_error():
    cfg = ArithmeticConfig(operands=[[1, 3], [1, 3]], operators=["+"], num_eval=9)
    with pytest.raises(ConfigError, match="only 9 distinct problems"):
        arithmetic_splits(cfg, 0)


@pytest.mark.parametrize(
    "operands, operators, expected",
    [
        ([2, 3, 4], ["+", "*"], 14),
        ([2, 3, 4], ["*", "+"], 10),
        ([10, 3, 4], ["-", "-"], 3),
        ([5, 2, 3], ["-", "*"], -1),
    ],
)
def test_expression_precedence(operands, operators, expected):
    assert evaluate_expression(operands, operators) == expected


def test_jsonl_rows_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"question": "2+2?", "answer": 4})
        + "\n\n"
        + json.dumps({"question": [{"role": "user", "content": "hi"}], "answer": 1})
        + "\n"
    )
    rows = read_jsonl(good, "question")
    assert rows[0] == {"prompt": "2+2?", "answer": 4}
    task = load_task(
        config.from_dict(
            {"data": {"task": "jsonl", "train_file": str(good), "prompt_column": "question"}}
        )
    )
    assert len(task.train_rows) == 2 and task.eval_rows == []

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: no 'prompt' column"):
        read_jsonl(bad, "prompt")
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: not valid JSON"):
        read_jsonl(bad, "prompt")
    bad.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(ConfigError, match="must be a string or a list of messages"):
        read_jsonl(bad, "prompt")
    with pytest.raises(ConfigError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl", "prompt")


def test_prompt_sampler_covers_every_row_each_epoch():
    rows = [{"prompt": str(i)} for i in range(5)]
    sampler = PromptSampler(len(rows), seed=0)
    first, second = (
        [r["prompt"] for r in sampler.take(rows, 5)],
        [r["prompt"] for r in sampler.take(rows, 5)],
    )
    assert sorted(first) == sorted(second) == [str(i) for i in range(5)]
    assert first != second or first != [str(i) for i in range(5)]


@pytest.mark.parametrize("taken", [0, 3, 5, 12])
def test_prompt_sampler_restores_its_position(taken):
    """A sampler restored from another's state (mid-epoch, at an epoch's end, epochs later)
    continues with exactly the rows the original would have given."""
    rows = [{"prompt": str(i)} for i in range(5)]
    original = PromptSampler(len(rows), seed=3)
    original.take(rows, taken)
    saved = json.loads(json.dumps(original.state_dict()))  # survives a JSON round trip
    restored = PromptSampler(len(rows), seed=3, state=saved)
    assert restored.take(rows, 17) == original.take(rows, 17)
    with pytest.raises(ConfigError, match="data.seed"):
        PromptSampler(len(rows), seed=4, state=saved)


def test_render_plain_and_few_shot(tokenizer):
    messages = [{"role": "user", "content": "1 + 2 ="}]
    text, templated = render_prompt(
        messages, tokenizer, use_chat_template=True, few_shot="3 + 4 = 7\n"
    )
    # the tiny tokenizer has no chat template: messages become plain text after the few-shot preamble
    assert (text, templated) == ("3 + 4 = 7\n1 + 2 =\n", False)
    texts, ids = encode_prompts([{"prompt": "abcdef"}], tokenizer, True, None, max_prompt_length=3)
    assert texts == ["abcdef"] and tokenizer.decode(ids[0]) == "def"


def test_chat_template_applied_when_present(tokenizer):
    tokenizer = tokenizer.__class__(
        tokenizer_object=tokenizer.backend_tokenizer,
        eos_token="<eos>",
        bos_token="<bos>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    text, templated = render_prompt([{"role": "user", "content": "hi"}], tokenizer, True, "IGNORED")
    assert (text, templated) == ("<user>hi<assistant>", True)
    text, templated = render_prompt([{"role": "user", "content": "hi"}], tokenizer, False, None)
    assert (text, templated) == ("hi\n", False)


def test_chat_template_kwargs_reach_the_template(tokenizer):
    tokenizer = tokenizer.__class__(
        tokenizer_object=tokenizer.backend_tokenizer,
        eos_token="<eos>",
        bos_token="<bos>",
        pad_token="<pad>",
    )
    # Qwen3's switch, in miniature: the template writes an empty thought when thinking is off
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(messages, tokenizer, True, None)[0] == "<user>hi<assistant>"
    off = {"enable_thinking": False}
    assert (
        render_prompt(messages, tokenizer, True, None, off)[0]
        == "<user>hi<assistant><think></think>"
    )
    _, ids = encode_prompts([{"prompt": messages}], tokenizer, True, None, None, off)
    assert tokenizer.decode(ids[0]) == "<user>hi<assistant><think></think>"


def test_prompt_sampler_without_shuffle_keeps_the_rows_order_and_resumes():
    rows = [{"prompt": str(i)} for i in range(4)]
    sampler = PromptSampler(len(rows), seed=3, shuffle=False)
    taken = [r["prompt"] for r in sampler.take(rows, 6)]
    assert taken == ["0", "1", "2", "3", "0", "1"]
    saved = json.loads(json.dumps(sampler.state_dict()))
    restored = PromptSampler(len(rows), seed=3, state=saved, shuffle=False)
    assert restored.take(rows, 5) == sampler.take(rows, 5)
    with pytest.raises(ConfigError, match="data.shuffle"):
        PromptSampler(len(rows), seed=3, state=saved, shuffle=True)


def test_chat_templates_past_their_limits_are_refused_for_training_and_held_out_prompts(
    tokenizer, monkeypatch
):
    """Every prompt path renders through grpo.rewards.chat_template: the trainer's PromptEncoder,
    its start-up context check, and encode_prompts (what evaluation calls)."""
    from grpo.rewards import chat_template
    from grpo.tasks.data import PromptEncoder

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)
    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>")
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}]} for i in range(3)]
    tok.chat_template = "{{ 'x' * 100000 * 100000 }}"  # 10^10 characters
    with pytest.raises(chat_template.TemplateRefused, match=r"needed more than the 512 MiB"):
        PromptEncoder(tok, True, None, 8)(rows)
    with pytest.raises(chat_template.TemplateRefused, match=r"needed more than the 512 MiB"):
        PromptEncoder(tok, True, None, None).check_fits(rows, 4, 64, "training rows")
    # 10^10 iterations over the message's characters, writing nothing
    tok.chat_template = (
        "{% for m in messages %}{% for a in m.content * 100000 %}{% for b in m.content * 100000 %}"
        "{% endfor %}{% endfor %}{% endfor %}"
    )
    with pytest.raises(
        chat_template.TemplateRefused, match=r"took over 0.5 s to render one prompt"
    ):
        encode_prompts(
            rows, tok, True, None, None
        )  # the held-out prompts' path (training.evaluate)
    # a plain-text prompt never reaches the template
    assert encode_prompts([{"prompt": "1+1="}], tok, True, None, None)[0] == ["1+1="]
