"""benchmarks/product_floor.py: the dispatch-mode recorder finds every kind of matrix product a
step runs, counts its FLOPs right, and replays it; and the script runs end to end (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo.cpu import kernels

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import product_floor  # noqa: E402


def test_recorder_finds_each_kind_of_product_and_its_flops():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    w, bias = torch.randn(4, 16), torch.randn(4)
    batched = torch.randn(3, 8, 16), torch.randn(3, 16, 4)
    out = torch.empty(8, 4)

    def work():
        torch.mm(a, b)  # mm
        F.linear(a, w, bias)  # addmm
        torch.matmul(a, b, out=out)  # mm, out=
        torch.bmm(*batched)  # bmm
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.linear(a, w)  # a bf16 mm under autocast
        a.relu()  # not a product: not recorded
        # the same product with a transposed operand: its own entry
        return torch.mm(a, b.t().contiguous().t())

    expected = 2 * 8 * 16 * 4 * (1 + 1 + 1 + 3 + 1 + 1)
    found = product_floor.record_products(work)
    if (
        kernels.onednn_available()
    ):  # grpo's oneDNN product (as the CPU kernels and the logprob tiles use it)
        found_onednn = product_floor.record_products(lambda: kernels.linear_nt(a, w))
        assert [k[0] for k in found_onednn] == ["mkldnn._linear_pointwise.default"]
        assert sum(product_floor._flops(k[0], k[1]) for k in found_onednn) == 2 * 8 * 16 * 4
    names = sorted(k[0] for k in found)
    assert names == [
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.mm.default",
        "aten.mm.default",
        "aten.mm.default",
        "aten.mm.out",
    ]
    assert sum(n for n, _ in found.values()) == 6
    assert sum(n * product_floor._flops(k[0], k[1]) for k, (n, _) in found.items()) == expected
    assert any(m[0] == "tensor" and m[3] == torch.bfloat16 for k in found for m in k[1])
    for key in found:
        assert product_floor.replay(key, repeats=2) > 0


@pytest.mark.slow
def test_product_floor_runs_on_the_tiny_model(tmp_path):
    out = tmp_path / "floor.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "product_floor.py"),
        "--model",
        "tiny",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if "oneDNN bf16 packing is not available" in proc.stderr:
        pytest.skip("no oneDNN bf16 packing on this CPU")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "products replayed alone" in proc.stdout
    r = json.loads(out.read_text())
    shape, tokens = r["shape"], sum(r["completion_lengths"])
    # the output layer's forward, its two gradient products and the backward's recomputed logits
    assert (
        r["update_products"]["gflop"] * 1e9
        >= 4 * 2 * tokens * shape["hidden_size"] * shape["vocab_size"]
    )
    assert r["update_products"]["in_place_s"] > 0 and r["update_products"]["replayed_s"] > 0
    assert r["decode_products"]["step_s"] > 0 and r["decode_products"]["weight_bytes"] > 0
