"""Multi-turn rollouts: the completion trained on is exactly the sampled ids plus the tool
results as the chat template renders them (never re-tokenized), with the results masked."""

import pytest
import torch

from grpo.config import loading
from grpo.models.tiny import char_tokenizer, tiny_model
from grpo.rollout.hf import TransformersEngine
from grpo.rollout.multiturn import ToolEngine, ToolRendering, turn_seed
from grpo.rollout.tools import ToolResult, ToolRunner, build_tools
from grpo.rollout.types import SamplingParams


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def _engine(
    tokenizer,
    ForcedCalls,
    max_length=160,
    max_tool_calls=3,
    every_turn=False,
    call=CALL,
    answer_malformed=False,
):
    cfg = loading.from_dict(
        {"rollout": {"num_generations": 2, "max_completion_length": max_length}}
    )
    model = tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=3)
    inner = TransformersEngine(model, tokenizer, ToolEngine.inner_config(cfg, tokenizer))
    forced = ForcedCalls(inner, tokenizer, call, every_turn=every_turn)
    runner = ToolRunner(build_tools([add]), timeout=5.0, max_chars=100, isolation="thread")
    engine = ToolEngine(
        forced, tokenizer, runner, max_tool_calls, answer_malformed=answer_malformed
    )
    return engine, forced


def _prompt(tokenizer, engine):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2?"}],
        tools=engine.schemas,
        add_generation_prompt=True,
        return_dict=False,
    )


def test_training_tokens_are_the_sampled_ids_plus_the_templates_tool_tokens(
    tool_tokenizer, ForcedCalls
):
    tok = tool_tokenizer
    engine, forced = _engine(tok, ForcedCalls)
    prompt = _prompt(tok, engine)
    rollout = engine.generate([prompt], 2, SamplingParams(max_new_tokens=160), [11])

    call = tok(CALL, add_special_tokens=False)["input_ids"]
    # the template's tool message, computed here independently: the conversation with the tool
    # message and the next assistant header, minus the one ending in the assistant's call turn
    # (whose end-of-turn token the model has not written: the turn stopped at </tool_call>)
    calls = [{"type": "function", "function": {"name": "add", "arguments": {}}}]
    before = tok.apply_chat_template(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ],
        return_dict=False,
    )
    after = tok.apply_chat_template(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "name": "add", "content": "3"},
        ],
        add_generation_prompt=True,
        return_dict=False,
    )
    suffix = after[len(before) - 1 :]
    assert tok.decode(suffix) == "<eos><tool>3</tool>A:"

    # the second turn was asked for with exactly the ids so far: nothing decoded and re-encoded
    assert forced.asked[1] == [prompt + call + suffix] * 2
    (second,) = forced.sampled
    for i in range(2):
        n = int(rollout.completion_mask[i].sum())
        sampled = second.completion_ids[i][second.completion_mask[i].bool()].tolist()
        assert rollout.completion_ids[i, :n].tolist() == call + suffix + sampled
        tool = [0] * len(call) + [1] * len(suffix) + [0] * len(sampled)
        assert rollout.tool_mask[i, :n].tolist() == tool
        # the sampling logprobs: the forced turn's, 0 on the tool tokens, the engine's after
        expected = [-1.0] * len(call) + [0.0] * len(suffix)
        expected += second.sampling_logprobs[i, : len(sampled)].tolist()
        assert rollout.sampling_logprobs[i, :n].tolist() == pytest.approx(expected)
        assert not rollout.completion_mask[i, n:].any()
        # the conversation, as TRL gives it to reward functions: the call, its result, the reply
        call_message = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
            ],
        }
        reply = tok.decode(sampled, skip_special_tokens=True).strip()
        assert rollout.messages[i] == [
            call_message,
            {"role": "tool", "name": "add", "content": "3"},
            {"role": "assistant", "content": reply},
        ]
    counts = engine.take_counts()
    assert counts["calls"] == 2 and counts["failures"] == 0 and counts["turns"] == 4


@pytest.mark.parametrize("answer", [False, True])
def test_a_call_that_cannot_be_parsed_ends_the_completion_or_is_answered(
    answer, tool_tokenizer, ForcedCalls
):
    """rollout.malformed_tool_calls: `end` (TRL's) drops it, so the turn is the answer; `answer`
    replies with the parse error and the model goes on."""
    tok = tool_tokenizer
    bad = '<tool_call>{"arguments": {a: 1}}</tool_call>'
    engine, forced = _engine(tok, ForcedCalls, 400, call=bad, answer_malformed=answer)
    prompt = _prompt(tok, engine)
    rollout = engine.generate([prompt], 2, SamplingParams(max_new_tokens=400), [11])
    counts = engine.take_counts()
    sampled = tok(bad, add_special_tokens=False)["input_ids"]
    if not answer:
        assert len(forced.asked) == 1  # no second turn
        for i in range(2):
            assert rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist() == sampled
        assert not rollout.tool_mask.any()
        assert (counts["calls"], counts["malformed"], counts["turns"]) == (0, 2, 2)
        # the reward functions see the turn as the model wrote it
        assert rollout.messages[0] == [{"role": "assistant", "content": bad}]
    else:
        assert len(forced.asked) == 2
        assert all(m[1]["role"] == "tool" for m in rollout.messages)
        assert "not valid JSON" in rollout.messages[0][1]["content"]
        assert rollout.tool_mask.any(dim=1).all()
        assert (counts["calls"], counts["failures"], counts["malformed"]) == (2, 2, 0)


def test_later_turns_are_seeded_by_the_prompt_seed_alone(tool_tokenizer, ForcedCalls):
    tok = tool_tokenizer
    engine, _ = _engine(tok, ForcedCalls)
    prompt = _prompt(tok, engine)
    params = SamplingParams(max_new_tokens=160)
    alone = engine.generate([prompt], 2, params, [5])
    again = engine.generate([prompt, prompt[:-1]], 2, params, [5, 6])
    n = alone.completion_ids.shape[1]
    assert torch.equal(again.completion_ids[:2, :n], alone.completion_ids)
    assert turn_seed(5, 0, 1) != turn_seed(5, 1, 1) != turn_seed(5, 0, 2)


def test_the_budget_bounds_the_whole_completion(tool_tokenizer, ForcedCalls):
    tok = tool_tokenizer
    call = len(tok(CALL, add_special_tokens=False)["input_ids"])
    # room for the call, not for its result and a reply: ended before the result, truncated
    engine, forced = _engine(tok, ForcedCalls, max_length=call + 5)
    rollout = engine.generate(
        [_prompt(tok, engine)], 2, SamplingParams(max_new_tokens=call + 5), [1]
    )
    assert rollout.truncated.all() and len(forced.asked) == 1
    assert rollout.completion_mask.sum(-1).tolist() == [call, call]
    assert not rollout.tool_mask.any()
    # room for the result and a few tokens: the reply is cut at the budget
    engine, forced = _engine(tok, ForcedCalls, max_length=call + 30)
    rollout = engine.generate(
        [_prompt(tok, engine)], 2, SamplingParams(max_new_tokens=call + 30), [1]
    )
    assert (rollout.completion_mask.sum(-1) <= call + 30).all()
    suffix = len(tok("<eos><tool>3</tool>A:", add_special_tokens=False)["input_ids"])
    assert rollout.tool_mask.sum(-1).tolist() == [suffix, suffix]


def test_turns_with_calls_stop_at_max_tool_calls(tool_tokenizer, ForcedCalls):
    tok = tool_tokenizer
    engine, forced = _engine(tok, ForcedCalls, max_length=400, max_tool_calls=2, every_turn=True)
    rollout = engine.generate([_prompt(tok, engine)], 2, SamplingParams(max_new_tokens=400), [1])
    # turn 1 calls, turn 2 calls, turn 3 calls but no more calls are run
    assert len(forced.asked) == 3
    counts = engine.take_counts()
    assert counts["calls"] == 4 and counts["turns"] == 6
    assert not rollout.truncated.any()
    text = tok.decode(rollout.completion_ids[0][rollout.completion_mask[0].bool()])
    assert text.count("<tool>3</tool>") == 2 and text.endswith(CALL)


def test_a_template_without_tool_messages_gets_the_default_rendering():
    tok = char_tokenizer()  # no chat template at all
    rendering = ToolRendering(tok, [tok.eos_token_id])
    assert not rendering.uses_template
    ids = rendering.suffix([ToolResult("add", "3"), ToolResult("add", "error: x")], False)
    assert tok.decode(ids) == (
        "\n<tool_response>\n3\n</tool_response>\n\n<tool_response>\nerror: x\n</tool_response>\n"
    )


def test_without_tools_the_engine_is_the_one_turn_engine(tokenizer, make_trainer, tmp_path):
    trainer = make_trainer(
        tokenizer, tmp_path, ["rollout.num_generations=2", "training.per_device_train_batch_size=4"]
    )
    assert type(trainer.engine) is TransformersEngine
    assert trainer.engine.stop is None


RESPONSE_TEMPLATE = {  # transformers' response parsing, for the test template's assistant turns
    "defaults": {"role": "assistant"},
    "start_anchor": "A:",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


def test_a_tokenizer_with_a_response_parser_parses_its_own_calls(tool_tokenizer, ForcedCalls):
    tok = tool_tokenizer
    tok.response_template = RESPONSE_TEMPLATE
    # its turns end at end-of-turn, as its template writes them: no stop string of grpo's
    assert ToolEngine.stop_strings(tok) == []
    cfg = loading.from_dict({"rollout": {"num_generations": 2, "max_completion_length": 160}})
    assert ToolEngine.inner_config(cfg, tok).rollout.stop_strings == []
    model = tiny_model(tok, hidden_size=32, num_layers=2, seed=3)
    inner = TransformersEngine(model, tok, ToolEngine.inner_config(cfg, tok))
    turn = "I add. " + CALL.replace("1, ", "4, ") + "<eos>"  # content, a call, end of turn
    forced = ForcedCalls(inner, tok, turn)
    runner = ToolRunner(build_tools([add]), timeout=5.0, max_chars=100, isolation="thread")
    engine = ToolEngine(forced, tok, runner, 3)
    prompt = _prompt(tok, engine)
    rollout = engine.generate([prompt], 2, SamplingParams(max_new_tokens=160), [2])
    ids = tok(turn, add_special_tokens=False)["input_ids"]
    # the turn ended with its end-of-turn token: the tool message follows it directly
    suffix = tok("<tool>6</tool>A:", add_special_tokens=False)["input_ids"]
    assert forced.asked[1] == [prompt + ids + suffix] * 2
    for i in range(2):
        n = len(ids) + len(suffix)
        assert rollout.completion_ids[i, :n].tolist() == ids + suffix
        assert rollout.tool_mask[i, : len(ids)].sum() == 0
        assert rollout.tool_mask[i, len(ids) : n].all()


def test_a_template_that_writes_the_turn_differently_before_tool_messages():
    """Qwen3's template drops an empty <think></think> from an assistant turn once tool messages
    follow it: the tool messages are still the tokens after the turn's end-of-turn token."""
    from grpo.config.errors import ConfigError

    tok = char_tokenizer()
    turn = (
        "{%- for m in messages -%}"
        "{%- if m.role == 'tool' -%}<tool>{{ m.content }}</tool>"
        "{%- elif m.role == 'assistant' -%}"
        "A:{%- if loop.last -%}<think></think>{%- endif -%}{{ m.content }}END"
        "{%- else -%}U:{{ m.content }}END{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}A:{%- endif -%}"
    )
    tok.chat_template = turn.replace("END", "<eos>")
    rendering = ToolRendering(tok, [tok.eos_token_id])
    results = [ToolResult("add", "3")]
    assert tok.decode(rendering.suffix(results, True)) == "<tool>3</tool>A:"
    assert tok.decode(rendering.suffix(results, False)) == "<eos><tool>3</tool>A:"
    # without an end-of-turn token, the turn cannot be told from the tool messages: refused at start
    tok.chat_template = turn.replace("END", "")
    with pytest.raises(
        ConfigError, match="rollout.tools: the chat template's tool messages cannot be"
    ):
        ToolRendering(tok, [tok.eos_token_id])


@pytest.mark.parametrize(
    "name, end, suffix",
    [
        (
            "qwen2_5_chat_template",
            "<|im_end|>",
            "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "qwen3_chat_template",
            "<|im_end|>",
            "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "llama3_1_chat_template",
            "<|eot_id|>",
            '<|start_header_id|>ipython<|end_header_id|>\n\n"3"<|eot_id|>'
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
    ],
)
def test_real_chat_templates_tool_messages(name, end, suffix):
    """The chat templates TRL ships for Qwen2.5, Qwen3 and Llama 3.1 (their special tokens one
    token each, as in the real tokenizers): the tokens after the assistant's end of turn."""
    templates = pytest.importorskip("trl.chat_template_utils")
    tok = char_tokenizer()
    specials = [
        "<|im_start|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
    ]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = getattr(templates, name)
    rendering = ToolRendering(tok, [tok.convert_tokens_to_ids(end)])
    assert rendering.uses_template
    results = [ToolResult("add", "3")]
    assert tok.decode(rendering.suffix(results, True)) == suffix
    assert tok.decode(rendering.suffix(results, False)) == end + suffix


@pytest.mark.parametrize(
    "body, refusal",
    [
        (  # 10^10 iterations that write nothing: the worker is killed at the time limit
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            r"took over 0.5 s to render one prompt",
        ),
        ("{{ 'x' * 100000 * 100000 }}", r"needed more than the 512 MiB"),  # 10^10 characters
    ],
)
def test_a_template_past_its_limits_in_a_tool_results_suffix_is_refused(
    tool_tokenizer, ForcedCalls, monkeypatch, body, refusal
):
    """A template that renders the start-up probe's tool message but not a real result: the
    suffix rendered during the rollout is bounded as the prompts are (grpo.rewards.chat_template)."""
    from grpo.rewards import chat_template

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)
    tok = tool_tokenizer
    probe = "grpo-tool-probe-8d1c"  # grpo.rollout.multiturn's probe result
    tok.chat_template = tok.chat_template.replace(
        "<tool>{{ m.content }}</tool>",
        "{%- if m.content != '"
        + probe
        + "' -%}"
        + body
        + "{%- endif -%}<tool>{{ m.content }}</tool>",
    )
    engine, _ = _engine(tok, ForcedCalls)
    assert engine.rendering.uses_template
    prompt = tok(
        chat_template.render(
            tok, [[{"role": "user", "content": "1+2?"}]], add_generation_prompt=True
        )[0],
        add_special_tokens=False,
    )["input_ids"]
    with pytest.raises(chat_template.TemplateRefused, match=refusal):
        engine.generate([prompt], 2, SamplingParams(max_new_tokens=160), [11])
