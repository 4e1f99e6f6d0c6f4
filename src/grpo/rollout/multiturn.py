"""Multi-turn rollouts with tools, token-in and token-out, around any engine's one-turn generation.

`ToolEngine` wraps a rollout engine (grpo.rollout.base.RolloutEngine). A completion is
generated turn by turn:

1. the engine samples a turn from the prompt plus everything of the completion so far (token
   ids, never text); the turn ends at EOS, at the default call format's closing tag
   (`</tool_call>`, a stop string when the tokenizer has no response parser of its own), or at
   the length budget;
2. the turn's calls are parsed (grpo.rollout.tools.parse_turn) and run (ToolRunner); one that
   cannot be parsed is dropped, as in TRL, or answered with the parse error
   (rollout.malformed_tool_calls);
3. the tool results are appended as the chat template renders tool messages: the template is
   rendered for a short conversation ending in an assistant call, with and without the tool
   messages (and the next assistant header), and what the template writes after the assistant
   turn's end-of-turn token is appended (`ToolRendering.suffix`). A tokenizer whose template does not render tool messages
   (or that has none) gets the default rendering, the text
   "<tool_response>\\n{result}\\n</tool_response>\\n" per result, tokenized on its own;
4. back to 1, until a turn makes no call, or `rollout.max_tool_calls` turns have made calls.

The completion trained on is the concatenation of the sampled turns and the appended tool
results, exactly as those tokens were fed to the model: the sampled ids are never decoded and
encoded again (they are decoded only to find the calls). `Rollout.tool_mask` marks the
appended tokens: they get loss mask 0 (grpo.training.scoring.score), so they count in
no normaliser of the loss, and their sampling logprobs are 0 and never compared.

The length budget: `rollout.max_completion_length` bounds the whole completion, turns and tool
results together. A turn that reaches it is cut there and the completion is truncated; a tool
result that would not fit ends the completion before it (also truncated). Truncated
completions are masked out of the loss when algorithm.mask_truncated_completions is set.

Sampling: a completion's first turn is drawn exactly as without tools (its prompt's seed);
a later turn is drawn from a seed derived from that seed, the completion's index and the turn,
so completions still depend on their prompt's seed alone.

Environments (grpo.rollout.environments): each completion has its own prompt (its
environment's reset may add to it) and its own tools (its environment's methods). A group
whose G prompts are the same is sampled as a group, as above; a group whose prompts differ is
sampled one completion at a time, completion j from turn_seed(seed, j, 0).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from grpo.config.errors import ConfigError
from grpo.rewards import chat_template
from grpo.rollout.environments import Episode
from grpo.rollout.tools import (
    CALL_CLOSE,
    MAX_CALLS_PER_TURN,
    ToolCall,
    ToolCounts,
    ToolResult,
    ToolRunner,
    parse_turn,
)
from grpo.rollout.types import SEED_BOUND, Rollout, SamplingParams, Seeds, prompt_seeds

_PROBE = "grpo-tool-probe-8d1c"


def turn_seed(seed: int, index: int, turn: int) -> int:
    """The seed of turn `turn` (1, 2, ...) of completion `index` of a prompt sampled with `seed`."""
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + index * 7_919 + turn) % SEED_BOUND
    )
    return int(torch.randint(0, SEED_BOUND, (1,), generator=generator, device="cpu"))


class ToolRendering:
    """The tokens that follow an assistant turn holding calls: the tool results, as the chat
    template renders tool messages, up to the next assistant header."""

    def __init__(self, tokenizer, eos_token_ids, template_kwargs: dict | None = None):
        self.tokenizer, self.eos = tokenizer, set(eos_token_ids)
        self.template_kwargs = dict(template_kwargs or {})
        self.uses_template = self._template_renders_tools()
        if self.uses_template:  # a template whose tool messages cannot be appended fails at start
            for ended in (True, False):
                try:
                    self.suffix([ToolResult("probe", _PROBE)], ended)
                except chat_template.TemplateRefused:
                    raise
                except ValueError as error:
                    raise ConfigError(f"rollout.tools: {error}") from None

    def _render(self, messages, add_generation_prompt: bool) -> list[int]:
        return self._render_both([messages], [add_generation_prompt])[0]

    def _render_both(self, conversations: list, flags: list[bool]) -> list[list[int]]:
        """Each conversation's token ids as apply_chat_template(tokenize=True) gives them, rendered
        together within the template's limits (grpo.rewards.chat_template)."""
        texts = chat_template.render(
            self.tokenizer, conversations, add_generation_prompt=flags, **self.template_kwargs
        )
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _template_renders_tools(self) -> bool:
        if not getattr(self.tokenizer, "chat_template", None):
            return False
        try:
            ids = self._render(self._conversation([ToolResult("probe", _PROBE)]), True)
        except chat_template.TemplateFailed:  # it refuses tool messages: the default rendering
            return False
        except ConfigError:  # a template past its limits: refused, not passed over
            raise
        except Exception:  # a template that refuses tool messages: the default rendering
            return False
        return _PROBE in self.tokenizer.decode(ids)

    @staticmethod
    def _conversation(results: list[ToolResult]) -> list[dict]:
        calls = [{"type": "function", "function": {"name": results[0].name, "arguments": {}}}]
        return [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ] + [{"role": "tool", "name": r.name, "content": r.content} for r in results]

    def suffix(self, results: list[ToolResult], turn_ended_with_eos: bool) -> list[int]:
        """The token ids to append after a turn whose calls gave `results`."""
        if not self.uses_template:
            text = "".join(f"\n<tool_response>\n{r.content}\n</tool_response>\n" for r in results)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        conversation = self._conversation(results)
        before, after = self._render_both([conversation[:2], conversation], [False, True])
        # The assistant's turn ends at its end-of-turn token: the n-th such token of the conversation,
        # n counted in the rendering that ends with the turn. What the template writes after it (a
        # newline, the tool messages, the next assistant header) is the suffix; a turn that stopped at
        # the closing tag has no end-of-turn token yet, so its suffix starts with that token. Counting
        # tokens instead of comparing prefixes lets a template write the turn itself differently once
        # tool messages follow it (Qwen3 drops an empty <think></think> then): the sampled turn is
        # kept as it was sampled either way.
        n = sum(token in self.eos for token in before)
        if n:
            ends = [i for i, token in enumerate(after) if token in self.eos]
            if len(ends) >= n:
                end = ends[n - 1]
                return after[end + 1 :] if turn_ended_with_eos else after[end:]
        elif after[: len(before)] == before:
            return after[len(before) :]
        raise ValueError(
            "the chat template's tool messages cannot be told apart from the assistant's turn (it ends the "
            "turn with no end-of-turn token of the tokenizer's, and writes the turn differently when tool "
            "messages follow it); use a template that ends turns with an end-of-turn token"
        )


@dataclass
class _Row:
    prompt: list[int]
    tools: dict
    """The tools its calls may use (an environment's rollout: its own)."""
    ids: list[int]
    logprobs: list[float]
    tool: list[int]
    truncated: bool
    turns: int = 1
    last_turn: list[int] | None = None
    last_ended_with_eos: bool = False
    messages: list[dict] = field(default_factory=list)
    """The completion as TRL's messages: each assistant turn, then its tool results."""


class ToolEngine:
    """A rollout engine whose completions may call tools (module docstring); every other call goes
    to `inner`, the engine that samples each turn."""

    def __init__(
        self,
        inner,
        tokenizer,
        runner: ToolRunner,
        max_tool_calls: int,
        template_kwargs: dict | None = None,
        answer_malformed: bool = False,
    ):
        self.inner, self.tokenizer, self.runner = inner, tokenizer, runner
        self.max_tool_calls = max_tool_calls
        self.answer_malformed = answer_malformed
        """rollout.malformed_tool_calls: answer (a call that cannot be parsed is answered with
        the parse error) or end (it is dropped and counted: no call, as in TRL)."""
        self.eos_token_ids, self.pad_token_id = inner.eos_token_ids, inner.pad_token_id
        self.rendering = ToolRendering(tokenizer, inner.eos_token_ids, template_kwargs)
        self.schemas = [tool.schema for tool in runner.tools.values()]
        self.counts = ToolCounts()

    @staticmethod
    def stop_strings(tokenizer) -> list[str]:
        """The stop strings the inner engine needs: the default format's closing tag, unless the
        tokenizer parses its own format (then a turn ends at EOS, as the template writes it)."""
        return [] if getattr(tokenizer, "response_template", None) is not None else [CALL_CLOSE]

    @staticmethod
    def inner_config(cfg, tokenizer):
        """`cfg` with the stop strings the inner engine needs added (a copy)."""
        cfg = copy.deepcopy(cfg)
        for stop in ToolEngine.stop_strings(tokenizer):
            if stop not in cfg.rollout.stop_strings:
                cfg.rollout.stop_strings.append(stop)
        return cfg

    @property
    def device(self):
        return self.inner.device

    def sync_weights(self, policy) -> None:
        self.inner.sync_weights(policy)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def take_counts(self) -> dict[str, float]:
        counts, self.counts = self.counts, ToolCounts()
        return counts.as_dict()

    # ------------------------------------------------------------ generation

    def generate(
        self,
        prompts,
        num_generations,
        params: SamplingParams,
        seeds: Seeds = None,
        episodes: list[Episode] | None = None,
    ) -> Rollout:
        """G completions of each prompt. With `episodes` (grpo.rollout.environments: one per
        completion, group-major), `prompts` holds each completion's own prompt (its environment's
        reset may have added to it) and its calls go to its episode's tools."""
        G, budget = num_generations, params.max_new_tokens
        if episodes is None:
            seeds = prompt_seeds(seeds, len(prompts))
            first = self.inner.generate(prompts, G, params, seeds)
            own = [prompts[i // G] for i in range(len(first))]
            toolsets = [self.runner.tools] * len(first)
        else:
            seeds = prompt_seeds(seeds, len(prompts) // G)
            first, own = self._first_turns(prompts, G, params, seeds), prompts
            toolsets = [episode.tools for episode in episodes]
        rows = [self._row(own[i], first, i, toolsets[i]) for i in range(len(first))]
        calls = {i: self._read_turn(row) for i, row in enumerate(rows)}
        waiting = [i for i, row in enumerate(rows) if calls[i] and not row.truncated]
        turn = 1
        while waiting and turn <= self.max_tool_calls:
            flat = [(i, call) for i in waiting for call in calls[i]]
            results = self.runner.run([call for _, call in flat], [rows[i].tools for i, _ in flat])
            for result in results:
                self.counts.add(result)
            by_row: dict[int, list[ToolResult]] = {}
            for (i, _), result in zip(flat, results):
                by_row.setdefault(i, []).append(result)
            going = []
            for i in waiting:
                row = rows[i]
                suffix = self.rendering.suffix(by_row[i], row.last_ended_with_eos)
                if len(row.ids) + len(suffix) >= budget:  # no room for the results and a reply
                    row.truncated = True
                    continue
                row.ids += suffix
                row.logprobs += [0.0] * len(suffix)
                row.tool += [1] * len(suffix)
                row.messages += [
                    {"role": "tool", "name": r.name, "content": r.content} for r in by_row[i]
                ]
                going.append(i)
            if not going:
                break
            left = [budget - len(rows[i].ids) for i in going]
            turn_params = replace(params, max_new_tokens=max(left))
            turn_seeds = [turn_seed(seeds[i // G], i % G, turn) for i in going]
            sampled = self.inner.generate(
                [rows[i].prompt + rows[i].ids for i in going], 1, turn_params, turn_seeds
            )
            for k, i in enumerate(going):
                row = rows[i]
                ids, logprobs = _turn(sampled, k)
                cut = len(ids) > left[k]
                ids, logprobs = ids[: left[k]], logprobs[: left[k]]
                row.ids += ids
                row.logprobs += logprobs
                row.tool += [0] * len(ids)
                row.turns += 1
                row.truncated = cut or bool(sampled.truncated[k])
                row.last_turn = ids
                row.last_ended_with_eos = not cut and self._ends_turn(ids)
                calls[i] = self._read_turn(row)
            turn += 1
            waiting = [i for i in going if calls[i] and not rows[i].truncated]
        self.counts.completions += len(rows)
        self.counts.turns += sum(row.turns for row in rows)
        return self._rollout(first, rows)

    def _first_turns(self, prompts, G: int, params: SamplingParams, seeds: list[int]) -> Rollout:
        """The first turns of completions with their own prompts: sampled as groups, exactly as
        without environments, when each group's prompts are the same; otherwise one at a time,
        completion j of a group from turn_seed(seed, j, 0)."""
        groups = [prompts[g * G : (g + 1) * G] for g in range(len(prompts) // G)]
        if all(all(p == group[0] for p in group) for group in groups):
            return self.inner.generate([group[0] for group in groups], G, params, seeds)
        singles = [turn_seed(seeds[i // G], i % G, 0) for i in range(len(prompts))]
        return self.inner.generate(prompts, 1, params, singles)

    def _row(self, prompt: list[int], rollout: Rollout, i: int, tools: dict) -> _Row:
        ids, logprobs = _turn(rollout, i)
        return _Row(
            prompt=list(prompt),
            tools=tools,
            ids=ids,
            logprobs=logprobs,
            tool=[0] * len(ids),
            truncated=bool(rollout.truncated[i]),
            last_turn=ids,
            last_ended_with_eos=self._ends_turn(ids),
        )

    def _ends_turn(self, ids: list[int]) -> bool:
        """Whether a turn ended on an end-of-turn token (one that stopped at the closing tag did not)."""
        return bool(ids) and ids[-1] in self.rendering.eos

    def _read_turn(self, row: _Row) -> list[ToolCall]:
        """The calls of the row's last turn; its message (TRL's form: the text without the calls as
        content, the calls as tool_calls) is added to the row's conversation."""
        turn = row.last_turn or []
        prefix = row.prompt + row.ids[: len(row.ids) - len(turn)]
        schemas = [tool.schema for tool in row.tools.values()]
        content, calls = parse_turn(self.tokenizer, turn, prefix, schemas)
        parsed = [c for c in calls if c.arguments is not None]
        if calls and not parsed and not self.answer_malformed:
            # no call after all: the turn is the model's answer, its text as written (TRL falls
            # back to the decoded text when it cannot parse a response)
            content = self.tokenizer.decode(turn, skip_special_tokens=True).strip()
        message = {"role": "assistant", "content": content}
        if parsed:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed
            ]
        row.messages.append(message)
        if not self.answer_malformed:
            self.counts.malformed += len(calls) - len(parsed)
            calls = parsed
        if len(calls) > MAX_CALLS_PER_TURN:
            extra = ToolCall("", None, f"at most {MAX_CALLS_PER_TURN} calls per turn are run")
            calls = calls[:MAX_CALLS_PER_TURN] + [extra]
        return calls

    def _rollout(self, first: Rollout, rows: list[_Row]) -> Rollout:
        N, width = len(rows), max((len(r.ids) for r in rows), default=0)
        ids = torch.full((N, width), self.pad_token_id, dtype=torch.long, device="cpu")
        mask = torch.zeros((N, width), dtype=torch.long, device="cpu")
        tool = torch.zeros((N, width), dtype=torch.long, device="cpu")
        logprobs = torch.zeros((N, width), dtype=torch.float32, device="cpu")
        for i, row in enumerate(rows):
            n = len(row.ids)
            ids[i, :n] = torch.tensor(row.ids, dtype=torch.long, device="cpu")
            mask[i, :n] = 1
            tool[i, :n] = torch.tensor(row.tool, dtype=torch.long, device="cpu")
            logprobs[i, :n] = torch.tensor(row.logprobs, dtype=torch.float32, device="cpu")
        # assembled on the host, handed over on the engine's device (whatever device the first
        # turns came back on: an engine around the real one may build them elsewhere)
        return Rollout(
            prompt_ids=first.prompt_ids,
            prompt_mask=first.prompt_mask,
            completion_ids=ids,
            completion_mask=mask,
            truncated=torch.tensor([r.truncated for r in rows], device="cpu"),
            sampling_logprobs=logprobs if first.sampling_logprobs is not None else None,
            tool_mask=tool,
            messages=[row.messages for row in rows],
        ).to(self.device)


def _turn(rollout: Rollout, i: int) -> tuple[list[int], list[float]]:
    """Row i's sampled ids and logprobs."""
    n = int(rollout.completion_mask[i].sum())
    ids = rollout.completion_ids[i, :n].tolist()
    logprobs = (
        rollout.sampling_logprobs[i, :n].tolist()
        if rollout.sampling_logprobs is not None
        else [0.0] * n
    )
    return ids, logprobs


TOOL_OPEN, TOOL_CLOSE = "[tool result]", "[/tool result]"
"""How `marked_texts` sets the appended tool-result tokens apart in samples."""


def marked_texts(tokenizer, rollout: Rollout) -> list[str]:
    """Each completion's text with its tool results (Rollout.tool_mask) between TOOL_OPEN and
    TOOL_CLOSE, for the sample completions; special tokens skipped, as in the completions' texts.

    Example: sampled "A<tool_call>..</tool_call>", appended "<tool>3</tool>", sampled "B"
    -> "A<tool_call>..</tool_call>[tool result]<tool>3</tool>[/tool result]B"."""
    texts = []
    for ids, mask, tool in zip(
        rollout.completion_ids.tolist(),
        rollout.completion_mask.tolist(),
        rollout.tool_mask.tolist(),
    ):
        n = sum(mask)
        parts, start = [], 0
        for t in range(1, n + 1):
            if t == n or tool[t] != tool[start]:
                text = tokenizer.decode(ids[start:t], skip_special_tokens=True)
                parts.append(f"{TOOL_OPEN}{text}{TOOL_CLOSE}" if tool[start] else text)
                start = t
        texts.append("".join(parts))
    return texts
