"""Version 0 from a member's checkpoint directory is checked and loaded tensor by tensor: the check reads
the checkpoint shard by shard against the signed manifest (and the spec's pin in the same pass), the
load copies one tensor at a time, and the process never holds the model a second time; a checkpoint
that differs from what the trainer published in one tensor is refused and version 0 fetched instead."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.random_checkpoint import write_random_shards
from node.engine.weight_staging import StagedVersion
from node.engine.weights import expected_shapes
from node.model.checkpoint import state_dict_to_hf
from node.model.config import ModelConfig
from node.model.fill import build_from_shards
from node.model.shards import INDEX, CheckpointShards
from node.model.streamed_weights import StreamedWeights
from node.rl.parallel.publish import publish_model
from node.roles.common import blank_model, fetch_policy
from node.roles.version0 import LocalVersion0, local_version0
from protocol.identity import NodeKey
from protocol.messages import RunSpec
from protocol.model_spec import ModelSpec
from node.model.served_form import ServedForm
from shardcast.fetch import read_held
from shardcast.manifest import TrustedPublishers
from shardcast.publish import PublishOptions
from shardcast.server import ShardServer
from shardcast.store import Store

PEER = "12D3KooWGzh1b2VJ2c8Nk5rQb9P9s1p7pY9yq1Qe4sXvTtF3gW8E"
KEY = NodeKey.from_seed(b"\x05" * 32)
CFG = ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=256, intermediate_size=256,
                  moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
"""Small, with FP8-blockable widths; 64 KiB manifest shards, so tensors span shards and shards tensors."""
SMALL_SHARDS = PublishOptions(shard_size=64 << 10)
LAST_EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _spec(directory, sources=(), pin: str | None = None) -> RunSpec:
    return RunSpec(run_id="r", coordinator=PEER, environment="reverse", trainer=KEY.peer_id,
                   shardcast_sources=list(sources),
                   model=ModelSpec(source=str(directory), dtype="bfloat16", weights_hash=pin))


def _publish(directory, store: Store, cfg: ModelConfig = CFG, options: PublishOptions = SMALL_SHARDS):
    """What the trainer publishes as version 0: the checkpoint as loaded in bf16 (and its weights hash)."""
    model, digest = build_from_shards(cfg, CheckpointShards(directory), torch.bfloat16, "cpu")
    signed = publish_model(model, None, store, KEY, "r", 0, None, options)
    return signed, state_dict_to_hf(model), digest


def _serve(trainer: Store, go):
    async def main():
        server = ShardServer(trainer)
        port = await server.start("127.0.0.1", 0)
        try:
            return await go([f"http://127.0.0.1:{port}"]), server.bytes_served
        finally:
            await server.stop()
    return asyncio.run(main())


@pytest.mark.parametrize("stored", ["bfloat16", "float32", "fp8-experts"])
def test_an_honest_checkpoint_is_version_0_read_tensor_by_tensor(tmp_path, stored):
    directory = write_random_shards(CFG, tmp_path / "ckpt", "experts" if stored == "fp8-experts" else "off",
                                    torch.float32 if stored == "float32" else torch.bfloat16, max_shard_bytes=256 << 10)
    signed, published, digest = _publish(directory, Store(tmp_path / "trainer"))
    member = Store(tmp_path / "member")
    got, served = _serve(Store(tmp_path / "trainer"),
                         lambda src: local_version0(_spec(directory, src, digest), member, signed.manifest.manifest_hash()))
    assert isinstance(got, StreamedWeights) and served == 0, "only the manifest travelled"
    assert member.held_shards("r", 0) == []
    assert list(got) == list(published) and all(torch.equal(got[k], published[k]) for k in published)
    model = blank_model(_spec(directory), "cpu")  # loaded as a fetched version is
    StagedVersion.of(model, got, expected_shapes(model), stage=False).apply()
    assert all(torch.equal(t, published[k]) for k, t in state_dict_to_hf(model).items())


def test_a_checkpoint_that_differs_in_one_tensor_is_refused_and_version_0_fetched(tmp_path):
    directory = write_random_shards(CFG, tmp_path / "ckpt", max_shard_bytes=256 << 10)
    signed, published, _ = _publish(directory, Store(tmp_path / "trainer"))
    fname = json.loads((directory / INDEX).read_text())["weight_map"][LAST_EXPERT]
    tensors = load_file(str(directory / fname))
    tensors[LAST_EXPERT][-1, -1] += 1.0  # one element of the tensor laid out last: every shard is read
    save_file(tensors, str(directory / fname), metadata={"format": "pt"})
    member = Store(tmp_path / "member")

    async def go(src):
        spec = _spec(directory, src)
        assert await local_version0(spec, member, signed.manifest.manifest_hash()) is None
        return await fetch_policy(spec, member, 0, signed.manifest.manifest_hash())

    state, served = _serve(Store(tmp_path / "trainer"), go)
    assert served > 0 and all(torch.equal(state[k], published[k]) for k in published)


def test_a_checkpoint_that_is_the_manifest_but_not_the_spec_pin_is_refused(tmp_path):
    directory = write_random_shards(CFG, tmp_path / "ckpt", max_shard_bytes=256 << 10)
    signed, _, digest = _publish(directory, Store(tmp_path / "trainer"))
    wrong = "blake3:" + ("0" * 64 if digest[-1] != "0" else "1" * 64)
    got, _ = _serve(Store(tmp_path / "trainer"),
                    lambda src: local_version0(_spec(directory, src, wrong), Store(tmp_path / "m"),
                                               signed.manifest.manifest_hash()))
    assert got is None


def _fp8_spec(directory, sources=(), pin: str | None = None) -> RunSpec:
    return RunSpec(run_id="r", coordinator=PEER, environment="reverse", trainer=KEY.peer_id,
                   shardcast_sources=list(sources),
                   model=ModelSpec(source=str(directory), dtype="bfloat16", weights_hash=pin, fp8="all"))


@pytest.mark.parametrize("stored", ["fp8-all", "bfloat16"])
def test_an_fp8_runs_version_0_is_its_served_form_made_from_the_checkpoint_and_version_1_a_delta_of_it(tmp_path, stored):
    """An FP8 run publishes version 0 in its served form: a member holding the checkpoint (block-scaled e4m3 or
    bf16) quantises its values by the same rule as it reads them, matches the signed manifest without a shard
    downloaded (the spec's pin checked on the values in the same pass), and joining at version 1 downloads only
    the delta, whose parent it makes from the checkpoint; a pin that differs still refuses the checkpoint."""
    directory = write_random_shards(CFG, tmp_path / "ckpt", "all" if stored == "fp8-all" else "off",
                                    max_shard_bytes=256 << 10)
    trainer = Store(tmp_path / "trainer")
    model, digest = build_from_shards(CFG, CheckpointShards(directory), torch.bfloat16, "cpu")
    v0 = publish_model(model, None, trainer, KEY, "r", 0, None, SMALL_SHARDS, fp8="all")
    assert any(e.name.endswith("_scale_inv") for e in v0.manifest.tensors), "version 0 in its served form"
    with torch.no_grad():  # an RL step that moves one expert weight (not its block's largest) and the final norm
        w = model.model.layers[1].mlp.experts.down_proj[3]
        w.view(-1)[w.abs().argmin()] += 0.01
        model.model.norm.weight.add_(0.01)
    v1 = publish_model(model, None, trainer, KEY, "r", 1, 0, SMALL_SHARDS, fp8="all")
    assert v1.manifest.encoding == "delta" and v1.manifest.parent == 0
    assert v1.manifest.wire_bytes < v0.manifest.wire_bytes / 10, "the delta carries what moved"

    member = Store(tmp_path / "member")
    got, served = _serve(trainer, lambda src: local_version0(_fp8_spec(directory, src, digest), member,
                                                             v0.manifest.manifest_hash()))
    assert isinstance(got, StreamedWeights) and served == 0, "only the manifest travelled"

    joiner = Store(tmp_path / "joiner")
    state, served = _serve(trainer, lambda src: fetch_policy(_fp8_spec(directory, src, digest), joiner, 1,
                                                             local=LocalVersion0(_fp8_spec(directory, src, digest))))
    assert served == v1.manifest.wire_bytes, f"served {served}: the delta is {v1.manifest.wire_bytes} bytes"
    assert joiner.held_shards("r", 0) == []
    want = ServedForm(read_held(trainer, TrustedPublishers([KEY.peer_id]), "r", 1).tensors(), torch.bfloat16)
    assert isinstance(state, ServedForm) and state.quantised == want.quantised
    assert all(torch.equal(state.tensors[k], want.tensors[k]) for k in want.tensors), "the trainer's bytes exactly"

    # the node's way on: an FP8 engine that loaded version 0 from its checkpoint (quantising the values itself)
    # takes version 1 as the delta's changed bytes alone, and holds what a whole copy of version 1 gives
    from node.engine import Engine
    from node.engine.fp8.model import apply_fp8_mode

    def engine() -> Engine:
        return Engine(apply_fp8_mode(blank_model(_fp8_spec(directory), "cpu"), "all"), max_batch=2, eos_id=-1)

    rows: list = []
    node = engine()
    node.on_swap.append(lambda v, row: rows.append(row))
    for v, version in ((0, got), (1, state)):
        node.load_weights(version, v)
        node._apply_pending()
    assert state.changes is not None and rows[-1]["sparse_bytes"] == len(state.changes.positions) > 0
    whole = engine()
    whole.load_weights(want, 1)
    whole._apply_pending()
    mine, other = dict(node.model.named_buffers()), dict(whole.model.named_buffers())
    assert all(torch.equal(t.view(torch.uint8), other[n].view(torch.uint8)) if t.dtype == torch.float8_e4m3fn
               else torch.equal(t, other[n]) for n, t in mine.items())

    wrong = "blake3:" + ("0" * 64 if digest[-1] != "0" else "1" * 64)
    got, _ = _serve(trainer, lambda src: local_version0(_fp8_spec(directory, src, wrong), Store(tmp_path / "m"),
                                                        v0.manifest.manifest_hash()))
    assert got is None, "a checkpoint that is the manifest but not the pin is refused"


# ---- memory: a checkpoint of a few hundred MB, checked and loaded in a process of its own -------------
def _big_cfg() -> ModelConfig:
    """~155M parameters (310 MB in bf16), nearly all in 128 experts of 0.75 MiB: the qwen3-moe layout."""
    return ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=768, intermediate_size=1024,
                       moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=64, num_experts=32, num_experts_per_tok=4, max_position_embeddings=64)


CHILD = r"""
import asyncio, json, sys, threading, time
import torch
from node.engine.weight_staging import StagedVersion
from node.engine.weights import expected_shapes
from node.model.spec import weights_hash
from node.roles.common import blank_model
from node.roles.version0 import LocalVersion0, local_version0
from protocol.messages import RunSpec
from shardcast.store import Store

def status(key):  # kB -> bytes; RssAnon: heap and tensors, not the checkpoint's mapped file pages (RssFile)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

spec, store, announced = RunSpec.model_validate_json(sys.argv[1]), Store(sys.argv[2]), sys.argv[3]
model = blank_model(spec, "cpu")
with torch.no_grad():
    for p in model.parameters():
        p.zero_()  # the served model's own pages are resident before the baseline: what follows is extra
base, peak, done = status("RssAnon"), [0], threading.Event()
def sample():
    while not done.wait(0.001):  # a sample every millisecond until the load is over
        peak[0] = max(peak[0], status("RssAnon"))
sampler = threading.Thread(target=sample)
sampler.start()
t0 = time.perf_counter()
state = asyncio.run(local_version0(spec, store, announced))
t1 = time.perf_counter()
if state is not None:
    StagedVersion.of(model, state, expected_shapes(model), stage=False).apply()
t2 = time.perf_counter()
done.set()
sampler.join()
peak[0] = max(peak[0], status("RssAnon"))
print(json.dumps({"accepted": state is not None, "extra_anon_peak": peak[0] - base, "anon_base": base,
                  "rss_file_end": status("RssFile"), "check_s": t1 - t0, "load_s": t2 - t1,
                  "weights_hash": weights_hash(model)}))
"""


@pytest.mark.slow
def test_version_0_from_a_checkpoint_of_300_mb_is_checked_and_loaded_in_a_fraction_of_its_size(tmp_path):
    directory = write_random_shards(_big_cfg(), tmp_path / "ckpt", max_shard_bytes=128 << 20)
    ckpt_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    options = PublishOptions()  # the default 64 MiB shards: larger than any tensor here
    signed, published, digest = _publish(directory, Store(tmp_path / "trainer"), _big_cfg(), options)
    largest = max(t.numel() * t.element_size() for t in published.values())
    del published
    member = Store(tmp_path / "member")
    member.put_manifest(signed)  # held (a member restarting): the child reads it from its store
    spec = _spec(directory, ["http://127.0.0.1:9"], digest)  # never dialled
    p = subprocess.Popen([sys.executable, "-c", CHILD, spec.model_dump_json(), str(tmp_path / "member"),
                          signed.manifest.manifest_hash()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    killer = threading.Timer(600, p.kill)  # every wait has a limit
    killer.start()
    try:
        out, err = p.communicate()
    finally:
        killer.cancel()
    assert p.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    print(f"checkpoint {ckpt_bytes / 2**20:.0f} MiB: extra anonymous RSS peak {got['extra_anon_peak'] / 2**20:.1f} MiB, "
          f"check {got['check_s']:.1f} s, load {got['load_s']:.1f} s, file pages mapped {got['rss_file_end'] / 2**20:.0f} MiB")
    assert got["accepted"] and got["weights_hash"] == digest, "the model holds exactly the checkpoint"
    # the largest tensor twice over (a read for the check, one for the copy) and slack for the allocator and
    # what the first fetch imports; a whole-model copy (the model built beside the served one) is >= ckpt_bytes
    bound = 2 * largest + (16 << 20)
    assert got["extra_anon_peak"] < min(bound, ckpt_bytes // 3), got


def test_a_streamed_version_is_written_shard_by_shard_as_the_checkpoint_it_came_from(tmp_path):
    """What the vLLM adapter does with a version (contrib/vllm/node_engine.py): each written shard's tensors
    looked up while it is written."""
    from node.model.checkpoint import save_tensors

    directory = write_random_shards(CFG, tmp_path / "ckpt", "experts", max_shard_bytes=256 << 10)
    weights = StreamedWeights.of_checkpoint(directory, CFG, torch.bfloat16)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(CFG.to_hf_dict("bfloat16")))
    save_tensors(weights, tmp_path / "out", {"format": "pt"}, max_shard_bytes=128 << 10)
    written = CheckpointShards(tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert written.names() == sorted(weights) and all(torch.equal(written.raw(k), weights[k]) for k in weights)


def test_a_validator_holding_a_newer_version_takes_version_0_from_the_checkpoint_bit_for_bit(tmp_path):
    """`ResidentPolicies.add` reads a streamed version module by module (node/roles/resident_policy.py)."""
    from node.model.checkpoint import load_hf_state_dict
    from node.roles.resident_policy import ResidentPolicies, raw_tensors

    directory = write_random_shards(CFG, tmp_path / "ckpt", max_shard_bytes=256 << 10)
    weights = StreamedWeights.of_checkpoint(directory, CFG, torch.bfloat16)
    v0 = {k: weights[k] for k in weights}
    v1 = {k: t + 0.5 if k.endswith("experts.2.up_proj.weight") else t for k, t in v0.items()}
    resident = blank_model(_spec(directory), "cpu")
    load_hf_state_dict(resident, v1)
    held = ResidentPolicies(resident, 1, b"\1" * 32)
    held.add(0, weights, b"\0" * 32)
    alone = blank_model(_spec(directory), "cpu")
    load_hf_state_dict(alone, v0)
    model, _ = held[0]
    assert all(torch.equal(t, raw_tensors(alone)[n]) for n, t in raw_tensors(model).items())
    model, _ = held[1]
    assert not torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, alone.model.layers[0].mlp.experts.gate_up_proj)


def test_an_engine_given_version_0_streamed_generates_what_it_does_with_it_in_memory(tmp_path):
    """`Engine.load_weights` (the inference role's call) takes the streamed version as a fetched one."""
    from node.engine import Engine, Request, SamplingParams

    directory = write_random_shards(CFG, tmp_path / "ckpt", "experts", max_shard_bytes=256 << 10)
    weights = StreamedWeights.of_checkpoint(directory, CFG, torch.bfloat16)
    in_memory = state_dict_to_hf(build_from_shards(CFG, CheckpointShards(directory), torch.bfloat16, "cpu")[0])
    reqs = [Request(str(i), [3 + i, 9, 27], SamplingParams(temperature=0.9, max_new_tokens=6, seed=i)) for i in range(3)]
    runs = []
    for state in (weights, in_memory):
        engine = Engine(blank_model(_spec(directory), "cpu"), max_batch=4, eos_id=-1, version=-1)
        engine.load_weights(state, version=0)
        runs.append([(c.token_ids, c.logprobs, c.versions) for c in engine.generate(reqs)])
    assert runs[0] == runs[1] and all(set(v) == {0} for _, _, v in runs[0])


def test_a_validator_checks_a_fetched_version_0_against_the_pin_after_a_newer_version(tmp_path):
    """The pin is hashed over the published tensors, no second model built (node/roles/validator.py `_hold`)."""
    from node.model.errors import WeightsHashMismatch
    from node.roles.common import fresh_model
    from node.model.spec import weights_hash
    from node.roles.validator import ValidatorNode

    tiny = RunSpec(run_id="r", coordinator=PEER, environment="reverse", trainer=KEY.peer_id)
    v0 = state_dict_to_hf(fresh_model(tiny))
    v1 = {k: t + 1.0 if k == "model.norm.weight" else t for k, t in v0.items()}
    pin = ModelSpec(weights_hash=weights_hash(fresh_model(tiny)))
    for spec_model, ok in ((pin, True), (ModelSpec(weights_hash="blake3:" + "1" * 64), False)):
        spec = tiny.model_copy(update={"model": spec_model})
        validator = ValidatorNode(KEY, spec, "/ip4/127.0.0.1/tcp/1", tmp_path / ("ok" if ok else "bad"))
        asyncio.run(validator._hold(1, v1, b"\1" * 32))
        if ok:
            asyncio.run(validator._hold(0, v0, b"\0" * 32))
            model, _ = validator.policies[0]
            assert torch.equal(model.model.norm.weight, v0["model.norm.weight"])
        else:
            with pytest.raises(WeightsHashMismatch):
                asyncio.run(validator._hold(0, v0, b"\0" * 32))
            assert sorted(validator.policies) == [1]


def test_a_checkpoint_changed_on_disk_after_its_check_is_refused_when_loaded(tmp_path):
    """The files are read again when a loader looks a tensor up: what is served is what was checked."""
    import struct

    from node.model.errors import InvalidCheckpoint

    directory = write_random_shards(CFG, tmp_path / "ckpt", max_shard_bytes=256 << 10)
    signed, published, digest = _publish(directory, Store(tmp_path / "trainer"))
    got, _ = _serve(Store(tmp_path / "trainer"), lambda src: local_version0(_spec(directory, src, digest),
                                                                          Store(tmp_path / "m"), None))
    assert got is not None
    path = directory / json.loads((directory / INDEX).read_text())["weight_map"][LAST_EXPERT]
    with open(path, "r+b") as f:  # in place, as an editor or a copy over the file would: the mapping sees it
        (n,) = struct.unpack("<Q", f.read(8))
        begin = json.loads(f.read(n))[LAST_EXPERT]["data_offsets"][0]
        f.seek(8 + n + begin)
        first = f.read(2)
        f.seek(8 + n + begin)
        f.write(bytes(x ^ 0x40 for x in first))  # the tensor's first element, an exponent bit flipped
    assert torch.equal(got["model.norm.weight"], published["model.norm.weight"])  # the others still load
    with pytest.raises(InvalidCheckpoint, match="changed on disk"):
        got[LAST_EXPERT]


def test_a_served_manifest_naming_scales_for_a_tensor_the_rule_cannot_quantise_is_not_the_checkpoint(tmp_path):
    """A signed manifest that lists a norm (rank 1) as e4m3 with scales: the member's check says it is not its
    checkpoint (version 0 is fetched instead), it does not raise."""
    from node.roles.version0 import checked_version0

    directory = write_random_shards(CFG, tmp_path / "ckpt", max_shard_bytes=256 << 10)
    signed, _, _ = _publish(directory, Store(tmp_path / "trainer"))
    m = signed.manifest
    norm = next(e for e in m.tensors if e.name == "model.norm.weight")
    # the check reads names and headers before any byte: a manifest that lists the norm's scales is enough
    tensors = [e.model_copy(update={"dtype": "float8_e4m3fn"}) if e is norm else e for e in m.tensors]
    scale = norm.model_copy(update={"name": "model.norm.weight_scale_inv", "dtype": "float32", "shape": [1, 1]})
    odd = m.model_copy(update={"tensors": [scale, *tensors]})
    assert checked_version0(_fp8_spec(directory), odd) is None
