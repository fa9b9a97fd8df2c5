"""Ring attention over 3 CPU ranks (gloo) equals one process's causal SDPA on the whole sequence:
outputs and the gradients of queries, keys and values (GQA: 4 query heads, 2 K/V heads). Three
ranks, so K/V blocks and their gradient accumulators make more than one hop round the ring.

Run by torchrun, this file is also the world the test drives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def world_main(out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from node.rl.parallel.context import ring_attention, sequence_slice

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 2, 4, 2, 21, 16
    q, k, v = (torch.randn(b, heads, t, d, generator=g, dtype=torch.float64) for heads in (h, hkv, hkv))
    grad = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    ref.backward(grad)
    cols = sequence_slice(t, rank, n)
    ql, kl, vl = (x[:, :, cols].clone().requires_grad_(True) for x in (q, k, v))
    mine = ring_attention(ql, kl, vl, dist.group.WORLD)
    mine.backward(grad[:, :, cols])

    def err(a, b_):
        return float((a - b_).abs().max() / b_.abs().max())

    errors = {"out": err(mine.detach(), ref.detach()[:, :, cols]), "dq": err(ql.grad, qr.grad[:, :, cols]),
              "dk": err(kl.grad, kr.grad[:, :, cols]), "dv": err(vl.grad, vr.grad[:, :, cols])}
    box = [None] * n
    dist.all_gather_object(box, errors)
    if rank == 0:
        Path(out).write_text(json.dumps(box))
    dist.barrier()
    dist.destroy_process_group()


def test_ring_attention_on_three_ranks_equals_causal_sdpa(tmp_path):
    out = tmp_path / "ring.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", __file__, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 3
    for row in rows:
        assert max(row.values()) < 1e-10, rows  # float64: any wrong block or hop shows as O(1)


if __name__ == "__main__":
    world_main(sys.argv[1])
