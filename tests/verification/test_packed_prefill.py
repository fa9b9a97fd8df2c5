"""Packed recomputation (node/model/packed.py): sequences end to end in one row, each attending to itself only,
give what each sequence gives alone, and the validator's prefill hands every claim the rows the padded batch did."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

import node.replay as replay_mod  # noqa: E402
from node.model.packed import Packed  # noqa: E402


def test_a_packed_forward_is_each_sequence_alone():
    model = R.tiny_model()
    rng = random.Random(2)
    seqs = [torch.tensor([rng.randrange(R.TOK.vocab_size) for _ in range(n)]) for n in (7, 1, 23, 4)]
    packed = Packed.of([len(s) for s in seqs], "cpu")
    assert packed.cu_seqlens.tolist() == [0, 7, 8, 31, 35] and packed.max_len == 23
    assert packed.positions("cpu")[0, 6:10].tolist() == [6, 0, 0, 1]
    with torch.no_grad():
        out = model(torch.cat(seqs)[None], packed=packed)
        start = 0
        for s in seqs:
            alone = model(s[None])
            rows = slice(start, start + len(s))
            assert torch.allclose(out.logits[0, rows], alone.logits[0], atol=1e-5)
            assert torch.equal(out.routed_experts[0, rows], alone.routed_experts[0])
            start += len(s)
        with pytest.raises(ValueError, match="35 tokens in one row"):
            model(torch.cat(seqs)[None, :30], packed=packed)
    with pytest.raises(ValueError, match="one token each"):
        Packed.of([3, 0], "cpu")


def test_packed_groups_keep_order_and_bound_their_tokens():
    from node.model.batching import packed_groups

    assert packed_groups([5, 3, 9, 2, 2, 30, 1], 10) == [[0, 1], [2], [3, 4], [5], [6]]
    assert packed_groups([], 10) == []


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_packed_prefill_hands_each_claim_the_padded_prefills_rows(device, monkeypatch):
    """`TorchReference.prefill` packed (a GPU's way; on the CPU forced, its attention a loop over sequences) against
    the same claims padded into rectangles (`PRIMERL_JUDGE_PACKED=0`): the same rows of logits from each claim's
    first judged position, hidden states, replayed routes and router logits, within the dtype's rounding."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = R.tiny_model(dtype=dtype).to(device)
    ref = R.reference({0: model})
    if device == "cpu":
        assert not replay_mod.packing(ref.device, ref.param_dtype)  # the CPU pads unless told
    rng = random.Random(3)
    seqs = [[rng.randrange(R.TOK.vocab_size) for _ in range(rng.randrange(1, R.MAX_SEQ))] for _ in range(13)]
    starts = [rng.randrange(0, len(s) + 1) for s in seqs]
    monkeypatch.setenv("PRIMERL_JUDGE_PACKED", "0")
    padded = ref.prefill(0, seqs, with_routes=True, logits_from=starts)
    replay = [r[2] for r in padded]
    padded = ref.prefill(0, seqs, with_routes=True, with_router_logits=True, logits_from=starts, replay=replay)
    monkeypatch.delenv("PRIMERL_JUDGE_PACKED")
    if device == "cpu":
        monkeypatch.setattr(replay_mod, "packing", lambda *_: True)
    ref.batch_tokens, ref.packed_tokens = 10, 200  # several packed groups, of the packed size
    forwards: list = []
    handle = model.register_forward_hook(lambda _m, args, kwargs, out: forwards.append(kwargs.get("packed")),
                                         with_kwargs=True)
    try:
        packed = ref.prefill(0, seqs, with_routes=True, with_router_logits=True, logits_from=starts, replay=replay)
    finally:
        handle.remove()
    if device == "cuda":  # the variable-length flash kernel ran (a failure would pad from then on, logged)
        from node.model.packed import varlen_status

        assert varlen_status()["failed"] is None and varlen_status()["gqa_native"] is not None
    assert len(forwards) >= 2 and all(p is not None and (p.tokens <= 200 or len(p.lengths) == 1) for p in forwards)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for i, (a, b) in enumerate(zip(padded, packed)):
        assert a[0].shape == b[0].shape == (len(seqs[i]) - starts[i], R.TOK.vocab_size), i
        assert torch.allclose(a[0].float(), b[0].float(), atol=tol, rtol=tol), (i, (a[0].float() - b[0].float()).abs().max())
        assert torch.allclose(a[1].float(), b[1].float(), atol=tol, rtol=tol)
        assert torch.equal(a[2], b[2]) and torch.equal(b[2], replay[i])
        assert torch.allclose(a[3].float().cpu(), b[3].float().cpu(), atol=tol, rtol=tol)
