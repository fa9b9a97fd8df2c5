"""The pinned ring (node/engine/pinned_ring.py) on a GPU: tensors of a payload-like host buffer, some larger than
one of its buffers, land byte for byte, also for a ring made for "cuda" without an index (its threads set the
current device), and the ring's threads' seconds come back when the pieces settle. Skipped without CUDA (CI)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")]


def test_a_ring_for_cuda_without_an_index_copies_every_byte(monkeypatch):
    from node.engine import pinned_ring

    monkeypatch.setattr(pinned_ring, "CHUNK_BYTES", 1 << 12)  # tensors larger than a buffer go in pieces
    root = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pairs, at = [], 0
    for n in [7, 4096, 300, 9000, 2, 12_000, 64]:
        src = root[at : at + 2 * n].view(torch.bfloat16)  # random bytes: NaNs among them, so bytes are compared
        pairs.append((src, torch.empty(n, dtype=torch.bfloat16, device="cuda")))
        at += 2 * n
    ring = pinned_ring.PinnedRing(torch.device("cuda"))
    stream = torch.cuda.Stream()
    pieces = []
    for src, dst in pairs:
        pieces += ring.copy(src, dst, stream)
    n_pieces = len(pieces)
    spent = pinned_ring.settle(pieces)
    stream.synchronize()
    assert n_pieces > len(pairs) and not pieces  # some tensors went in several pieces; all settled
    assert spent.host_s > 0 and spent.wait_s >= 0  # the threads' seconds come back with the pieces
    for src, dst in pairs:
        assert torch.equal(dst.cpu().view(torch.uint8), src.view(torch.uint8))


def test_copy_many_lands_every_tensor_byte_for_byte_as_copy_does(monkeypatch):
    """Runs of a payload-like host tensor (small gaps between tensors, tensors split across runs) go through the
    ring's device buffers and one batched copy a run; a source that views no such tensor goes through `copy`."""
    from node.engine import pinned_ring

    monkeypatch.setattr(pinned_ring, "CHUNK_BYTES", 1 << 12)  # many runs, tensors split across them
    root = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    pairs, at = [], 0
    for i, n in enumerate([7, 4096, 300, 9000, 2, 12_000, 64]):
        at += 2 * (i % 3)  # small gaps between some of them
        pairs.append((root[at : at + 2 * n].view(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device="cuda")))
        at += 2 * n
    strided = torch.arange(20, dtype=torch.float32)[::2]  # not a payload view: goes through `copy`
    pairs.append((strided, torch.empty(10, device="cuda")))
    ring = pinned_ring.PinnedRing(torch.device("cuda"))
    stream = torch.cuda.Stream()
    spent = pinned_ring.settle(ring.copy_many(pairs, stream))
    stream.synchronize()
    assert spent.host_s > 0 and ring.dev_bufs is not None
    for src, dst in pairs:
        assert torch.equal(dst.cpu().view(torch.uint8), src.contiguous().view(torch.uint8))
