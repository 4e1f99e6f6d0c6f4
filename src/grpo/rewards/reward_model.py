"""A learned reward: a `transformers` sequence-classification model scoring prompt + completion.

    rewards:
      funcs: ["reward_model:path/to/model"]     # a local directory (or a hub id when online)
      reward_model_device: auto                 # its own device and dtype, not the policy's
      reward_model_dtype: float32
      reward_model_batch_size: 8

The text scored is what the reward model was trained on: a conversational
prompt (a list of {role, content}) plus the completion as the assistant's
message, through the reward model's own chat template when it has one;
otherwise the prompt and completion texts concatenated. The score is the
model's logit `label` (0 for the usual one-output reward model).

The model is trusted code of the run, loaded once: `runs_in_process` tells the
reward executor to call it in the trainer's process (loading it again in a
worker would cost its memory and start-up time again).
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import RewardsConfig
from grpo.rewards import chat_template
from grpo.rewards.arithmetic import completion_text

PREFIX = "reward_model:"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"rewards.reward_model_device: {device!r} is not a device; use auto, cpu or cuda[:N]"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"rewards.reward_model_device: {device!r}, but no CUDA device is available; use auto or cpu"
        )
    return resolved


class RewardModel:
    """`RewardModel(path)(prompts, completions, completion_ids, **columns) -> list[float]`.

    `tokenizer`: the reward model's tokenizer object (TRL's reward_processing_classes) instead
    of the one saved with it (it is given a pad token and right padding if it lacks them).
    `RewardModel.from_model(model, tokenizer)` scores with a sequence-classification model
    object already loaded, kept in its own dtype."""

    runs_in_process = True

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 8,
        max_length: int | None = None,
        label: int = 0,
        tokenizer=None,
        model=None,
    ):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if model is not None:
            self._set_up(model, tokenizer, device, batch_size, max_length, label)
            return
        self.path = str(path)
        if dtype not in DTYPES:
            raise ConfigError(
                f"rewards.reward_model_dtype: {dtype!r} is not one of {', '.join(DTYPES)}"
            )
        if batch_size < 1:
            raise ConfigError(f"rewards.reward_model_batch_size: must be > 0, got {batch_size}")
        try:
            # never a model's own code (and never a question on the terminal about running it)
            config = AutoConfig.from_pretrained(self.path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            if "trust_remote_code" in str(e):
                raise ConfigError(
                    f"reward model {self.path!r}: it brings its own Python code (auto_map), which a reward model is "
                    "never allowed to run; use a sequence-classification model transformers knows itself"
                ) from None
            where = (
                "no config.json in that directory"
                if Path(self.path).is_dir()
                else "no such directory"
            )
            raise ConfigError(
                f"reward model {self.path!r}: {where}, and not loadable from the hub ({type(e).__name__}); expected "
                "a transformers sequence-classification model saved with save_pretrained"
            ) from None
        architectures = getattr(config, "architectures", None) or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ConfigError(
                f"reward model {self.path!r}: expected a sequence-classification model (an architecture "
                f"'...ForSequenceClassification'), got {architectures or 'no architectures in config.json'}; "
                "a causal LM or base model has no trained score head"
            )
        if not 0 <= label < config.num_labels:
            raise ConfigError(
                f"reward model {self.path!r}: label {label} is out of range; the model has {config.num_labels} "
                f"output(s), so pick a label in 0..{config.num_labels - 1}"
            )
        self.device, self.dtype = _device(device), DTYPES[dtype]
        self.batch_size, self.label = batch_size, label

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(
            self.path, trust_remote_code=False
        )
        self._prepare_tokenizer()
        self.max_length = max_length or getattr(config, "max_position_embeddings", None) or 2048

        model, info = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=self.dtype, output_loading_info=True, trust_remote_code=False
        )
        if info.get("missing_keys"):
            raise ConfigError(
                f"reward model {self.path!r}: weights missing from the checkpoint ({sorted(info['missing_keys'])[:4]}); "
                "a freshly initialised score head gives meaningless rewards; save the trained reward model"
            )
        # The model finds each sequence's last token by the pad id, so it must be the tokenizer's.
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.__name__ = Path(self.path).name or self.path

    @classmethod
    def from_model(
        cls, model, tokenizer=None, *, device: str = "auto", batch_size: int = 8
    ) -> "RewardModel":
        """A reward from a sequence-classification model object (its tokenizer: `tokenizer`, or
        the one saved at its name_or_path)."""
        return cls(model=model, tokenizer=tokenizer, device=device, batch_size=batch_size)

    def _set_up(self, model, tokenizer, device, batch_size, max_length, label) -> None:
        from transformers import AutoTokenizer

        kind = type(model).__name__
        if not kind.endswith("ForSequenceClassification"):
            raise ConfigError(
                f"reward model: expected a sequence-classification model (an architecture "
                f"'...ForSequenceClassification'), got {kind}; a causal LM or base model has no trained score head"
            )
        self.path = getattr(model, "name_or_path", "") or kind
        num_labels = model.config.num_labels
        if not 0 <= label < num_labels:
            raise ConfigError(
                f"reward model {self.path!r}: label {label} is out of range; it has {num_labels} output(s)"
            )
        if tokenizer is None:
            if not getattr(model, "name_or_path", ""):
                raise ConfigError(
                    f"reward model {kind}: built in memory, so its tokenizer cannot be loaded; pass it "
                    "(GRPOTrainer's reward_processing_classes)"
                )
            tokenizer = AutoTokenizer.from_pretrained(model.name_or_path, trust_remote_code=False)
        self.tokenizer, self.batch_size, self.label = tokenizer, batch_size, label
        self._prepare_tokenizer()
        self.max_length = (
            max_length or getattr(model.config, "max_position_embeddings", None) or 2048
        )
        self.device = _device(device)
        self.dtype = next(model.parameters()).dtype
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.__name__ = Path(self.path).name or self.path

    def _prepare_tokenizer(self) -> None:
        if self.tokenizer.pad_token is None:  # many decoder reward models ship without one
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.tokenizer.pad_token is None:
            raise ConfigError(
                f"reward model {self.path!r}: its tokenizer has neither a pad nor an eos token"
            )
        # Right padding: the pads come after the last real token, which is where the
        # classifier reads the sequence, so they change nothing it attends to.
        self.tokenizer.padding_side = "right"
        # Cut from the left when too long: the end of the completion is what is judged.
        self.tokenizer.truncation_side = "left"

    def text(self, prompt, completion) -> tuple[str, bool]:
        """The text scored, and whether a chat template wrote it (it then has its own special tokens)."""
        return self.texts([prompt], [completion])[0]

    def texts(self, prompts, completions) -> list[tuple[str, bool]]:
        """`text` of each pair, the chat template's renderings made together and within its limits
        (grpo.rewards.chat_template: the reward model's directory is untrusted input too)."""
        out: list[tuple[str, bool]] = []
        chats: list[tuple[int, list]] = []
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        for prompt, completion in zip(prompts, completions):
            answer = completion_text(completion)
            if isinstance(prompt, list) and templated:
                chats.append((len(out), [*prompt, {"role": "assistant", "content": answer}]))
                out.append(("", True))
                continue
            prompt_text = (
                "\n".join(m["content"] for m in prompt) + "\n"
                if isinstance(prompt, list)
                else prompt
            )
            out.append((prompt_text + answer, False))
        if chats:
            rendered = chat_template.render(self.tokenizer, [messages for _, messages in chats])
            for (i, _), text in zip(chats, rendered):
                out[i] = (text, True)
        return out

    @torch.no_grad()
    def score_texts(self, texts: list[str], templated: bool) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=not templated,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            scores += logits[:, self.label].float().cpu().tolist()
        return scores

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(
                f"reward model: {len(prompts)} prompts for {len(completions)} completions"
            )
        texts = self.texts(prompts, completions)
        out = [0.0] * len(texts)
        # templated and plain texts are tokenized differently (special tokens), so each kind is its own batch
        for templated in (True, False):
            index = [i for i, (_, t) in enumerate(texts) if t == templated]
            for i, s in zip(index, self.score_texts([texts[i][0] for i in index], templated)):
                out[i] = s
        return out


def is_reward_model(model) -> bool:
    """Whether `model` is a transformers sequence-classification model object (by its class's
    name: asking needs no import of transformers)."""
    return type(model).__name__.endswith("ForSequenceClassification")


def reward_model(model, cfg: RewardsConfig, tokenizer=None) -> tuple[str, RewardModel]:
    """A reward model as a named reward function: `model` is `reward_model:PATH`, a directory or
    hub id (loaded on the rewards section's device, in its dtype), or a sequence-classification
    model object already loaded (kept in its own dtype, moved to the section's device); scoring
    `reward_model_batch_size` completions at a time. `tokenizer`: the model's own (TRL's
    reward_processing_classes), instead of the one saved with it."""
    if isinstance(model, (str, Path)):
        return from_spec(str(model), cfg, tokenizer)
    fn = RewardModel.from_model(
        model,
        tokenizer,
        device=cfg.reward_model_device,
        batch_size=cfg.reward_model_batch_size,
    )
    return fn.__name__, fn


def from_spec(spec: str, cfg: RewardsConfig, tokenizer=None) -> tuple[str, RewardModel]:
    """`reward_model:path/to/model` -> (name, reward), the name being the model directory's name;
    `tokenizer`: its tokenizer object, instead of the one saved with it."""
    path = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    if not path:
        raise ConfigError(
            f"rewards.funcs: {spec!r} names no model; write 'reward_model:path/to/model'"
        )
    fn = RewardModel(
        path,
        device=cfg.reward_model_device,
        dtype=cfg.reward_model_dtype,
        batch_size=cfg.reward_model_batch_size,
        tokenizer=tokenizer,
    )
    return fn.__name__, fn
