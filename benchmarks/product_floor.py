"""How close to the roofline the matrix products alone can bring a bf16 step (CPU).

    python benchmarks/product_floor.py                 # Gemma-3-270M, vs_trl's work, bf16
    python benchmarks/product_floor.py --model tiny    # about a minute

benchmarks/vs_trl.py reports each phase as a multiple of its roofline (the
matmul peak for the update, the memory bandwidth for decoding). This script
asks how much of that multiple the products themselves account for: whatever
else a phase does (norms, attention, casts, sampling, the optimizer), it
cannot be faster than its products.

In one process, on vs_trl's work (4 prompts x 4 completions, bf16 autocast,
grpo's trainer built by vs_trl.grpo_trainer), after a warm-up step:

- the phases as measured: `--steps` steps of collect_batch and update;
- the update's products: every matrix product one update runs (aten's mm, addmm,
  bmm and baddbmm, and oneDNN's linear), recorded with their shapes, strides and dtypes by a dispatch
  mode around one update; "in place" is their time inside that update,
  "replayed" the same products run again one shape at a time on fresh tensors
  (best of `--repeats`), so with their operands' layout but no other work
  around them;
- a decoding step's products: the 4 x layers + 1 packed bf16 products of
  grpo.cpu.fused_decoding.FusedDecoder for the batch's 16 rows, run back to back as
  a step runs them (median of 20 steps), against the bytes of the weights they
  read at the measured bandwidth (the key/value cache is not counted, so the
  products' multiple is a lower bound for the whole step's).

The roofline is vs_trl's (vs_trl.step_roofline, measure_peak_flops,
measure_bandwidth), measured in the same process before and after, best kept.
Results go to benchmarks/results/product_floor-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import vs_trl

# the products a step can run: aten's (matmul's, F.linear's, torch.mm's with and without out=) and
# oneDNN's linear (grpo.cpu.kernels), by op name -> (index of the [.., k] input, of the second operand)
PRODUCTS = {
    "aten.mm.default": (0, 1),
    "aten.mm.out": (0, 1),
    "aten.addmm.default": (1, 2),
    "aten.addmm.out": (1, 2),
    "aten.bmm.default": (0, 1),
    "aten.bmm.out": (0, 1),
    "aten.baddbmm.default": (1, 2),
    "mkldnn._linear_pointwise.default": (0, 1),
}


def _flops(name: str, args: tuple) -> float:
    """2 x rows x k x n of one recorded product, from its arguments' shapes (_meta)."""
    i, j = PRODUCTS[name]
    a, b = args[i][1], args[j][1]
    if name.startswith("mkldnn"):  # x [..., k] @ weight [n, k].T
        rows = 1
        for d in a[:-1]:
            rows *= d
        return 2.0 * rows * a[-1] * b[0]
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _meta(value):
    """A hashable description of an argument: a tensor's layout, or the value itself."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_meta(v) for v in value))
    return ("value", value)


def _build(meta):
    """An argument like the recorded one: a fresh tensor of the same layout (random values)."""
    import torch

    kind = meta[0]
    if kind == "tensor":
        return torch.empty_strided(meta[1], meta[2], dtype=meta[3]).normal_()
    if kind == "list":
        return [_build(m) for m in meta[1]]
    return meta[1]


def record_products(run):
    """{(op name, argument metas, keyword argument metas): [count, seconds in place]} of the products
    `run()` computes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found: dict = {}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = f"{func.namespace}.{func.__name__}"
            if name not in PRODUCTS:
                return func(*args, **kwargs)
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            seconds = time.perf_counter() - t0
            key = (
                name,
                tuple(_meta(a) for a in args),
                tuple((k, _meta(v)) for k, v in sorted(kwargs.items())),
            )
            entry = found.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
            return out

    with Recorder():
        run()
    return found


def replay(key, repeats: int) -> float:
    """Best-of-`repeats` seconds of one recorded product, on fresh tensors of its layout."""
    import torch

    name, arg_metas, kwarg_metas = key
    namespace, op, overload = name.split(".")
    func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    args = [_build(m) for m in arg_metas]
    kwargs = {k: _build(m) for k, m in kwarg_metas}
    func(*args, **kwargs)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        func(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return best


def decode_products(trainer, rows: int, length: int, steps: int = 20) -> float:
    """Median seconds of one decoding step's products alone (FusedDecoder's packed bf16 weights)."""
    import torch

    from grpo.cpu.fused_decoding import FusedDecoder

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = FusedDecoder(trainer.model, rows, length)
        config = trainer.model.config
        hidden, attention = config.hidden_size, decoder.heads * decoder.head_dim
        products, widths = [], []
        for layer in decoder.layers:
            products += [layer.qkv, layer.o, layer.gate_up, layer.down]
            widths += [hidden, attention, hidden, config.intermediate_size]
        products.append(decoder.head)
        widths.append(hidden)
        inputs = [torch.randn(rows, w).to(torch.bfloat16) for w in widths]
        times = []
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            for product, x in zip(products, inputs):
                product(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="gemma-3-270m",
        help="gemma-3-270m (embedded), tiny, or a save_pretrained directory",
    )
    ap.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up step)")
    ap.add_argument(
        "--repeats", type=int, default=5, help="best-of for the limits and the replayed products"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be >= 1")
    import torch

    from grpo.cpu import kernels

    if not kernels.packing_available():
        print(
            "error: this measures grpo's packed bf16 CPU products; oneDNN bf16 packing is not available here",
            file=sys.stderr,
        )
        return 2
    threads = torch.get_num_threads()
    bench_args = vs_trl.parse_args(["--model", args.model])
    with tempfile.TemporaryDirectory(prefix="product_floor-") as tmp:
        model_dir, label = vs_trl.prepare_model(args.model, Path(tmp))
        spec = dict(
            vs_trl.base_spec(bench_args, model_dir, label, threads, "cpu"),
            precision="bf16",
            lora_r=0,
            warmup=1,
            steps=args.steps + 2,
        )
        limits = [vs_trl.measure_limits(("bf16",), "cpu", 2048, args.repeats)["bf16"]]
        trainer = vs_trl.grpo_trainer(spec, Path(tmp) / "run")
        shape = vs_trl.model_shape(trainer.model)
        generate_s, update_s = [], []
        for i in range(args.steps + 1):
            t0 = time.perf_counter()
            batch = trainer.collect_batch()
            t1 = time.perf_counter()
            trainer.update(batch)
            t2 = time.perf_counter()
            if i:  # the first is the warm-up
                generate_s.append(t1 - t0)
                update_s.append(t2 - t1)
        batch = trainer.collect_batch()
        found = record_products(lambda: trainer.update(batch))
        ro = batch.rollout
        prompt_lengths, completion_lengths = (
            ro.prompt_mask.sum(-1).tolist(),
            ro.completion_mask.sum(-1).tolist(),
        )
        rows, length = len(prompt_lengths), max(prompt_lengths) + max(completion_lengths) + 1
        replayed = {key: replay(key, args.repeats) for key in found}
        decode_s = decode_products(trainer, rows, length)
        limits.append(
            vs_trl.measure_limits(("bf16",), "cpu", 2048, max(1, args.repeats // 2))["bf16"]
        )
    peak, kernel, _ = max(limits, key=lambda m: m[0])
    bandwidth = max(m[2] for m in limits)
    roof_generate, roof_update = vs_trl.step_roofline(
        shape, prompt_lengths, completion_lengths, 2, peak, bandwidth
    )
    weight_bytes = vs_trl.decode_bytes(shape, [], 2)
    steps_decoded = max(completion_lengths) - 1
    product_flops = sum(n * _flops(key[0], key[1]) for key, (n, _) in found.items())
    in_place_s = sum(s for _, s in found.values())
    replayed_s = sum(found[key][0] * s for key, s in replayed.items())
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": vs_trl.machine_info("cpu", threads),
        "peak_flops": peak,
        "peak_kernel": kernel,
        "bandwidth": bandwidth,
        "shape": shape,
        "prompt_lengths": prompt_lengths,
        "completion_lengths": completion_lengths,
        "generate_s": generate_s,
        "update_s": update_s,
        "roofline": {"generate_s": roof_generate, "update_s": roof_update},
        "update_products": {
            "count": sum(n for n, _ in found.values()),
            "shapes": len(found),
            "gflop": product_flops / 1e9,
            "in_place_s": in_place_s,
            "replayed_s": replayed_s,
        },
        "decode_products": {
            "step_s": decode_s,
            "weight_bytes": weight_bytes,
            "steps": steps_decoded,
        },
    }
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).parent / "results" / f"product_floor-{label}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"written {out}")
    return 0


def report(r: dict) -> str:
    m = r["machine"]
    roof = r["roofline"]
    up, dp = r["update_products"], r["decode_products"]
    gen, upd = statistics.median(r["generate_s"]), statistics.median(r["update_s"])
    step_roof = dp["weight_bytes"] / r["bandwidth"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} threads, torch {m['torch']}; bf16 peak "
        f"{r['peak_flops'] / 1e9:.0f} GFLOP/s ({r['peak_kernel']}), bandwidth {r['bandwidth'] / 1e9:.1f} GB/s",
        "",
        "| | seconds | x roofline |",
        "|---|--:|--:|",
        f"| update, measured (median of {len(r['update_s'])}) | {upd:.2f} | {upd / roof['update_s']:.2f} |",
        f"| update's {up['count']} products ({up['shapes']} shapes, {up['gflop']:.0f} GFLOP) in place "
        f"| {up['in_place_s']:.2f} | {up['in_place_s'] / roof['update_s']:.2f} |",
        f"| the same products replayed alone | {up['replayed_s']:.2f} | {up['replayed_s'] / roof['update_s']:.2f} |",
        f"| generation, measured (median of {len(r['generate_s'])}) | {gen:.2f} | {gen / roof['generate_s']:.2f} |",
        f"| one decoding step's products alone, x {dp['steps']} steps | {dp['step_s'] * dp['steps']:.2f} "
        f"| {dp['step_s'] / step_roof:.2f} (of the weights' bytes) |",
        "",
        f"update roofline {roof['update_s']:.2f} s (its FLOPs at the peak; the products replayed run at "
        f"{up['gflop'] / up['replayed_s']:.0f} GFLOP/s); generation roofline {roof['generate_s']:.2f} s; "
        f"a decoding step's weights, {dp['weight_bytes'] / 1e6:.0f} MB, take {1e3 * step_roof:.1f} ms at the "
        f"bandwidth, their products {1e3 * dp['step_s']:.1f} ms",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
