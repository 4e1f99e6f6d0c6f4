"""Datasets: the built-in arithmetic task, JSONL rows, and prompt rendering.

A row is a dict with a prompt (a string, or a list of chat messages) and any
other columns; reward functions receive the other columns as keyword lists.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any

from grpo.config import safe_yaml
from grpo.config.errors import ConfigError
from grpo.config.model_data import ArithmeticConfig
from grpo.rewards import chat_template

Row = dict[str, Any]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# The built-in arithmetic task (the seed's experiment)
# --------------------------------------------------------------------------


def evaluate_expression(operands: list[int], operators: list[str]) -> int:
    """Integer value of `a op b op c ...` with * before + and -."""
    terms = [operands[0]]
    signs = [1]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _draw_problem(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, int]:
    operands = [rng.randint(low, high) for low, high in cfg.operands]
    pieces = [str(operands[0])]
    for op, value in zip(cfg.operators, operands[1:]):
        pieces += [op, str(value)]
    return " ".join(pieces), evaluate_expression(operands, cfg.operators)


def _space_size(cfg: ArithmeticConfig) -> int:
    size = 1
    for low, high in cfg.operands:
        size *= high - low + 1
    return size


def _row(expression: str, answer: int, cfg: ArithmeticConfig) -> Row:
    content = cfg.instruction.format(expression=expression)
    return {
        "prompt": [{"role": "user", "content": content}],
        "answer": answer,
        "expression": expression,
    }


def arithmetic_splits(cfg: ArithmeticConfig, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, held_out) rows of the seed's task, deterministic in `seed`.

    The held-out problems are distinct and never appear among training
    problems; training problems are drawn with replacement (as the seed's
    `make_problems`) from what is left.
    """
    space = _space_size(cfg)
    if cfg.num_eval >= space:
        raise ConfigError(
            f"data.arithmetic.num_eval={cfg.num_eval} leaves no training problems: the operand ranges "
            f"{cfg.operands} allow only {space} distinct problems; lower num_eval or widen the ranges"
        )
    eval_rng = random.Random(f"arithmetic-eval-{seed}")
    held_out: dict[str, int] = {}
    while len(held_out) < cfg.num_eval:
        expression, answer = _draw_problem(eval_rng, cfg)
        held_out.setdefault(expression, answer)
    train_rng = random.Random(f"arithmetic-train-{seed}")
    train: list[Row] = []
    while len(train) < cfg.num_train:
        expression, answer = _draw_problem(train_rng, cfg)
        if expression not in held_out:
            train.append(_row(expression, answer, cfg))
    return train, [_row(e, a, cfg) for e, a in held_out.items()]


def reworded(rows: list[Row], instruction: str) -> list[Row]:
    """The same arithmetic problems asked with another instruction (`{expression}` replaced)."""
    return [
        {
            **row,
            "prompt": [
                {"role": "user", "content": instruction.format(expression=row["expression"])}
            ],
        }
        for row in rows
    ]


# --------------------------------------------------------------------------
# JSONL rows
# --------------------------------------------------------------------------


def _check_prompt(prompt: Any, where: str, column: str) -> None:
    problem = _prompt_problem(prompt)
    if problem is None:
        return
    raise ConfigError(
        f"{where}: column '{column}' must be a string or a list of messages "
        f'like [{{"role": "user", "content": "..."}}], got {problem}'
    )


def _kind(value: Any) -> str:
    """A value as an error names it, on one line: its type and its start."""
    if value is None:
        return "null"
    if isinstance(value, str):
        shown = repr(value[:60] + ("..." if len(value) > 60 else ""))
    else:  # an array's text may span lines
        shown = " ".join(str(value).split())
        shown = shown if len(shown) <= 60 else shown[:60] + "..."
    return f"{type(value).__name__} {shown}"


def _prompt_problem(prompt: Any) -> str | None:
    """What makes `prompt` neither text nor a list of chat messages (None: it is one)."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list):
        return _kind(prompt)
    if not prompt:
        return "an empty list"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"a list whose item {i} is {_kind(message)}, not a message"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                value = "no " + key if key not in message else f"a {key} of {_kind(message[key])}"
                return f"a list whose message {i} has {value}, not text"
    return None


MAX_COLUMNS_SHOWN = 20
"""Columns a row's error names (a row may have thousands)."""


def checked_prompt_row(row: Row, where: str, prompt_column: str, fix: str) -> Row:
    """`row` (a dict) with its prompt, a string or a list of chat messages, under `prompt`: the one
    check of a row's prompt, for the JSONL task's lines and the TRL facade's datasets alike. A row
    without `prompt_column` is a ConfigError naming `where`, the row's columns and `fix`; a prompt
    of another kind (a number, null, a message whose content is not text) one naming `where`
    and the form a prompt takes."""
    if prompt_column not in row:
        columns = sorted(str(column) for column in row)
        shown = columns[:MAX_COLUMNS_SHOWN] + (["..."] if len(columns) > MAX_COLUMNS_SHOWN else [])
        raise ConfigError(f"{where}: no '{prompt_column}' column (has {shown}); {fix}")
    _check_prompt(row[prompt_column], where, prompt_column)
    if prompt_column != "prompt":
        row["prompt"] = row.pop(prompt_column)
    return row


MAX_LINE_BYTES = 16 << 20
"""Longest JSONL line read (a row's prompt and every other column, as JSON)."""
MAX_PROMPT_CHARS = 1 << 20
"""Longest prompt a row may have, in characters, checked before anything is tokenized: a
megabyte of text is some 250,000 tokens, beyond any model's context, and tokenizing it whole
takes seconds and gigabytes. A longer prompt is refused, naming the row. What a chat template
makes of a prompt is bounded from this too (grpo.rewards.chat_template.MAX_RENDERED_CHARS, four
times as many characters), with its time and memory."""
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state")
"""Arguments every reward function gets from the trainer: a column of one of these names would
take their place in the call, so the rewards would score the column instead of the model."""


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not JSON; write null for a missing value")


def _json_line(line: bytes, where: str) -> Any:
    text = _utf8(line, where)
    try:
        return json.loads(text, parse_constant=_not_json_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where}: not valid JSON ({e.msg}); each line must be one JSON object"
        ) from None
    except RecursionError:
        raise ConfigError(f"{where}: a value nested too deeply to read; write it flatter") from None
    except ValueError as e:  # NaN/Infinity, or an integer of more than 4,300 digits
        problem = str(e).split("; use sys.set_int_max_str_digits")[0][:200]
        raise ConfigError(f"{where}: {problem}") from None


def lines(path: Path):
    """(number, bytes) of each line of the file at `path`, each at most MAX_LINE_BYTES long."""
    with path.open("rb") as f:
        number = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise ConfigError(
                    f"{path}:{number}: a line longer than {MAX_LINE_BYTES >> 20} MiB; a row of a dataset "
                    "is one prompt and its columns: shorten it, or is this the right file?"
                )
            yield number, line


MAX_JSON_BYTES = 64 << 20
"""Largest .json file read as one value (a list of rows); JSONL has no such bound but its lines'."""


def check_text_file(path: Path) -> None:
    """A JSON, JSONL or CSV file read as `read_jsonl` reads JSONL (UTF-8, bounded lines, JSON values
    as Python reads them), so that what another reader would crash or hang on is refused by line
    first. A .json file is one value (at most MAX_JSON_BYTES), or JSON lines under that name."""
    if path.suffix == ".json":
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ConfigError(
                f"{path}: {size:,} bytes of one JSON value, more than {MAX_JSON_BYTES >> 20} MiB; "
                "write the rows as JSONL (one object per line, a .jsonl file) instead"
            )
        try:
            _json_line(path.read_bytes(), str(path))
            return
        except ConfigError as e:
            if "Extra data" not in str(e):  # anything but JSON lines in a .json file
                raise
    for number, line in lines(path):
        if path.suffix in (".jsonl", ".json") and line.strip():
            _json_line(line, f"{path}:{number}")
        elif path.suffix not in (".jsonl", ".json"):
            _utf8(line, f"{path}:{number}")


def _utf8(line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1}); "
            "save the file as UTF-8"
        ) from None


def read_jsonl(path: str | Path, prompt_column: str) -> list[Row]:
    """Read and check every row before any training starts."""
    path = Path(path)
    problem = safe_yaml.not_a_file(path)
    if problem:
        raise ConfigError(f"data file {path} {problem}; check data.train_file / data.eval_file")
    rows = []
    for number, line in lines(path):
        where = f"{path}:{number}"
        if line.strip():
            row = _json_line(line, where)
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{where}: expected a JSON object per line, got {type(row).__name__}"
                )
            rows.append(
                checked_prompt_row(row, where, prompt_column, "add it or set data.prompt_column")
            )
    if not rows:
        raise ConfigError(f"{path}: no rows")
    return rows


class PromptSampler:
    """Rows in a fresh shuffled order each epoch, forever, deterministic in `seed` (or, with
    `shuffle` off, in the rows' own order every epoch), with a position that can be saved
    (`state_dict`) and restored (the `state` argument).

    The order of epoch e is a shuffle by a random.Random seeded with the seed and
    advanced by the shuffles of the epochs before it; the state keeps that
    generator's state from before the current epoch's shuffle, the epoch and the
    position in it, so restoring it redoes the same shuffle and continues where it
    stopped.
    """

    def __init__(
        self, num_rows: int, seed: int, state: dict[str, Any] | None = None, shuffle: bool = True
    ):
        if num_rows < 1:
            raise ConfigError("no training rows")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._rng = random.Random(f"prompt-order-{seed}")
        self.epoch, self.position = 0, 0
        if state is not None:
            if (state["num_rows"], state["seed"]) != (num_rows, seed):
                raise ConfigError(
                    f"the saved prompt order is for {state['num_rows']} rows with data.seed={state['seed']}, "
                    f"not {num_rows} rows with data.seed={seed}; restore with the same data and data.seed"
                )
            # a checkpoint from before data.shuffle existed was shuffled
            if state.get("shuffle", True) != shuffle:
                raise ConfigError(
                    f"the saved prompt order has data.shuffle={state.get('shuffle', True)}, the config "
                    f"{shuffle}; restore with the same data.shuffle"
                )
            version, internal, gauss = state["rng_before_epoch"]
            self._rng.setstate((version, tuple(internal), gauss))
            self.epoch, self.position = state["epoch"], state["position"]
        self._shuffle()

    def _shuffle(self) -> None:
        self._rng_before_epoch = self._rng.getstate()
        self._order = list(range(self.num_rows))
        if self.shuffle:
            self._rng.shuffle(self._order)

    def next_index(self) -> int:
        if self.position == self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
            self._shuffle()
        self.position += 1
        return self._order[self.position - 1]

    def take(self, rows: list[Row], count: int) -> list[Row]:
        """The next `count` rows of `rows` (the list this sampler was made for)."""
        return [rows[self.next_index()] for _ in range(count)]

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._rng_before_epoch
        return {
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "rng_before_epoch": [version, list(internal), gauss],
        }


# --------------------------------------------------------------------------
# Prompt rendering
# --------------------------------------------------------------------------


def is_conversational(row: Row) -> bool:
    return isinstance(row["prompt"], list)


def render_prompt(
    prompt: str | list[dict[str, str]],
    tokenizer,
    use_chat_template: bool,
    few_shot: str | None,
    template_kwargs: dict | None = None,
) -> tuple[str, bool]:
    """The exact text the model continues, and whether a chat template wrote it.

    Chat messages go through the tokenizer's chat template when it has one and
    `use_chat_template` is on, with `template_kwargs` as the template's extra variables
    (data.chat_template_kwargs); otherwise their contents are joined as plain
    text. `few_shot` is put before plain-text prompts (for base models). The template is
    rendered within limits (grpo.rewards.chat_template: time, output, memory).
    """
    return render_prompts([prompt], tokenizer, use_chat_template, few_shot, template_kwargs)[0]


def render_prompts(
    prompts: list,
    tokenizer,
    use_chat_template: bool,
    few_shot: str | None,
    template_kwargs: dict | None = None,
    budget: chat_template.Budget | None = None,
) -> list[tuple[str, bool]]:
    """`render_prompt` of each prompt, the chat ones rendered together (one request to the
    template's renderer for the batch), within `budget`'s time in all (a fresh one's if None)."""
    templated = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
    chats = [i for i, p in enumerate(prompts) if templated and isinstance(p, list)]
    out: list[tuple[str, bool]] = [("", False)] * len(prompts)
    if chats:
        texts = chat_template.render_within(
            budget or chat_template.Budget(),
            tokenizer,
            [prompts[i] for i in chats],
            True,
            template_kwargs,
        )
        for i, text in zip(chats, texts):
            out[i] = (text, True)
    done = set(chats)
    for i, prompt in enumerate(prompts):
        if i not in done:
            if isinstance(prompt, list):
                prompt = "\n".join(m["content"] for m in prompt) + "\n"
            out[i] = ((few_shot or "") + prompt, False)
    return out


def tokenize_prompts(
    rows: list[Row],
    tokenizer,
    use_chat_template: bool,
    few_shot: str | None,
    template_kwargs: dict | None = None,
) -> tuple[list[str], list[list[int]]]:
    """Prompt texts and their whole token ids."""
    rendered = render_prompts(
        [row["prompt"] for row in rows], tokenizer, use_chat_template, few_shot, template_kwargs
    )
    texts = [text for text, _ in rendered]
    ids: list[list[int]] = [[] for _ in rows]
    for templated in (
        False,
        True,
    ):  # a chat template writes its own BOS; plain text gets the tokenizer's
        which = [i for i, (_, t) in enumerate(rendered) if t is templated]
        if which:
            encoded = tokenizer([texts[i] for i in which], add_special_tokens=not templated)[
                "input_ids"
            ]
            for i, tokens in zip(which, encoded):
                ids[i] = list(tokens)
    return texts, ids


def truncate_prompt(
    tokens: list[int], max_length: int | None, bos_token_id: int | None
) -> list[int]:
    """At most `max_length` tokens of a prompt: its BOS, when it starts with one (the model was
    trained with it there), and then its end (the instruction's end, where the question is,
    and the chat template's generation prompt). What goes is the start: few-shot text first."""
    if max_length is None or len(tokens) <= max_length:
        return tokens
    if bos_token_id is not None and tokens[0] == bos_token_id and max_length > 1:
        return [tokens[0], *tokens[len(tokens) - max_length + 1 :]]
    return tokens[len(tokens) - max_length :]


def encode_prompts(
    rows: list[Row],
    tokenizer,
    use_chat_template: bool,
    few_shot: str | None,
    max_prompt_length: int | None,
    template_kwargs: dict | None = None,
) -> tuple[list[str], list[list[int]]]:
    """Prompt texts and their token ids, each truncated to max_prompt_length (`truncate_prompt`)."""
    texts, ids = tokenize_prompts(rows, tokenizer, use_chat_template, few_shot, template_kwargs)
    bos = getattr(tokenizer, "bos_token_id", None)
    return texts, [truncate_prompt(tokens, max_prompt_length, bos) for tokens in ids]


def check_columns(rows: list[Row], what: str) -> set[str]:
    """The rows' columns, the same in every row, none of them a reward argument's name
    (RESERVED_COLUMNS), each value something the rows can hold (`check_values`); else a
    ConfigError naming the row and the column (reward functions get each column as one list
    over the batch)."""
    columns = set().union(*(row.keys() for row in rows)) if rows else set()
    reserved = sorted(columns & set(RESERVED_COLUMNS))
    if reserved:
        raise ConfigError(
            f"{what}: a column named {reserved[0]!r}, which is the name of an argument every reward function gets "
            f"from the trainer ({', '.join(RESERVED_COLUMNS)}); rename the column"
        )
    for i, row in enumerate(rows):
        check_values(row, f"{what}: row {i} (counting from 0)")
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            missing = sorted(columns - set(row))[0]
            has = next(j for j, other in enumerate(rows) if missing in other)
            raise ConfigError(
                f"{what}: row {i} (counting from 0) has no {missing!r} column, which row {has} has; give every row "
                f"the same columns (null where a value does not apply) or drop {missing!r} from the rows that have it"
            )
    return columns


def check_values(row: Row, where: str) -> None:
    """A row's prompt is at most MAX_PROMPT_CHARS long, its text is valid Unicode (a lone surrogate
    cannot be tokenized or written out), its numbers are finite, and its `answer` (the gold answer
    the built-in rewards and scorers read) is a number or a text."""
    prompt = row.get("prompt")
    length = (
        len(prompt)
        if isinstance(prompt, str)
        else sum(
            len(m.get("content", ""))
            for m in prompt
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
        if isinstance(prompt, list)
        else 0
    )
    if length > MAX_PROMPT_CHARS:
        raise ConfigError(
            f"{where}: its prompt is {length:,} characters, more than the {MAX_PROMPT_CHARS:,} a prompt "
            "may have (far beyond any model's context); shorten it or drop the row"
        )
    stack = [(column, value) for column, value in row.items()]
    while stack:
        column, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(
                    f"{where}, column {column!r}: holds {value[e.start]!r}, half of a UTF-16 pair, which "
                    "is not a character; repair the text (its source decoded it wrongly)"
                ) from None
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"{where}, column {column!r}: {value} is not a value; write null for a missing one"
            )
        elif isinstance(value, dict):
            stack.extend((column, v) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((column, v) for v in value)
    answer = row.get("answer")
    if isinstance(answer, (dict, list, tuple)):
        raise ConfigError(
            f"{where}, column 'answer': a {type(answer).__name__}; 'answer' is the gold answer the built-in rewards "
            "and scorers read, a number or a text: write it as one, or give a structured value another column name"
        )


def _tokens_up_to(tokenizer, text: str, templated: bool, limit: int) -> int:
    """The token count of `text` as tokenize_prompts encodes it, exact up to `limit` + 1; a longer text
    is counted only as far as needed to exceed that, from prefixes four times longer each time,
    so a megabyte of text is not tokenized whole to find that it does not fit."""
    end = 4 * (limit + 2)
    while True:
        count = len(tokenizer(text[:end], add_special_tokens=not templated)["input_ids"])
        # a prefix's count may differ from the whole's first tokens by one at the cut
        if end >= len(text) or count > limit + 1:
            return count
        end *= 4


class PromptEncoder:
    """Rows -> the prompt token ids generation starts from, as configured (data.chat_template,
    data.chat_template_kwargs, data.few_shot, rollout.max_prompt_length), counting the prompts
    it truncates."""

    def __init__(
        self,
        tokenizer,
        use_chat_template: bool,
        few_shot: str | None,
        max_prompt_length: int | None,
        template_kwargs: dict | None = None,
    ):
        self.tokenizer, self.use_chat_template, self.few_shot = (
            tokenizer,
            use_chat_template,
            few_shot,
        )
        self.max_prompt_length = max_prompt_length
        self.template_kwargs = template_kwargs
        self.truncated = 0
        """Prompts truncated since `take_truncated` last asked."""
        self._warned = False
        self._setup = chat_template.Budget("the prompts of set-up (the training and held-out rows)")
        """The time rendering every row's prompt at set-up may take in all (`check_fits`)."""
        if use_chat_template:  # a template too large is refused before anything renders
            chat_template.check_size(tokenizer, template_kwargs)

    def __call__(self, rows: list[Row], tools: list[dict] | None = None) -> list[list[int]]:
        """`tools`: the tool schemas these prompts offer, in place of template_kwargs' (an
        environment's, grpo.rollout.environments)."""
        kwargs = self.template_kwargs
        if tools is not None:
            kwargs = {**(kwargs or {}), "tools": tools or None}  # None: no tool boilerplate
        _, ids = tokenize_prompts(
            rows, self.tokenizer, self.use_chat_template, self.few_shot, kwargs
        )
        long = (
            sum(len(tokens) > self.max_prompt_length for tokens in ids)
            if self.max_prompt_length
            else 0
        )
        self.truncated += long
        if long:
            self._warn(long, len(rows))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return [truncate_prompt(tokens, self.max_prompt_length, bos) for tokens in ids]

    def take_truncated(self) -> int:
        count, self.truncated = self.truncated, 0
        return count

    def check_fits(
        self, rows: list[Row], max_completion_length: int, context: int | None, what: str
    ) -> None:
        """Start-up: the longest prompt (as truncated) plus max_completion_length must fit the model's
        context. Only prompts that may not fit are tokenized: a text's UTF-8 bytes, plus a few special
        tokens, bound its token count (tokenizing every row would cost a second per 4,000 rows)."""
        if context is None or not rows:
            return
        budget = context - max_completion_length  # the most prompt tokens that fit
        if budget < 1:
            raise ConfigError(
                f"rollout.max_completion_length={max_completion_length} leaves no room for a prompt in the model's "
                f"context of {context} tokens (max_position_embeddings); lower it"
            )
        if self.max_prompt_length is not None and self.max_prompt_length <= budget:
            return
        rendered = render_prompts(
            [row["prompt"] for row in rows],
            self.tokenizer,
            self.use_chat_template,
            self.few_shot,
            self.template_kwargs,
            self._setup,
        )
        suspects = [i for i, (text, _) in enumerate(rendered) if len(text.encode()) + 8 > budget]
        if not suspects:
            return
        counts = [_tokens_up_to(self.tokenizer, *rendered[i], budget) for i in suspects]
        length, i = max((min(n, self.max_prompt_length or n), i) for n, i in zip(counts, suspects))
        if length > budget:
            cut = " (after rollout.max_prompt_length)" if self.max_prompt_length is not None else ""
            exact = length == self.max_prompt_length or len(rendered[i][0]) <= 4 * (budget + 2)
            over = "" if exact else "over "
            raise ConfigError(
                f"{what}: row {i}'s prompt is {over}{length} tokens{cut}, and with rollout.max_completion_length="
                f"{max_completion_length} that is {over}{length + max_completion_length} tokens, beyond the model's "
                f"context of {context} (max_position_embeddings); set rollout.max_prompt_length to at most "
                f"{budget} or lower rollout.max_completion_length"
            )

    def _warn(self, long: int, total: int) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning(
            "%d of %d prompts in a batch are longer than rollout.max_prompt_length=%d tokens: each keeps its BOS and its "
            "last tokens (the start goes); counted in prompts/truncated, warned about only this once. Raise "
            "rollout.max_prompt_length (or leave it unset) to keep them whole",
            long,
            total,
            self.max_prompt_length,
        )
