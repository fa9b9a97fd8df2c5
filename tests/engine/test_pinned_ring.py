"""The pinned ring's runs: a payload's tensors gathered into host copies of up to one buffer each
(`node.engine.pinned_ring.runs`, on any machine), and on a GPU `PinnedRing.copy_many` landing every
tensor's bytes where `copy` would (skipped without CUDA)."""

import random

import pytest
import torch

from node.engine.pinned_ring import runs


def covered(spans, out, chunk, gap):
    """Every byte of every span in exactly one segment, each segment inside its run, runs within `chunk`."""
    seen = {j: [] for j in range(len(spans))}
    for lo, hi, segments in out:
        assert 0 < hi - lo <= chunk
        for j, at, offset, n in segments:
            assert n > 0 and 0 <= offset and offset + n <= hi - lo
            assert spans[j][0] + at == lo + offset  # the segment's bytes are the run's bytes at that offset
            seen[j].append((at, n))
    for j, (start, length) in enumerate(spans):
        parts = sorted(seen[j])
        assert sum(n for _, n in parts) == length
        assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))  # no byte twice, none missed
    return True


def test_back_to_back_tensors_go_in_runs_of_one_buffer_and_a_long_one_continues_in_the_next():
    spans = [(0, 3), (3, 5), (8, 30), (38, 2)]
    out = runs(spans, chunk=16, gap=0)
    assert covered(spans, out, 16, 0)
    assert [(lo, hi) for lo, hi, _ in out] == [(0, 16), (16, 32), (32, 40)]
    assert out[0][2] == [(0, 0, 0, 3), (1, 0, 3, 5), (2, 0, 8, 8)]  # the 30-byte span starts in the first run


def test_a_gap_wider_than_allowed_starts_a_run_and_a_narrow_one_is_copied_along():
    spans = [(100, 4), (0, 4), (6, 4)]  # out of address order, as a plan's names may be
    out = runs(spans, chunk=64, gap=2)
    assert covered(spans, out, 64, 2)
    assert [(lo, hi) for lo, hi, _ in out] == [(0, 10), (100, 104)]


def test_random_layouts_are_covered_exactly():
    rng = random.Random(0)
    for _ in range(200):
        spans, at = [], 0
        for _ in range(rng.randint(0, 30)):
            at += rng.choice([0, 0, 1, 7, 100])
            n = rng.choice([0, 1, 5, 64, 200])
            spans.append((at, n))
            at += n
        rng.shuffle(spans)
        chunk, gap = rng.choice([16, 64, 256]), rng.choice([0, 8, 1000])
        assert covered(spans, runs(spans, chunk, gap), chunk, gap)
    assert runs([], 64) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_copy_many_lands_every_tensor_as_copy_does(monkeypatch):
    from node.engine import pinned_ring

    monkeypatch.setattr(pinned_ring, "CHUNK_BYTES", 1 << 12)  # many runs, tensors split across them
    g = torch.Generator().manual_seed(0)
    root = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    pairs, at = [], 0
    for i, n in enumerate([7, 4096, 300, 9000, 2, 12_000, 64]):
        at += 2 * (i % 3)  # small gaps between some of them (bf16 views start on even bytes)
        src = root[at : at + 2 * n].view(torch.bfloat16)
        pairs.append((src, torch.empty(n, dtype=torch.bfloat16, device="cuda")))
        at += 2 * n
    strided = torch.arange(20, dtype=torch.float32)[::2]  # not a payload view: goes through `copy`
    pairs.append((strided, torch.empty(10, device="cuda")))
    ring = pinned_ring.PinnedRing(torch.device("cuda"))
    stream = torch.cuda.Stream()
    pinned_ring.settle(ring.copy_many(pairs, stream))
    stream.synchronize()
    for src, dst in pairs:
        assert torch.equal(dst.cpu(), src)
