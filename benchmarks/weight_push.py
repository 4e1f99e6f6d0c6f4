"""A weight push to `grpo serve` against a plain torch.distributed gloo broadcast of the same tensors.

    python benchmarks/weight_push.py                       # a 8-layer, 512-wide tiny Llama (about 100 MB)
    python benchmarks/weight_push.py --hidden 1024 --layers 8 --rounds 5

The push: `grpo serve CONFIG --engine hf` in its own process, the policy built as a trainer builds
it, `rollout.engine: server`'s `sync_weights` timed (announce, start, buckets over the engine's
gloo group, finish: what `time/weight_sync` measures in a run). The peer: two processes in a gloo
process group (`init_process_group`), rank 0 broadcasting each tensor of the same list in turn,
rank 1 receiving into preallocated tensors. Both move the same bytes between two processes of
this machine over TCP on 127.0.0.1; medians over --rounds rounds after one warm-up round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import served  # noqa: E402  (the benchmarks' grpo serve)

KEY = "benchmark-secret"


def _config(directory: Path, hidden: int, layers: int, port: int, bucket_mb: int) -> Path:
    from grpo.config import loading

    cfg = loading.from_dict(
        {
            "output_dir": str(directory / "run"),
            "model": {"name": "tiny", "tiny_hidden_size": hidden, "tiny_num_layers": layers},
            "rollout": {"engine": "server", "server": {"bucket_mb": bucket_mb}},
        },
        [f"rollout.server.url=http://127.0.0.1:{port}"] if port else [],
    )
    path = directory / "config.yaml"
    loading.save(cfg, path)
    return path


def _policy(cfg):
    from grpo.backends.single import SingleProcess
    from grpo.models.loading import load_model_and_tokenizer

    backend = SingleProcess(cfg)
    model, tokenizer = load_model_and_tokenizer(cfg.model, backend.device)
    return backend.prepare_model(model), tokenizer


def measure_push(hidden: int, layers: int, rounds: int, bucket_mb: int) -> dict:
    from grpo.config import loading
    from grpo.rollout.server import ServerEngine, weights_checksum
    from grpo.rollout.server_http import HTTPClient

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GRPO_SERVE_API_KEY": KEY}
        with served(_config(Path(tmp), hidden, layers, 0, bucket_mb), [], env) as url:
            port = url.rsplit(":", 1)[1]
            os.environ["GRPO_SERVE_API_KEY"] = KEY
            cfg = loading.load(_config(Path(tmp), hidden, layers, int(port), bucket_mb))
            model, tokenizer = _policy(cfg)
            engine = ServerEngine(model, tokenizer, cfg)  # builds the group, pushes once (warm-up)
            seconds, size = [], 0
            for _ in range(rounds):
                start = time.perf_counter()
                engine.sync_weights(model)
                seconds.append(time.perf_counter() - start)
                size = engine.take_metrics()["weight_sync/bytes"]
            answer = HTTPClient(url, KEY).call(
                "GET", "/weights_checksum", timeout=600, key="benchmark"
            )
            assert answer["digest"] == weights_checksum(model)["digest"], "push not bitwise"
    return {"bytes": size, "seconds": seconds, "tensors": len(engine.metas)}


def _receiver(port: int, shapes: list, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=1,
        world_size=2,
        timeout=datetime.timedelta(minutes=10),
    )
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in shapes]
    for _ in range(rounds + 1):
        dist.barrier()
        for tensor in tensors:
            dist.broadcast(tensor, 0)
    dist.destroy_process_group()


def measure_plain(hidden: int, layers: int, rounds: int) -> dict:
    import socket

    import torch.distributed as dist

    from grpo.config import loading
    from grpo.rollout.vllm import policy_weights

    with tempfile.TemporaryDirectory() as tmp:
        cfg = loading.load(_config(Path(tmp), hidden, layers, 0, 64))
    model, _ = _policy(cfg)
    tensors = [t.detach().contiguous() for _, t in policy_weights(model)]
    shapes = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    child = multiprocessing.get_context("spawn").Process(
        target=_receiver, args=(port, shapes, rounds)
    )
    child.start()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=2,
        timeout=datetime.timedelta(minutes=10),
    )
    seconds = []
    for round_ in range(rounds + 1):
        dist.barrier()
        start = time.perf_counter()
        for tensor in tensors:
            dist.broadcast(tensor, 0)
        if round_:  # the first round warms the connections up
            seconds.append(time.perf_counter() - start)
    dist.destroy_process_group()
    child.join()
    size = sum(t.numel() * t.element_size() for t in tensors)
    return {"bytes": size, "seconds": seconds, "tensors": len(tensors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--out", help="write the numbers as JSON here too")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    push = measure_push(args.hidden, args.layers, args.rounds, args.bucket_mb)
    plain = measure_plain(args.hidden, args.layers, args.rounds)
    rows = []
    for name, result in (("grpo serve push", push), ("plain gloo broadcast", plain)):
        median = statistics.median(result["seconds"])
        result["median_s"], result["bytes_per_s"] = median, result["bytes"] / median
        rows.append((name, result))
    print(
        f"{push['bytes'] / 2**20:.1f} MiB in {push['tensors']} tensors, {args.rounds} rounds each"
    )
    print("| | median s | MB/s | rounds (s) |\n|---|--:|--:|---|")
    for name, r in rows:
        times = ", ".join(f"{s:.3f}" for s in r["seconds"])
        print(f"| {name} | {r['median_s']:.3f} | {r['bytes_per_s'] / 1e6:.0f} | {times} |")
    print(f"push / plain (time): {push['median_s'] / plain['median_s']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"push": push, "plain": plain, "args": vars(args)}))


if __name__ == "__main__":
    main()
