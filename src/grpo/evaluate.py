"""Held-out evaluation: greedy and sampled accuracy, before/after table like the seed's.

One completion per held-out problem per decoding setting. A completion is
*formatted* when it writes an `Answer: N` line, and *correct* when the last
such N equals the row's `answer` (the seed's reward). The seed's experiment,
200 held-out problems:

    | decoding      | correct before | correct after | formatted before | formatted after | ...
    | greedy        | 8/200          | 194/200       | 8/200            | 200/200         |
    | temperature 1 | 91/200         | 191/200       | 106/200          | 199/200         |

"correct among formatted" (91/106 before, 191/199 after at temperature 1)
separates learning the format from learning the arithmetic.

Sampling uses a fresh `torch.Generator` seeded with `seed` for each
temperature, so the same model on the same rows gives the same completions,
and "before" and "after" see the same random stream.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config, ConfigError
from grpo.data import Row, encode_prompts, is_conversational
from grpo.models import bf16_autocast
from grpo.rewards.arithmetic import completion_text, extract_answer
from grpo.rollout import SamplingParams, StopStrings, generate

NUM_SAMPLES = 3
"""(prompt, completion, answer) examples kept in each EvalResult."""


# --------------------------------------------------------------------------
# Scoring (pure)
# --------------------------------------------------------------------------


@dataclass
class Counts:
    """How many of n completions are formatted / correct."""

    n: int
    correct: int
    formatted: int
    correct_among_formatted: int
    predicted: list[int | None] = field(default_factory=list)
    """The extracted answer of each completion (None: no `Answer:` line)."""


def _answer_of(row: Row, index: int) -> int:
    if "answer" not in row:
        raise ConfigError(
            f"held-out row {index} has no 'answer' column (columns: {sorted(row)}); evaluation compares the "
            "last 'Answer: N' of each completion with row['answer'], so every held-out row needs an integer "
            "'answer' (add it to data.eval_file)"
        )
    value = row["answer"]
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str):
            value = value.replace(",", "").strip()
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"held-out row {index}: 'answer' must be an integer (e.g. 127 or \"127\"), got {row['answer']!r}"
        ) from None


def check_answers(rows: list[Row]) -> list[int]:
    """The integer answer of every row; a clear error for a missing or non-integer one."""
    return [_answer_of(row, i) for i, row in enumerate(rows)]


def score_completions(texts: list[str], rows: list[Row]) -> Counts:
    """Count formatted and correct completions, one text per row.

    Example: answers [127, -5, 1000, 3], texts
        ["... Answer: 127", "Answer: 2\\nAnswer: -5", "Answer: 1,000", "the answer is 3"]
    -> n=4, correct=3, formatted=3, correct_among_formatted=3.
    """
    if len(texts) != len(rows):
        raise ValueError(f"score_completions: {len(texts)} completions for {len(rows)} rows")
    answers = check_answers(rows)
    predicted = [extract_answer(completion_text(t)) for t in texts]
    formatted = [p is not None for p in predicted]
    correct = [p is not None and p == a for p, a in zip(predicted, answers)]
    return Counts(
        n=len(texts),
        correct=sum(correct),
        formatted=sum(formatted),
        correct_among_formatted=sum(c and f for c, f in zip(correct, formatted)),
        predicted=predicted,
    )


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


@dataclass
class EvalResult:
    """One model x one decoding setting on the held-out rows."""

    label: str
    """"before", "after", "step 50", ..."""
    step: int
    temperature: float
    """0 = greedy."""
    n: int
    correct: int
    formatted: int
    """Completions with an `Answer: N` line."""
    correct_among_formatted: int
    """Correct completions among the formatted ones (= correct: an unformatted
    completion cannot be correct), reported against `formatted`."""
    mean_reward: float
    """Mean weighted total of the configured rewards (correct / n without a reward set)."""
    mean_length: float = 0.0
    """Mean completion length in tokens."""
    clipped_ratio: float = 0.0
    """Fraction of completions that hit max_new_tokens without ending."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """A few {"prompt", "completion", "answer", "predicted", "correct"} examples."""

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def decoding(self) -> str:
        return decoding_name(self.temperature)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvalResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def decoding_name(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"temperature {temperature:g}"


# --------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------


def _prompt_text(prompt: Any) -> str:
    return completion_text(prompt) if isinstance(prompt, list) else prompt


def evaluate(
    model,
    tokenizer,
    rows: list[Row],
    *,
    temperatures: list[float] | tuple[float, ...],
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    use_chat_template: bool,
    few_shot: str | None,
    max_prompt_length: int | None,
    stop_strings: list[str] | None,
    eos_token_ids: list[int],
    pad_token_id: int,
    bf16: bool = False,
    reward_set=None,
    label: str = "eval",
    step: int = 0,
) -> list[EvalResult]:
    """One completion per row per temperature (0 = greedy); one EvalResult per temperature.

    `reward_set` (a grpo.rewards.RewardSet) gives `mean_reward` as the mean
    weighted total of the configured rewards; without it, mean_reward = correct / n.
    """
    if not rows:
        raise ConfigError("no held-out rows to evaluate; set data.arithmetic.num_eval > 0 or data.eval_file")
    if batch_size < 1:
        raise ConfigError(f"eval.batch_size: must be > 0, got {batch_size}")
    check_answers(rows)  # fail before any generation
    _, prompt_ids = encode_prompts(rows, tokenizer, use_chat_template, few_shot, max_prompt_length)
    device = next(model.parameters()).device
    stop = StopStrings(tokenizer, list(stop_strings)) if stop_strings else None

    was_training = model.training
    model.eval()
    results = []
    try:
        for temperature in temperatures:
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature))
            generator = torch.Generator(device=device).manual_seed(seed)
            texts: list[str] = []
            ids: list[list[int]] = []
            truncated: list[bool] = []
            for start in range(0, len(rows), batch_size):
                with torch.no_grad(), bf16_autocast(device, bf16):
                    rollout = generate(
                        model,
                        prompt_ids[start : start + batch_size],
                        1,
                        params,
                        eos_token_ids=eos_token_ids,
                        pad_token_id=pad_token_id,
                        generator=generator,
                        stop=stop,
                    )
                batch_ids = [
                    c[m.bool()].tolist()
                    for c, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())
                ]
                ids += batch_ids
                texts += tokenizer.batch_decode(batch_ids, skip_special_tokens=True)
                truncated += rollout.truncated.cpu().tolist()
            results.append(_result(label, step, float(temperature), rows, texts, ids, truncated, reward_set))
    finally:
        model.train(was_training)
    return results


def _result(label, step, temperature, rows, texts, ids, truncated, reward_set) -> EvalResult:
    counts = score_completions(texts, rows)
    answers = check_answers(rows)
    if reward_set is not None and len(reward_set.funcs):
        from grpo.algorithm import combine_rewards

        completions = [
            [{"role": "assistant", "content": t}] if is_conversational(r) else t for r, t in zip(rows, texts)
        ]
        per_func = reward_set.score([r["prompt"] for r in rows], completions, ids, rows)
        totals = combine_rewards(per_func, reward_set.weights)
        present = ~torch.isnan(totals)
        mean_reward = float(totals[present].mean()) if present.any() else math.nan
    else:
        mean_reward = counts.correct / counts.n
    samples = [
        {
            "prompt": _prompt_text(rows[i]["prompt"]),
            "completion": texts[i],
            "answer": answers[i],
            "predicted": counts.predicted[i],
            "correct": counts.predicted[i] == answers[i],
        }
        for i in range(min(NUM_SAMPLES, len(rows)))
    ]
    return EvalResult(
        label=label,
        step=step,
        temperature=temperature,
        n=counts.n,
        correct=counts.correct,
        formatted=counts.formatted,
        correct_among_formatted=counts.correct_among_formatted,
        mean_reward=mean_reward,
        mean_length=sum(len(x) for x in ids) / len(ids),
        clipped_ratio=sum(truncated) / len(truncated),
        samples=samples,
    )


class Evaluator:
    """Evaluation as configured by `cfg.eval`; each call appends to <output_dir>/eval.jsonl.

        evaluator = Evaluator(cfg, tokenizer, eos_ids, pad_id, held_out_rows)
        before = evaluator(model, "before", 0)
        ...
        after = evaluator(model, "after", trainer.step)
        print(format_table(before, after))
    """

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        eos_token_ids: list[int],
        pad_token_id: int,
        rows: list[Row],
        reward_set=None,
    ):
        e = cfg.eval
        if e.num_problems is not None:
            if e.num_problems < 1:
                raise ConfigError(f"eval.num_problems: must be > 0 (or null for all), got {e.num_problems}")
            rows = rows[: e.num_problems]
        if not rows:
            raise ConfigError(
                "evaluation needs held-out rows: set data.arithmetic.num_eval > 0 (task arithmetic) "
                "or data.eval_file (task jsonl)"
            )
        check_answers(rows)
        self.cfg, self.tokenizer, self.rows, self.reward_set = cfg, tokenizer, rows, reward_set
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.max_new_tokens = e.max_completion_length or cfg.rollout.max_completion_length
        self.path = Path(cfg.output_dir) / "eval.jsonl"

    def __call__(self, model, label: str, step: int) -> list[EvalResult]:
        cfg = self.cfg
        results = evaluate(
            model,
            self.tokenizer,
            self.rows,
            temperatures=cfg.eval.temperatures,
            max_new_tokens=self.max_new_tokens,
            batch_size=cfg.eval.batch_size,
            seed=cfg.eval.seed,
            use_chat_template=cfg.data.chat_template == "auto",
            few_shot=cfg.data.few_shot,
            max_prompt_length=cfg.rollout.max_prompt_length,
            stop_strings=cfg.rollout.stop_strings,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            bf16=cfg.training.bf16,
            reward_set=self.reward_set,
            label=label,
            step=step,
        )
        append_results(self.path, results)
        return results


def append_results(path: str | Path, results: list[EvalResult]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in results:
            f.write(json.dumps(r.to_dict()) + "\n")


def read_results(path: str | Path) -> list[EvalResult]:
    """Every EvalResult in an eval.jsonl, in file order (blank or broken lines skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(EvalResult.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return out


def latest(results: list[EvalResult], label: str) -> list[EvalResult]:
    """The last result with `label` for each temperature, in order of first appearance."""
    by_temperature: dict[float, EvalResult] = {}
    for r in results:
        if r.label == label:
            by_temperature[r.temperature] = r
    return list(by_temperature.values())


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------


def _fraction(x: int, total: int) -> str:
    return f"{x}/{total} ({100 * x / total:.1f}%)" if total else f"{x}/{total}"


def _reward(value: float) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def format_table(before: list[EvalResult], after: list[EvalResult] | None = None) -> str:
    """A markdown table, one row per decoding setting, before (and after) side by side.

    Columns: correct (x/n), formatted (x/n), correct among formatted (x/formatted),
    mean reward; each for before and, when given, after.
    """
    columns = [
        ("correct", lambda r: _fraction(r.correct, r.n)),
        ("formatted", lambda r: _fraction(r.formatted, r.n)),
        ("correct among formatted", lambda r: _fraction(r.correct_among_formatted, r.formatted)),
        ("mean reward", lambda r: _reward(r.mean_reward)),
    ]
    before_by = {r.temperature: r for r in before}
    after_by = {r.temperature: r for r in after} if after is not None else {}
    temperatures = list(before_by) + [t for t in after_by if t not in before_by]
    before_name = before[0].label if before else "before"
    after_name = after[0].label if after else "after"
    header = ["decoding"]
    for name, _ in columns:
        header.append(f"{name} ({before_name})")
        if after is not None:
            header.append(f"{name} ({after_name})")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|"]
    for t in temperatures:
        cells = [decoding_name(t)]
        for _, fmt in columns:
            cells.append(fmt(before_by[t]) if t in before_by else "—")
            if after is not None:
                cells.append(fmt(after_by[t]) if t in after_by else "—")
        lines.append("| " + " | ".join(cells) + " |")
    n = {r.n for r in list(before) + list(after or [])}
    if n:
        lines.append("")
        lines.append(f"{'/'.join(str(x) for x in sorted(n))} held-out problems, one completion each per decoding setting.")
    return "\n".join(lines)
