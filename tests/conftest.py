"""Fixtures the tests share: the suite's device, the character tokenizer and tiny models, the
toy task's trainer, a saved tiny reward model, the greedy-tokens comparison, and the
`needs_compile` and `gpu` markers.

The suite runs on the device GRPO_TEST_DEVICE names: `cpu` (the default, `make test`, what CI
runs) hides any GPU from the tests and every process they start, so that `training.device:
auto` means the CPU even on a GPU machine; `cuda` (`make test-gpu`) runs the same tests with
CUDA visible, so that every run `auto` places goes on the GPU, and adds the tests marked `gpu`."""

import copy
import os

DEVICE = os.environ.get("GRPO_TEST_DEVICE", "cpu")
if DEVICE == "cpu":  # before torch initialises CUDA: its children inherit it too
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

from grpo.config import loading  # noqa: E402
from grpo.models.tiny import char_tokenizer, tiny_model  # noqa: E402
from grpo.rewards.arithmetic import completion_text  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_compile: skipped where torch.compile cannot build a CPU kernel"
    )
    config.addinivalue_line(
        "markers", "gpu: runs only with GRPO_TEST_DEVICE=cuda (make test-gpu): CUDA-only behaviour"
    )
    if DEVICE not in ("cpu", "cuda"):
        raise pytest.UsageError(f"GRPO_TEST_DEVICE={DEVICE!r}: use cpu (the default) or cuda")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            "GRPO_TEST_DEVICE=cuda but torch sees no CUDA device: run `make test` on a CPU machine"
        )


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and DEVICE != "cuda":
        pytest.skip("a CUDA test: make test-gpu runs it")
    if item.get_closest_marker("needs_compile"):
        from grpo.cpu import compiling

        problem = compiling.compile_works("cpu")  # probed once per process
        if problem is not None:
            pytest.skip(f"torch.compile unavailable: {problem}")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The suite's device (GRPO_TEST_DEVICE): where `training.device: auto` puts a run, and where
    a test builds what it feeds a model it did not place itself."""
    return torch.device(DEVICE)


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    return tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=3)


@pytest.fixture
def gemma3_tiny(tokenizer):
    """Builds a tiny random Gemma 3 (a sliding-window layer of 4 tokens, then a full one),
    the same weights for the same head counts."""

    def build(num_attention_heads: int = 2, num_key_value_heads: int = 1):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            pad_token_id=tokenizer.pad_token_id,
            max_position_embeddings=256,
        )
        torch.manual_seed(0)
        return Gemma3ForCausalLM(config)

    return build


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny models: thread hand-offs cost more than the arithmetic, and the 2 cores are shared.
    torch.set_num_threads(1)


def _completion_rows(completions) -> list[list[int]]:
    """Each row's completion tokens: a Rollout's up to its mask, or lists of token ids as given."""
    if isinstance(completions, (list, tuple)):
        return [list(map(int, row)) for row in completions]
    return [
        row[: int(n)].tolist()
        for row, n in zip(completions.completion_ids, completions.completion_mask.sum(-1))
    ]


def _assert_same_greedy(
    model, got, expected, atol: float, autocast_dtype=None, msg: str = ""
) -> list[int]:
    """Greedy completions of the same prompts decoded through two different code paths (other
    kernels, attention implementations, batch shapes, cache layouts) are the same tokens, except
    where the model's two candidates for a token are tied to within `atol`: the paths' logits
    differ in their last bits (how much depends on the CPU: oneDNN and MKL block each shape
    their own way), so at a tie either may be picked, and that row is compared no further.

    `got` is a Rollout; `expected` a Rollout of the same prompts in the same row order, or
    each row's completion tokens as lists. The tie is judged on `model`'s logits for the
    prompt and the tokens both agree on (under bf16 autocast with `autocast_dtype`): any
    other difference, a token that is not a tie or one row ending where the other goes on,
    fails. A wrong path differs by far more than rounding. Returns the rows that took the
    other side of a tie (usually none)."""
    prompts = [row[m.bool()].tolist() for row, m in zip(got.prompt_ids, got.prompt_mask)]
    diverged = []
    for i, (a, b) in enumerate(zip(_completion_rows(got), _completion_rows(expected), strict=True)):
        if a == b:
            continue
        t = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert t is not None, (
            f"{msg} row {i}: {a} vs {b}: one completion ends where the other goes on"
        )
        with (
            torch.no_grad(),
            torch.autocast(
                "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
            ),
        ):
            logits = model(input_ids=torch.tensor([prompts[i] + a[:t]])).logits[0, -1].float()
        behind = (logits.max() - logits[[a[t], b[t]]]).tolist()
        assert max(behind) <= atol, (
            f"{msg} row {i} token {t}: {a[t]} vs {b[t]}, {behind} below the best logit: not a tie within {atol}"
        )
        diverged.append(i)
    return diverged


@pytest.fixture
def assert_same_greedy():
    """_assert_same_greedy: greedy tokens from two code paths, equal but for ties within rounding."""
    return _assert_same_greedy


# ---------------------------------------------------------------- the toy task's trainer

TOY = {
    "output_dir": "UNSET",
    "model": {"name": "tiny"},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "instruction": "{expression}=",
            "num_eval": 4,
        },
    },
    "rollout": {"num_generations": 16, "max_completion_length": 1},
    "training": {
        "max_steps": 200,
        "per_device_train_batch_size": 128,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
    },
    "logging": {"log_every": 1000, "sample_every": 0},
    # Reward functions defined in the tests, in worker processes, would make each worker import their
    # module (torch, transformers: seconds a trainer); reward isolation is tested in
    # tests/rewards/test_execution.py.
    "rewards": {"isolation": "thread"},
}


def first_char_correct(completions, answer, **kwargs):
    # arithmetic rows are chat messages, so completions come as [{"role": "assistant", "content": ...}]
    return [float(completion_text(c)[:1] == str(a)) for c, a in zip(completions, answer)]


@pytest.fixture
def toy_config():
    """The toy task (a+b= for a, b in 1..4, answered by one token) as a config dict: 200 steps
    of 128 completions, rewards in threads; output_dir is for the test to set."""
    return copy.deepcopy(TOY)


@pytest.fixture(name="first_char_correct")
def first_char_correct_fixture():
    """The toy task's reward: 1 where the completion's first character is the answer."""
    return first_char_correct


@pytest.fixture
def make_trainer(toy_config):
    """make_trainer(tokenizer, tmp_path, overrides=(), reward_funcs=None, hidden=64, **data): a
    Trainer of the toy task on a tiny model (2 layers of `hidden`), writing to tmp_path/run,
    rewarded by first_char_correct unless reward_funcs is given; **data goes to the Trainer."""

    def build(tokenizer, tmp_path, overrides=(), reward_funcs=None, hidden=64, **data):
        from grpo.training.trainer import Trainer

        cfg = loading.from_dict(
            {**toy_config, "output_dir": str(tmp_path / "run")}, list(overrides)
        )
        model = tiny_model(tokenizer, hidden_size=hidden, num_layers=2, seed=0)
        return Trainer.from_config(
            cfg,
            model=model,
            tokenizer=tokenizer,
            reward_funcs=reward_funcs or {"correct": first_char_correct},
            **data,
        )

    return build


# ---------------------------------------------------------------- a saved reward model


@pytest.fixture
def save_reward_model():
    """save_reward_model(path, *, num_labels=1, pad=True, chat_template=None, seed=0): a tiny random
    LlamaForSequenceClassification with the character tokenizer, saved to `path`; returns
    (model in eval mode, tokenizer)."""

    def save(path, *, num_labels=1, pad=True, chat_template=None, seed=0):
        from transformers import LlamaConfig, LlamaForSequenceClassification

        tok = char_tokenizer()
        if not pad:
            tok.pad_token = None  # like many decoder reward models: the scorer must pad with eos
        if chat_template:
            tok.chat_template = chat_template
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
            num_labels=num_labels,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(cfg)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        return model.eval(), tok

    return save


# ---------------------------------------------------------------- tools (multi-turn rollouts)

TOOL_TEMPLATE = (
    "{%- if tools -%}T:{%- for t in tools -%}{{ t.function.name }};{%- endfor -%}\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<tool>{{ m.content }}</tool>"
    "{%- elif m.role == 'assistant' -%}A:{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{%- endfor -%}<eos>"
    "{%- else -%}U:{{ m.content }}<eos>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:{%- endif -%}"
)
"""A small chat template that offers tools, writes assistant calls in the default format and
renders tool messages as <tool>...</tool>, ending turns with <eos>."""


@pytest.fixture
def tool_tokenizer():
    """The character tokenizer with TOOL_TEMPLATE as its chat template."""
    tok = char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    return tok


class ForcedCalls:
    """A rollout engine for tests: a completion's first turn (a call for G > 1 completions) is
    `text`'s tokens instead of a sample, in every row, with logprob -1 each (`every_turn`: later
    turns too); the other turns are sampled by `inner`, the real engine. The prompts of each
    call are kept in `asked`, and each real turn's rollout in `sampled`."""

    def __init__(self, inner, tokenizer, text: str, every_turn: bool = False):
        self.inner, self.every_turn = inner, every_turn
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.eos_token_ids, self.pad_token_id = inner.eos_token_ids, inner.pad_token_id
        self.asked, self.sampled = [], []

    @property
    def device(self):
        return self.inner.device

    def generate(self, prompts, num_generations, params, seeds=None):
        from grpo.rollout.types import Rollout

        self.asked.append([list(p) for p in prompts])
        rollout = self.inner.generate(prompts, num_generations, params, seeds)
        if num_generations == 1 and not self.every_turn:
            self.sampled.append(rollout)
            return rollout
        N, n, device = len(rollout), len(self.ids), rollout.completion_ids.device
        return Rollout(
            rollout.prompt_ids,
            rollout.prompt_mask,
            torch.tensor([self.ids] * N, device=device),
            torch.ones(N, n, dtype=torch.long, device=device),
            torch.zeros(N, dtype=torch.bool, device=device),
            torch.full((N, n), -1.0, device=device),
        )

    def sync_weights(self, policy):
        self.inner.sync_weights(policy)

    def sleep(self):
        self.inner.sleep()

    def wake(self):
        self.inner.wake()


@pytest.fixture(name="ForcedCalls")
def forced_calls_fixture():
    """The ForcedCalls class (a test engine that writes given calls in chosen turns)."""
    return ForcedCalls


LOOKUP_TOOL = '''
TABLE = {"a": "1", "b": "2", "c": "3", "d": "4", "e": "5", "f": "6", "g": "7"}


def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: One letter, a to g.
    """
    return TABLE[key]  # any other key raises: a failed call
'''


def _save_tool_model(directory):
    """A tiny random model (1 layer of 32) and TOOL_TEMPLATE's character tokenizer, saved to
    `directory`/model, and the tool `lookup` in `directory`/mytools.py; returns the model's
    directory. Each call of the tool is one added token (keys a..g, and z, which fails): a
    random model writes one of these 8 in 100 tokens about 7 times in 100, so calls happen in
    every step of a few dozen tokens' completions, without forcing a turn, and a run given the
    saved model by name (`grpo train`, torchrun's ranks) makes them."""
    from tokenizers import AddedToken

    tok = char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    calls = [
        f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'
        for key in "abcdefgz"
    ]
    tok.add_tokens([AddedToken(call, special=False, normalized=False) for call in calls])
    model = tiny_model(tok, hidden_size=32, num_layers=1, seed=0)
    model.save_pretrained(directory / "model")
    tok.save_pretrained(directory / "model")
    (directory / "mytools.py").write_text(LOOKUP_TOOL)
    return directory / "model"


@pytest.fixture(scope="session")
def save_tool_model():
    """save_tool_model(directory): a tiny model whose random sampling calls a tool, saved to
    directory/model (returned), with its tool in directory/mytools.py (`mytools.py:lookup` in a
    config beside it); see _save_tool_model."""
    return _save_tool_model


# ---------------------------------------------------------------- a generation server (grpo serve)

from serve_settings import SERVE_KEY, SERVED_TINY  # noqa: E402


@pytest.fixture
def serve_in_thread(monkeypatch):
    """serve_in_thread(config dict=SERVED_TINY, port=0) -> grpo.serve.http.Serving: `grpo serve
    --engine hf` for that config in a thread of this process (its model loads in milliseconds
    here, where a fresh process spends seconds importing), with SERVE_KEY, which
    GRPO_SERVE_API_KEY is set to for the trainer; each one is shut down at the test's end."""
    from grpo.serve import hf

    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)
    started = []

    def start(data=None, port=0):
        cfg = loading.from_dict(copy.deepcopy(data or SERVED_TINY))
        serving = hf.start(cfg, "127.0.0.1", port, SERVE_KEY).start_thread()
        started.append(serving)
        return serving

    yield start
    for serving in started:
        serving.shutdown()
