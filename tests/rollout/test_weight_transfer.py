"""Weights streamed through the two-process gloo group arrive bitwise, bucket by bucket as both
sides plan them; a peer that stops answering ends the transfer with an error within the group's
timeout, never a hang; a checksum does not depend on the order the tensors came in."""

import threading
import time

import pytest
import torch

from grpo.rollout import weight_transfer as wt


def test_buckets_are_packed_in_order_and_aligned():
    metas = [
        wt.TensorMeta("a", "uint8", (40,)),
        wt.TensorMeta("b", "uint8", (40,)),
        wt.TensorMeta("c", "uint8", (100,)),
        wt.TensorMeta("d", "float32", (300,)),  # 1200 bytes: larger than a bucket, alone
        wt.TensorMeta("e", "bool", (1,)),
    ]
    buckets = wt.plan_buckets(metas, 128)
    assert [(b.indices, b.offsets, b.size) for b in buckets] == [
        ((0, 1), (0, 64), 104),
        ((2,), (0,), 100),
        ((3,), (0,), 1200),
        ((4,), (0,), 1),
    ]


def _pair(timeout: float):
    """Both ends of a group in this process: (trainer's, server's)."""
    store = wt.open_store("127.0.0.1", 0, timeout)
    joined = {}
    thread = threading.Thread(
        target=lambda: joined.update(
            group=wt.open_group(wt.join_store("127.0.0.1", store.port, timeout), 1, timeout)
        )
    )
    thread.start()
    trainer = wt.open_group(store, 0, timeout)
    thread.join()
    return trainer, joined["group"]


def test_a_push_arrives_bitwise():
    torch.manual_seed(0)
    weights = [
        ("w", torch.randn(7, 5)),
        ("b", torch.randn(3).to(torch.bfloat16)),
        ("flag", torch.tensor([True, False])),
        ("big", torch.randn(100, 10)),  # 4000 bytes: its own bucket
        ("step", torch.tensor(3)),  # a 0-d tensor
    ]
    metas = [wt.TensorMeta.of(n, t) for n, t in weights]
    trainer, server = _pair(10.0)
    got, done = {}, {}

    def receive():
        done["bytes"] = wt.receive(
            server, metas, 512, lambda name, t: got.__setitem__(name, t.clone())
        )

    thread = threading.Thread(target=receive)
    thread.start()
    sent = wt.send(trainer, iter(weights), metas, 512)
    thread.join()
    assert sent == done["bytes"] == sum(m.nbytes for m in metas)
    for name, tensor in weights:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert wt.checksum(weights) == wt.checksum(reversed(weights))
    assert wt.checksum(weights)["digest"] != wt.checksum([("w", weights[0][1] + 1)])["digest"]


def test_a_tensor_other_than_the_announced_one_is_not_sent():
    trainer, _ = _pair(5.0)
    metas = [wt.TensorMeta("w", "float32", (2,))]
    with pytest.raises(ValueError, match="not the tensor announced"):
        wt.send(trainer, iter([("w", torch.zeros(3))]), metas, 1024)


def test_a_silent_peer_ends_the_push_within_the_timeout():
    trainer, _server = _pair(1.0)  # the server never receives
    metas = [wt.TensorMeta("w", "float32", (1 << 16,))]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        wt.send(trainer, iter([("w", torch.zeros(1 << 16))]), metas, 1 << 20)
    assert time.monotonic() - start < 30
