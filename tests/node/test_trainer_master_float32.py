"""`join --master-float32`: a one-process trainer of a bf16 run keeps its weights (and AdamW's states) in float32
and publishes each version cast to bf16, so version 0 is the run's pinned checkpoint bit for bit and an update
below half a bf16 step is kept in the master instead of being lost."""

from __future__ import annotations

import torch

from node.roles.trainer import TrainerNode, note_master_precision
from node.rl.parallel.publish import publish_trainer_async
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.model_spec import ModelSpec
from shardcast.codec import unflatten
from shardcast.store import Store

KEY = NodeKey.from_seed(b"m" * 32)
SPEC = RunSpec(run_id="master", coordinator=NodeKey.from_seed(b"c" * 32).peer_id, environment="reverse",
               group_size=2, max_off_policy_steps=1, model=ModelSpec(dtype="bfloat16"), recipe={"warmup_target": 0})


def _published(trainer, store: Store, version: int, dtype) -> dict[str, torch.Tensor]:
    signed = publish_trainer_async(trainer, store, KEY, "master", version, None, dtype=dtype).whole.result()
    return unflatten(signed.manifest.tensors, store.payload("master", version))


def test_a_float32_master_publishes_the_runs_bf16_and_keeps_what_a_bf16_master_loses(tmp_path):
    plain = TrainerNode(KEY, SPEC, "", tmp_path / "plain", 0)._resumed_or_warmed_up()
    role = TrainerNode(KEY, SPEC, "", tmp_path / "master", 0, master_float32=True)
    master = role._resumed_or_warmed_up()
    assert role.published == torch.bfloat16 and {p.dtype for p in master.model.parameters()} == {torch.float32}
    assert {p.dtype for p in plain.model.parameters()} == {torch.bfloat16}
    assert note_master_precision(master.model, 1e-6) is None and note_master_precision(plain.model, 1e-6) is not None
    # version 0: the same bytes as the bf16 trainer publishes (the spec's pinned checkpoint)
    ours = _published(master, Store(tmp_path / "s1"), 0, role.published)
    theirs = _published(plain, Store(tmp_path / "s2"), 0, None)
    assert ours.keys() == theirs.keys() and all(ours[k].dtype == theirs[k].dtype for k in ours)
    assert all(torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in ours)
    # updates of a tenth of a bf16 step: lost in the bf16 master, summed in the float32 one
    w32, w16 = master.model.lm_head.weight, plain.model.lm_head.weight
    _, exponent = torch.frexp(w16.float())  # |w| = m 2^e, m in [0.5, 1): bf16 weights there lie 2^(e - 8) apart
    step = torch.where(w16 != 0, torch.ldexp(torch.ones_like(w32), exponent - 8) / 10, 0.0)  # a tenth of that
    with torch.no_grad():
        for _ in range(20):
            w32.add_(step)
            w16.add_(step.to(torch.bfloat16))
    assert torch.equal(w16, theirs["lm_head.weight"])  # not one bf16 weight moved
    moved = _published(master, Store(tmp_path / "s1"), 1, role.published)["lm_head.weight"]
    assert moved.dtype == torch.bfloat16 and (moved != theirs["lm_head.weight"]).float().mean() > 0.9


def test_a_float32_master_resumes_from_its_checkpoint_in_float32(tmp_path):
    role = TrainerNode(KEY, SPEC, "", tmp_path / "w", 0, master_float32=True)
    trainer = role._resumed_or_warmed_up()
    with torch.no_grad():
        trainer.model.lm_head.weight.add_(1e-6)  # below a bf16 step: only a float32 checkpoint keeps it
    trainer.step = 3
    trainer.save(tmp_path / "w" / "checkpoint")
    again = TrainerNode(KEY, SPEC, "", tmp_path / "w", 0, master_float32=True)._resumed_or_warmed_up()
    assert again.step == 3 and {p.dtype for p in again.model.parameters()} == {torch.float32}
    assert torch.equal(again.model.lm_head.weight, trainer.model.lm_head.weight)
    plain = TrainerNode(KEY, SPEC, "", tmp_path / "w", 0)._resumed_or_warmed_up()  # without it: the run's dtype
    assert {p.dtype for p in plain.model.parameters()} == {torch.bfloat16}
