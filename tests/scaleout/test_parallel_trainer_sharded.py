"""The trainer world holds shards, not models: after start and a step every rank holds only its part
of each parameter and AdamW state; each rank is sent only its share of the batch; a version is
published by streaming the shards into shardcast, byte-for-byte the layout `shardcast.publish`
gives the one-process model; bad layouts and other models' checkpoints stop at start-up.

Run by torchrun, this file is also the world `test_world_*` drives (see `world_main`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from node.model.checkpoint import state_dict_to_hf
from node.model.qwen3_moe import CausalLM
from node.rl.parallel.dims import LayoutError, ParallelDims
from benchmarks.parallel_parity import STEP_TOLERANCE, check_batch, check_model, step_errors
from node.rl.parallel.publish import publish_model
from node.rl.parallel.trainer import minibatch_seed
from node.rl.trainer import Trainer, TrainerConfig
from protocol.identity import NodeKey
from shardcast.codec import decode_shard, shard_ranges, unflatten
from shardcast.publish import PublishOptions, publish
from shardcast.store import Store

ROOT = Path(__file__).resolve().parents[2]
SEED = 5


def test_streamed_publication_is_shardcast_publish_of_the_hf_weights(tmp_path):
    """One process: `publish_model` (tensor by tensor into the payload, shards encoded as they
    complete) writes exactly the manifest layout and payload `publish(state_dict_to_hf(model))` does,
    as a full version and as a delta against its parent."""
    model = check_model()
    key = NodeKey.generate()
    opts = PublishOptions(shard_size=4096, threads=2)  # many shards: encoding overlaps the copies
    streamed, plain = Store(tmp_path / "a"), Store(tmp_path / "b")
    for version in (0, 1):
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
        parent = version - 1 if version else None
        a = publish_model(model, None, streamed, key, "r", version, parent, opts)
        b = publish(plain, key, "r", version, {k: v.clone() for k, v in state_dict_to_hf(model).items()}, parent, opts)
        assert a.manifest.encoding == b.manifest.encoding == ("delta" if version else "full")
        assert [t.model_dump() for t in a.manifest.tensors] == [t.model_dump() for t in b.manifest.tensors]
        assert [s.raw_hash for s in a.manifest.shards] == [s.raw_hash for s in b.manifest.shards]
        assert np.array_equal(streamed.payload("r", version), plain.payload("r", version))
    assert len(a.manifest.shards) > 10


def test_the_next_version_is_listed_while_the_last_ones_wire_shards_encode_and_its_own_follow_them(
        tmp_path, monkeypatch):
    """A trainer's publications share one payload buffer (`PayloadBuffer`): version 2 is copied out, listed and
    readable beside the trainer while version 1's wire shards are still being encoded; version 2's wire shards
    wait for version 1's and are encoded after them, in order; both then fetch bit for bit as deltas."""
    import threading

    import shardcast.publish as sp
    from node.rl.parallel.publish import PayloadBuffer, start_publish

    real, order, release = sp._publish_wire, [], threading.Event()

    def wire(store_, key_, local, opt):
        if local.version == 1:  # v1's wire shards take as long as the test says
            assert release.wait(60)
        order.append(local.version)
        return real(store_, key_, local, opt)

    monkeypatch.setattr(sp, "_publish_wire", wire)
    model, key, store, buffer = check_model(), NodeKey.generate(), Store(tmp_path / "s"), PayloadBuffer()
    opts = PublishOptions(shard_size=4096, threads=2)
    states = []

    def step_and_publish(version):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * version)
        states.append({k: v.clone() for k, v in state_dict_to_hf(model).items()})
        return start_publish(model, None, store, key, "r", version, version - 1 if version else None, opts, buffer)

    step_and_publish(0).whole.result(timeout=60)
    first = step_and_publish(1)
    first.listed.result(timeout=60)
    second = step_and_publish(2)
    listed = second.listed.result(timeout=60)  # listed while v1's wire shards have not started
    assert not first.whole.done() and not second.whole.done() and order == [0]
    assert store.manifest("r", 1) is None and store.held_manifest("r", 2).manifest.manifest_hash() == \
        listed.manifest.manifest_hash()
    release.set()
    whole = [first.whole.result(timeout=60), second.whole.result(timeout=60)]
    assert order == [0, 1, 2] and [w.manifest.encoding for w in whole] == ["delta", "delta"]
    for version, w in zip((1, 2), whole):
        assert w.manifest.manifest_hash() == store.held_manifest("r", version).manifest.manifest_hash()
    raw = None
    for version in (0, 1, 2):  # what a peer elsewhere rebuilds from the wire shards alone
        m = store.manifest("r", version).manifest
        out = np.zeros(m.total_bytes, dtype=np.uint8)
        for s, (a, b) in zip(m.shards, shard_ranges(m.total_bytes, m.shard_size)):
            decode_shard(s, store.read_shard("r", version, s.index), out[a:b], None if raw is None else raw[a:b])
        raw, rebuilt = out, unflatten(m.tensors, out)
        for name, t in states[version].items():
            assert torch.equal(rebuilt[name], t), name


def test_a_publication_is_whole_before_its_retention_runs(tmp_path, monkeypatch):
    """Retention deletes older versions' files after a publication (a 10 GB payload on tmpfs: ~0.5 s): the whole
    manifest is handed to its waiters first, so neither the trainer nor the next version's wire shards wait for it."""
    import threading

    from node.rl.parallel.publish import PayloadBuffer, start_publish

    entered, release = threading.Event(), threading.Event()
    real = Store.retain

    def slow_retain(self, run_id, keep_last):
        entered.set()
        assert release.wait(60)
        return real(self, run_id, keep_last)

    monkeypatch.setattr(Store, "retain", slow_retain)
    model, store = check_model(), Store(tmp_path / "s")
    publishing = start_publish(model, None, store, NodeKey.generate(), "r", 0, None,
                               PublishOptions(shard_size=4096, threads=2), PayloadBuffer())
    assert entered.wait(60)
    whole = publishing.whole.result(timeout=60)  # while retention is held back
    assert whole.manifest.wire_complete and store.manifest("r", 0).manifest.manifest_hash() == \
        whole.manifest.manifest_hash()
    release.set()


def test_a_gather_that_fails_midway_signs_no_version(tmp_path, monkeypatch):
    """The encoder never signs a payload whose copy did not finish: the failure reaches the caller
    and the version's waiter gets `PublicationAborted`; nothing is listed in the store."""
    from concurrent.futures import Future

    import node.rl.parallel.publish as pub

    real = pub.gather_tensors

    def dies_after_two(model, groups, get=lambda p: p.detach()):
        for i, item in enumerate(real(model, groups, get)):
            if i == 2:
                raise RuntimeError("rank lost mid-gather")
            yield item

    monkeypatch.setattr(pub, "gather_tensors", dies_after_two)
    store, done = Store(tmp_path / "s"), Future()
    sink = pub.Publication(store=store, key=NodeKey.generate(), run_id="r", version=0, parent=None,
                           options=PublishOptions(shard_size=4096, threads=2), buffer=pub.PayloadBuffer(), done=done)
    with pytest.raises(RuntimeError, match="rank lost"):
        pub.stream_publish(check_model(), None, None, sink)
    with pytest.raises(pub.PublicationAborted):
        done.result(timeout=30)
    assert store.manifest("r", 0) is None
    assert not store.payload_path("r", 0).exists() and not list(store.version_dir("r", 0).glob(".*tmp"))
    monkeypatch.setattr(pub, "gather_tensors", real)  # the same buffer then publishes a whole version
    ok = pub.publish_model(check_model(), None, store, sink.key, "r", 0, None, sink.options, sink.buffer)
    assert store.manifest("r", 0).manifest.manifest_hash() == ok.manifest.manifest_hash()


def test_layouts_that_do_not_fit_the_model_are_typed_errors_naming_the_mismatch():
    cfg = check_model().config  # 8 experts
    with pytest.raises(LayoutError, match="num_experts=6"):
        ParallelDims(dp=4, ep=4).check_model(cfg.model_copy(update={"num_experts": 6}))
    with pytest.raises(LayoutError, match="dense model"):
        ParallelDims(dp=2, ep=2).check_model(cfg.model_copy(update={"num_experts": 0}))
    # inside pydantic's validator the LayoutError reaches the caller as a ValidationError (a ValueError)
    with pytest.raises(ValueError, match="ep=4 must divide dp=2"):
        ParallelDims(dp=2, ep=4)
    with pytest.raises(ValueError, match="needs fsdp"):
        ParallelDims(bf16=True, fsdp=False)
    ParallelDims(dp=2, ep=2, cp=2).check_model(cfg)  # honest layouts pass (heads need not divide by cp)
    ParallelDims(cp=3).check_model(cfg)


# ---- the world (torchrun runs this file) ---------------------------------------------------------
def _setup():
    torch.manual_seed(SEED)
    model = check_model(seed=SEED)
    batch = check_batch(model, rows=6, length=22, seed=9)
    return model, TrainerConfig(lr=1e-3), batch


def world_main(argv: list[str]) -> None:
    from node.rl.parallel.dims import parse_layout
    from node.rl.parallel.state import global_shape, local_tensor as _local
    from node.rl.parallel.world import Leader, follow

    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--save", type=Path)
    ap.add_argument("--other-layers", type=int, help="ranks > 0 get a model with this many layers")
    args = ap.parse_args(argv)
    model, cfg, batch = _setup()
    dims = parse_layout(args.layout)
    rank = int(os.environ["RANK"])

    def holdings(r) -> dict:
        t = r.trainer
        rows = {}
        for name, p in t.model.named_parameters():
            state = t.optimizer.state.get(p, {})
            rows[name] = {"local": _local(p).numel(), "global": global_shape(r.groups, name, p).numel(),
                          "moments": [_local(state[k]).numel() for k in ("exp_avg", "exp_avg_sq") if k in state],
                          "dtype": str(_local(p).dtype)}
        return {"params": rows, "batches": r.seen_rows}

    if rank > 0:
        out: dict = {}
        config = model.config
        if args.other_layers:
            config = config.model_copy(update={"num_hidden_layers": args.other_layers})
        try:
            follow(dims, cfg, SEED, CausalLM(config), on_stop=lambda r: out.update(holdings(r)))
        except ValueError as exc:
            (args.out / f"rank{rank}.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            raise
        (args.out / f"rank{rank}.json").write_text(json.dumps(out))
        return
    leader = Leader.connect(dims, cfg, SEED)
    try:
        try:
            leader.start(Trainer(model, cfg))
        except ValueError as exc:
            (args.out / "rank0.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            raise
        leader.train_step(batch)
        signed = leader.send_weights(Store(args.out / "store"), NodeKey.generate(), "w", 1, None, PublishOptions(shard_size=8192))
        if args.save:
            leader.save(args.save)
        mine = leader.collectives.submit(lambda: holdings(leader.rank)).result()
        mine["manifest_tensors"] = [t.name for t in signed.manifest.tensors]
        (args.out / "rank0.json").write_text(json.dumps(mine))
    finally:
        leader.stop()


def _world(layout: str, out: Path, *extra: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=_pythonpath())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--layout", layout, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_world_ranks_hold_shards_and_publish_the_one_process_step(tmp_path):
    ranks = _world("dp2-ep2", tmp_path / "w", "--save", str(tmp_path / "ckpt"))
    # every parameter and AdamW moment is held in parts: half of each dense tensor, and of the
    # experts exactly this rank's (ep=2: half the experts, not FSDP-split further: 1 replica)
    for holding in ranks:
        for name, row in holding["params"].items():
            assert row["local"] <= -(-row["global"] // 2), (name, row)
            assert row["moments"] == [row["local"]] * 2, (name, row)
            assert row["dtype"] == "torch.float32"  # the master weights
        total_local = sum(r["local"] for r in holding["params"].values())
        total = sum(r["global"] for r in holding["params"].values())
        assert total_local <= 0.55 * total
    # each rank was sent only its rows: 2 updates x 2 minibatches of 3 rows -> 2 rows each per dp rank (padded)
    assert [r["batches"] for r in ranks] == [[2, 2, 2, 2]] * 2
    # what the world published is the one-process step's weights, under the one-process names
    model, cfg, batch = _setup()
    before = {n: t.clone() for n, t in state_dict_to_hf(model).items()}
    one = Trainer(model, cfg)
    torch.manual_seed(minibatch_seed(SEED, 0))
    one.train_step(batch)
    want = state_dict_to_hf(one.model)
    store = Store(tmp_path / "w" / "store")
    signed = store.manifest("w", 1)
    got = unflatten(signed.manifest.tensors, store.payload("w", 1))
    assert ranks[0]["manifest_tensors"] == list(want)
    errors = step_errors(got, want, before)
    assert max(errors.values()) < STEP_TOLERANCE, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    # the sharded checkpoint: each rank wrote its own part (two data files), readable whole by one process
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("dcp-1/*.distcp"))
    assert len(files) == 2, files
    loaded = Trainer.load(tmp_path / "ckpt", cfg)
    assert max(float((a - b).abs().max()) for a, b in zip(state_dict_to_hf(loaded.model).values(), got.values())) < 1e-6


@pytest.mark.slow
def test_ranks_given_different_models_all_refuse_to_start_naming_the_field(tmp_path):
    """E.g. rank 0 resumed a checkpoint of another model than the run's: no rank builds anything."""
    out = tmp_path / "w"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=_pythonpath())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--layout", "dp2-ep2", "--out", str(out), "--other-layers", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0
    for r in range(2):
        error = json.loads((out / f"rank{r}.json").read_text())["error"]
        assert error.startswith("ModelMismatch") and "num_hidden_layers: rank 0 2, rank 1 3" in error, error


def test_a_checkpoint_of_another_model_is_refused_naming_the_field(tmp_path):
    from node.rl.parallel.checkpoint import CheckpointMismatch

    _world("cp2", tmp_path / "w", "--save", str(tmp_path / "ckpt"))
    cfg = check_model().config.model_copy(update={"num_hidden_layers": 3})
    with pytest.raises(CheckpointMismatch, match="num_hidden_layers: checkpoint 2, model 3"):
        from node.rl.parallel.checkpoint import load_whole

        load_whole(CausalLM(cfg), tmp_path / "ckpt")
    Trainer.load(tmp_path / "ckpt")  # the honest model loads


if __name__ == "__main__":
    world_main(sys.argv[1:])
    # Done and written: skip the interpreter's finalization, where gloo's worker threads can abort the process
    # ("terminate called without an active exception", exit -6: rank 0 once in a fresh-clone suite, session 21;
    # tests/multigpu/ep_engine_worker.py does the same). A rank that failed raised before this line.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _pythonpath() -> str:
    """The repository first: a worker run as a script has its own folder as sys.path[0], not the root
    (benchmarks.parallel_parity, which the workers import, is not an installed package)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
