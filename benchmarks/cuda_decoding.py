"""The hf engine's decoding on CUDA, both ways, on one rollout of a random model of a real shape:
`rollout.cuda_decoding: eager` (the engine's own loop, transformers' modules under bf16 autocast)
and `graphs` (grpo.cuda: the fixed-shape loop from a bf16 copy, its token step one replayed CUDA
graph, after the self-check). Every completion runs to full length, so both decode the same
number of tokens. It prints, and writes with --result, each way's seconds per rollout (the median
of --repeats after one warm-up rollout, which for graphs includes the capture), the capture's
first rollout, the peak CUDA memory, and two token checks: the graphs' tokens against the same
fixed-shape loop run eagerly from the same copy (a replay runs the eager step's kernels: equal,
unless a kernel's last bits differ between the two and a draw lands on them), and how many tokens
of the eager engine's they share before the first difference (bf16 rounding parts them).

    python benchmarks/cuda_decoding.py                      # on a GPU: Qwen2.5-1.5B shape, 16 x 8 x 256
    python benchmarks/cuda_decoding.py --device cpu --shape qwen-tiny --prompts 2 --generations 4 \\
        --completion-length 16                              # a dry run: the loop eagerly, no graph

On the CPU there is no CUDA graph: the `graphs` side is the fixed-shape loop run eagerly (its
self-check compares it with itself), which checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from random_model import SHAPES, random_model  # noqa: E402

from grpo.cuda.fixed_shape import decode_eagerly  # noqa: E402
from grpo.cuda.graphs import GraphedDecoding  # noqa: E402
from grpo.rollout import SamplingParams, generate  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats + 1):  # the first is the warm-up (the capture, for graphs)
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, out


def _shared_prefix(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean share of each row's tokens that agree before the rows' first difference."""
    same = (a == b).long().cumprod(-1).sum(-1).float()
    return float((same / a.shape[1]).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--completion-length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--result", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    model, _ = random_model(args.shape, 0, args.device)  # float32 master weights, as training
    gen = torch.Generator().manual_seed(0)
    low = 4 + 95  # after the special tokens and the printable characters: placeholder ids
    prompts = [
        torch.randint(low, model.config.vocab_size, (args.prompt_length,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    seeds = list(range(args.prompts))
    params = SamplingParams(args.completion_length, temperature=1.0, ignore_eos=True)
    kwargs = dict(eos_token_ids=[2], pad_token_id=0, seeds=seeds)
    bf16 = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    graphs = GraphedDecoding("graphs", **({} if bf16 else {"capture": lambda step: step}))

    def eager():
        with torch.no_grad(), autocast:
            return generate(model, prompts, args.generations, params, **kwargs)

    def graphed():
        with torch.no_grad(), autocast:
            return graphs.generate(model, prompts, args.generations, params, **kwargs)

    result = {
        "shape": args.shape,
        "device": args.device,
        "prompts": args.prompts,
        "generations": args.generations,
        "prompt_length": args.prompt_length,
        "completion_length": args.completion_length,
        "graphs_captured": bf16,
    }
    for name, fn in (("eager", eager), ("graphs", graphed)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, out = _timed(fn, device, args.repeats)
        result[name] = {
            "first_s": times[0],
            "median_s": statistics.median(times[1:]),
            "tokens_per_s": out.completion_mask.sum().item() / statistics.median(times[1:]),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30
            if device.type == "cuda"
            else None,
        }
        result[name + "_tokens"] = out.completion_ids
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        twin = decode_eagerly(
            graphs.weights.model, prompts, args.generations, params, bucket=graphs.bucket, **kwargs
        )
    ours, theirs = result.pop("graphs_tokens"), result.pop("eager_tokens")
    result["graphs_equal_their_eager_twin"] = bool(torch.equal(ours, twin.completion_ids))
    result["share_of_eager_tokens_before_first_difference"] = _shared_prefix(ours, theirs)
    result["eager_over_graphs"] = result["eager"]["median_s"] / result["graphs"]["median_s"]
    result["fallback"] = graphs.fallback
    print(
        f"== cuda_decoding: {args.shape} shape on {args.device}, {args.prompts} x "
        f"{args.generations} x {args.completion_length} tokens (prompts of {args.prompt_length})"
    )
    for name in ("eager", "graphs"):
        r = result[name]
        peak = f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""
        print(
            f"   {name:6s}: {r['median_s']:.3f} s/rollout ({r['tokens_per_s']:.0f} tokens/s), "
            f"first {r['first_s']:.3f} s{peak}"
        )
    print(
        f"   eager / graphs: {result['eager_over_graphs']:.2f}; graphs equal their eager twin: "
        f"{result['graphs_equal_their_eager_twin']}; tokens shared with eager before the first "
        f"difference: {result['share_of_eager_tokens_before_first_difference']:.0%}"
    )
    if args.result:
        args.result.write_text(json.dumps(result, indent=1))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
