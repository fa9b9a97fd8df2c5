"""The pinned ring's runs (`node.engine.pinned_ring.runs`, on any machine): a payload's tensors gathered into
copies of at most one buffer each, every byte of every tensor in exactly one segment. `PinnedRing.copy_many`
sends a staged version through these (tests/engine/test_pinned_ring.py on a GPU)."""

import random

from node.engine.pinned_ring import runs


def covered(spans, out, chunk):
    """Every byte of every span in exactly one segment, each segment inside its run, runs within `chunk`."""
    seen = {j: [] for j in range(len(spans))}
    for lo, hi, segments in out:
        assert 0 < hi - lo <= chunk
        for j, at, offset, n in segments:
            assert n > 0 and 0 <= offset and offset + n <= hi - lo
            assert spans[j][0] + at == lo + offset  # the segment's bytes are the run's bytes at that offset
            seen[j].append((at, n))
    for j, (_, length) in enumerate(spans):
        parts = sorted(seen[j])
        assert sum(n for _, n in parts) == length
        assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))  # no byte twice, none missed
    return True


def test_back_to_back_tensors_go_in_runs_of_one_buffer_and_a_long_one_goes_on_in_the_next():
    spans = [(0, 3), (3, 5), (8, 30), (38, 2)]
    out = runs(spans, chunk=16, gap=0)
    assert covered(spans, out, 16)
    assert [(lo, hi) for lo, hi, _ in out] == [(0, 16), (16, 32), (32, 40)]
    assert out[0][2] == [(0, 0, 0, 3), (1, 0, 3, 5), (2, 0, 8, 8)]  # the 30-byte span starts in the first run


def test_a_gap_wider_than_allowed_starts_a_run_and_a_narrow_one_is_copied_along():
    spans = [(100, 4), (0, 4), (6, 4)]  # out of address order, as a plan's names may be
    out = runs(spans, chunk=64, gap=2)
    assert covered(spans, out, 64)
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
        assert covered(spans, runs(spans, chunk, gap), chunk)
    assert runs([], 64) == []


def test_views_of_a_mapping_go_in_runs_and_a_tensor_of_its_own_goes_at_once():
    import torch

    from node.engine.pinned_ring import shares_storage

    payload = torch.zeros(1 << 12, dtype=torch.uint8)
    assert shares_storage(payload[64:320].view(torch.bfloat16).reshape(8, 16))  # a payload's tensor
    assert not shares_storage(torch.zeros(8, 16, dtype=torch.bfloat16))  # read (cast) at lookup: held alone
    assert not shares_storage(payload[64:320].view(torch.bfloat16).reshape(8, 16)[:, ::2])  # not contiguous
