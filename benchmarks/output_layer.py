"""Time grpo's tiled output layer (grpo.models.logprobs) on its own, forward and backward.

Gemma-3-270M's shape by default (hidden 640, vocabulary 262,144), random weights:

    python benchmarks/output_layer.py --tokens 1024 --precision bf16

Prints, per repeat, the forward and backward wall time, the minor page faults
each caused, and checksums of the results (logp, hidden-state and weight
gradients) so that two versions of the code can be compared for speed and
results in one look. The model FLOPs are 2 x tokens x vocabulary x hidden per
product: one in the forward, three in the backward (recomputed logits, hidden
gradient, weight gradient).

The tiles are computed as a CPU run computes them (grpo.cpu.layer: oneDNN products,
cache-sized tiles, the weight's gradient added in place into its .grad).
`--compiled` runs each tile's element-wise work as compiled kernels
(grpo.cpu.tile_math); the first repeat then includes the compile. `--plain`
computes them as a run without the CPU layer does (cpu.enabled=false: torch's
products, grpo.models.logprobs' default tiles).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from grpo.models import logprobs, tiles


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _kernels(args) -> logprobs.OutputLayerKernels:
    """The output layer's kernels as the backend hands them to the update (weight gradient in place)."""
    if args.plain:
        return logprobs.OutputLayerKernels(weight_grad_in_place=True)
    from grpo.cpu import layer, tile_math

    return logprobs.OutputLayerKernels(
        tile=tile_math.COMPILED if args.compiled else tiles.EAGER,
        product=layer.onednn_product,
        tile_elements=layer.TILE_ELEMENTS,
        weight_grad_in_place=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--repeats", type=int, default=4)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--compiled", action="store_true", help="the tiles' element-wise work as compiled kernels"
    )
    kind.add_argument(
        "--plain", action="store_true", help="plain PyTorch tiles, as without the CPU layer"
    )
    args = parser.parse_args()
    kernels = _kernels(args)

    torch.manual_seed(0)
    layer = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    layer.weight.data.normal_(0, 0.02)
    layer.weight.grad = torch.zeros_like(layer.weight)
    hidden0 = torch.randn(args.tokens, args.hidden)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    upstream = torch.linspace(-1, 1, args.tokens)
    flop = 2 * args.tokens * args.vocab * args.hidden
    print(
        f"{args.tokens} tokens x {args.vocab} x {args.hidden}, {args.precision}: "
        f"{flop / 1e9:.0f} GFLOP per product, {torch.get_num_threads()} threads, "
        f"{'plain' if args.plain else 'compiled' if args.compiled else 'eager'} tiles"
    )
    for _ in range(args.repeats):
        hidden = hidden0.clone().requires_grad_()
        f0, t0 = _faults(), time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            # the weight's gradient accumulates into layer.weight.grad (allocated above) across repeats
            logp, _ = logprobs.token_logprobs_from_hidden(hidden, layer, targets, kernels=kernels)
        f1, t1 = _faults(), time.perf_counter()
        (logp * upstream).sum().backward()
        f2, t2 = _faults(), time.perf_counter()
        print(
            f"forward {t1 - t0:.3f} s ({f1 - f0} faults)  backward {t2 - t1:.3f} s ({f2 - f1} faults)  "
            f"sum logp {logp.sum().item():.4f}  |grad h| {hidden.grad.norm().item():.5f}"
        )


if __name__ == "__main__":
    main()
