import numpy as np
import pytest
import torch

from protocol.errors import InvalidProof
from verification.poly import P, evaluate, injective_modulus, interpolate
from verification.proof import (PARSE_TOGETHER, PROOF_BYTES, Commitment, VersionRun, build_proofs, chunk_spans,
                                decode_rollout_proof, encode_rollout_proof)


def test_interpolation_passes_through_every_point_and_only_those():
    rng = np.random.default_rng(0)
    x = np.stack([rng.choice(P, 128, replace=False) for _ in range(8)])
    y = rng.integers(0, P, (8, 128))
    coeffs = interpolate(x, y)
    assert (evaluate(coeffs, x) == y).all()
    y2 = y.copy()
    y2[:, 5] = (y2[:, 5] + 1) % P
    assert (evaluate(interpolate(x, y2), x)[:, 5] != y[:, 5]).all()



def test_evaluation_reduced_every_other_step_is_horner_reduced_every_step():
    """`evaluate` reduces every second Horner step; each value equals the plain rule's, in exact integers."""
    rng = np.random.default_rng(1)
    for c, n, m in [(64, 128, 128), (7, 2, 5), (3, 1, 4), (5, 33, 17)]:
        coeffs = rng.integers(0, P, (c, n))
        x = rng.integers(0, P, (c, m))
        coeffs[0], x[0] = P - 1, P - 1  # the largest residues: the largest intermediate values
        want = np.zeros((c, m), dtype=np.int64)
        for j in range(n - 1, -1, -1):  # Horner in int64, reduced at every step
            want = (want * x + coeffs[:, j : j + 1]) % P
        assert (evaluate(coeffs, x) == want).all()
        assert (evaluate(coeffs + P, x - P) == want).all()  # residues of any representative

def test_modulus_is_the_largest_that_keeps_indices_distinct():
    assert injective_modulus(np.array([1, 2, 70000])) == P
    x = np.array([5, 5 + P, 11])  # collide mod P
    m = injective_modulus(x)
    assert m < P and len(set((x % m).tolist())) == 3
    assert all(len(set((x % k).tolist())) < 3 for k in range(m + 1, P + 1))


def test_proof_is_258_bytes_per_chunk_and_chunks_never_straddle_versions():
    h = torch.randn(70, 64)
    versions = [3] * 40 + [4] * 30
    proofs = build_proofs(h, versions)
    assert [(s.version, s.start, s.end) for s, _ in proofs] == [(3, 0, 32), (3, 32, 40), (4, 40, 70)]
    assert all(len(b) == PROOF_BYTES for _, b in proofs)
    assert chunk_spans([1] * 64) == chunk_spans([1] * 64)


def test_wire_proof_round_trips_and_rejects_truncation_and_garbage():
    h = torch.randn(40, 64)
    runs = [VersionRun(0, b"\x01" * 32, 40, [b for _, b in build_proofs(h, [0] * 40)])]
    data = encode_rollout_proof(runs)
    assert decode_rollout_proof(data, 64) == runs
    for bad in (data[:-1], data + b"\0\0", b"XXXX" + data[4:], b"", data[:50]):
        with pytest.raises(InvalidProof):
            decode_rollout_proof(bad, 64)
    with pytest.raises(InvalidProof):
        Commitment.from_bytes(b"\xff\xff" + b"\0" * 256)  # modulus above the field


def test_proofs_are_byte_identical_to_toplocs_and_each_side_verifies_the_other():
    toploc = pytest.importorskip("toploc")
    verify_proofs_bytes = pytest.importorskip("toploc.C.csrc.poly", exc_type=ImportError,
                                              reason="toploc's C++ extension does not load against this torch").verify_proofs_bytes

    from verification.hidden_check import compare_blocks
    from verification.proof import chunk_blocks

    torch.manual_seed(0)
    h = torch.randn(100, 2500)  # 32 x 2500 > 65497: flat indices exceed the field
    hb = h.to(torch.bfloat16)
    ours = build_proofs(h, [0] * 100)
    theirs = toploc.build_proofs_bytes([hb[i] for i in range(100)], 32, 128, skip_prefill=True)
    assert [b for _, b in ours] == theirs
    # toploc checks our proofs (its 2-D tensor path); we check its proofs.
    assert all(r.exp_mismatches == 0 and r.mant_err_mean == 0 for r in verify_proofs_bytes(hb, theirs, 32, 128))
    stats = compare_blocks(chunk_blocks(h, [s for s, _ in ours]), [Commitment.from_bytes(b) for b in theirs])
    assert all(s.exp_mismatches == 0 and s.mant_err_mean == 0 for s in stats)
    # Both see the same error on a 2% change.
    h2 = (h * 1.02).to(torch.bfloat16)
    t = verify_proofs_bytes(h2, theirs, 32, 128)
    o = compare_blocks(chunk_blocks(h2, [s for s, _ in ours]), [Commitment.from_bytes(b) for b in theirs])
    assert [r.mant_err_mean for r in t] == pytest.approx([s.mant_err_mean for s in o], rel=1e-5)
    assert all(s.mant_err_mean > 2 for s in o)


def _parsed(parse):
    try:
        return [(c.modulus, c.coeffs.tolist()) for c in parse()]
    except InvalidProof as exc:
        return str(exc)


def test_chunk_proofs_parsed_together_are_each_parsed_alone_and_fail_on_the_same_first_error():
    rng = np.random.default_rng(2)
    kinds = ["modulus 0", "modulus > P", "coefficient >= P", "short", "odd", "long"]
    together = 0
    for _ in range(400):
        words = int(rng.choice([2, 3, 65, 129]))
        n = int(rng.choice([0, 1, 3, 8, 12]))
        bad = {int(rng.integers(n)): kinds[int(rng.integers(len(kinds)))] for _ in range(int(rng.integers(3)))
               } if n else {}
        chunks = []
        for i in range(n):
            w = rng.integers(0, P, words).astype(">u2")
            w[0] = rng.integers(2, P + 1)
            kind = bad.get(i, "ok")
            if kind == "modulus 0":
                w[0] = 0
            elif kind == "modulus > P":
                w[0] = P + 1
            elif kind == "coefficient >= P":
                w[-1] = P
            data = w.tobytes()
            chunks.append({"short": data[:2], "odd": data + b"\0", "long": data + bytes(2 * 130)}.get(kind, data))
        alone = _parsed(lambda: [Commitment.from_bytes(c) for c in chunks])
        assert _parsed(lambda: Commitment.many_from_bytes(chunks)) == alone
        together += n >= PARSE_TOGETHER and len({len(c) for c in chunks}) == 1 and len(chunks[0]) >= 4
    assert together > 50  # the batched path ran, valid and out of range, not only the fallback


def test_proof_runs_match_the_claimed_versions_exactly_when_spelled_out_token_by_token_they_do():
    from verification.validator import _runs_match

    rng = np.random.default_rng(3)
    for _ in range(500):
        runs = [VersionRun(int(rng.integers(3)), bytes(32), int(rng.integers(1, 5)), [])
                for _ in range(int(rng.integers(0, 3)))]
        versions = [r.version for r in runs for _ in range(r.n_tokens)]
        if rng.random() < 0.5 and versions:  # a version changed, a token added or dropped
            edit = int(rng.integers(3))
            i = int(rng.integers(len(versions)))
            versions = (versions[:i] + [versions[i] + 1] + versions[i + 1:], versions + [versions[-1]],
                        versions[:-1])[edit]
        assert _runs_match(runs, versions) == ([v for r in runs for v in [r.version] * r.n_tokens] == versions)


def test_points_of_blocks_of_many_lengths_brought_back_at_once_are_each_groups_own():
    from verification.proof import topk_points

    def per_group(blocks, topk):  # the rule as first written: two transfers a group of equal lengths
        out, by_len = [None] * len(blocks), {}
        for i, b in enumerate(blocks):
            by_len.setdefault(b.numel(), []).append(i)
        for n, members in by_len.items():
            stack = torch.stack([blocks[i] for i in members])
            idx = stack.abs().topk(min(topk, n), dim=-1).indices
            bits = stack.gather(-1, idx).view(torch.int16).cpu().numpy().astype(np.int64) & 0xFFFF
            for row, i in enumerate(members):
                out[i] = (idx.cpu().numpy()[row].astype(np.int64), bits[row])
        return out

    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        sizes = torch.randint(1, 400, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        blocks = [(torch.randn(n, generator=gen) * 4).round().bfloat16() for n in sizes]  # many ties, both signs
        for (xi, bi), (xw, bw) in zip(topk_points(blocks, 16), per_group(blocks, 16)):
            assert xi.dtype == xw.dtype == bi.dtype == bw.dtype == np.int64
            assert (xi == xw).all() and (bi == bw).all()
    assert topk_points([], 16) == []
