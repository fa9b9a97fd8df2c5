"""The recomputation's rows, taken for all sequences of a prefill in one gather, are the rows each sequence's own
slice of the batch's outputs gave (`node.replay._rows`, `TorchReference.prefill`)."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.model.batching import GROUP_OVERHEAD_TOKENS, padded_groups  # noqa: E402
from node.replay import _rows  # noqa: E402


def test_rows_of_every_batch_row_gathered_at_once_are_each_rows_slice():
    rng = random.Random(0)
    for _ in range(50):
        b, t = rng.randrange(1, 9), rng.randrange(1, 30)
        x = torch.randn(b, t, rng.choice([1, 5, 88])).to(rng.choice([torch.float32, torch.bfloat16]))
        starts = [rng.randrange(0, t + 1) for _ in range(b)]
        ends = [rng.randrange(s, t + 1) for s in starts]  # empty ranges too
        want = torch.cat([x[row, s:e] for row, (s, e) in enumerate(zip(starts, ends))])
        got = _rows(x, starts, ends)
        assert got.dtype == x.dtype and torch.equal(got, want)


@pytest.mark.parametrize("on_device", [False, True])
def test_prefill_hands_each_sequence_the_rows_of_its_own_slice_of_the_batch_forward(on_device):
    model = R.tiny_model(dtype=torch.bfloat16)
    ref = R.reference({0: model})
    ref.on_device = on_device  # a GPU validator's path (one gather for all members), run on the host's tensors
    rng = random.Random(1)
    seqs = [[rng.randrange(R.TOK.vocab_size) for _ in range(rng.randrange(2, 40))] for _ in range(12)]
    starts = [rng.randrange(0, len(s)) for s in seqs]
    forwards: list[tuple[torch.Tensor, object]] = []
    handle = model.register_forward_hook(lambda _m, args, kwargs, out: forwards.append((kwargs["logits_at"], out)),
                                         with_kwargs=True)
    try:
        outs = ref.prefill(0, seqs, logits_from=starts)
    finally:
        handle.remove()
    groups = padded_groups([len(s) for s in seqs], ref.batch_tokens, GROUP_OVERHEAD_TOKENS)
    assert len(groups) == len(forwards)
    for members, (base, res) in zip(groups, forwards):
        for row, i in enumerate(members):  # the rule before the gather: each sequence's slice, copied
            logits, hidden = outs[i]
            # a GPU validator keeps the logits in the model's dtype (the replay reads them as float32, exactly)
            assert logits.dtype == (torch.bfloat16 if on_device else torch.float32) and hidden.dtype == torch.bfloat16
            assert torch.equal(logits.float(), res.logits[row, starts[i] - base : len(seqs[i]) - base].float())
            assert torch.equal(hidden, res.hidden[row, : len(seqs[i])])
