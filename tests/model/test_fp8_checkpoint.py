"""Block-scaled FP8 checkpoints (the HF / DeepSeek layout) and streaming loads: an honest checkpoint
loads as it is stored and predicts what its bf16 source does; each kind of bad checkpoint is one typed
error before anything is allocated, and `join` exits 2 on it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.random_checkpoint import write_random_shards
from node.engine.fp8.model import FP8GroupedExperts, FP8Linear, apply_fp8_mode, fp8_mode_of
from node.fp8.quantize import BLOCK as FP8_BLOCK
from node.model.checkpoint import load_checkpoint
from node.model.config import ModelConfig
from node.model.errors import InvalidCheckpoint, MismatchedScales, MissingModelFile, UnsupportedQuantization
from node.model.fill import build_from_shards
from node.model.quantization import BLOCK, dequantize, e4m3_to_float32
from node.model.shards import CheckpointShards

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=256, intermediate_size=256,
                  moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
"""Widths of whole 128-blocks (the gate rows end on a block edge, as Qwen3-30B-A3B's 768 do)."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The same random weights (one seed, one draw order) stored in bf16 and as FP8 `experts` / `all`."""
    root = tmp_path_factory.mktemp("fp8ckpt")
    return {mode: write_random_shards(CFG, root / mode, mode, max_shard_bytes=1 << 20) for mode in ("off", "experts", "all")}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(48).remainder(CFG.vocab_size).view(2, 24)
    with torch.no_grad():
        return model.eval()(ids).logits.float()


def test_the_block_sizes_of_checkpoints_and_of_our_fp8_kernels_agree():
    assert BLOCK == FP8_BLOCK == 128


def test_the_cpu_table_dequantises_bit_for_bit_as_torch_casts():
    every_byte = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(e4m3_to_float32(every_byte).view(torch.int32), every_byte.float().view(torch.int32))  # NaN bits too
    g = torch.Generator().manual_seed(0)
    for shape in [(256, 384), (200, 300), (3, 256, 128)]:  # whole blocks, partial last blocks, stacked experts
        q = (torch.randn(*shape, generator=g) * 50).to(torch.float8_e4m3fn)
        s = torch.rand(*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK), generator=g) + 1e-3
        want = (q.float() * s.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :shape[-2], :shape[-1]])
        for dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(dequantize(q, s, dtype), want.to(dtype))
        assert not torch.equal(dequantize(q, s * 2, torch.float32), want)


@pytest.mark.parametrize("mode", ["experts", "all"])
def test_an_fp8_checkpoint_loads_its_own_e4m3_bytes_and_predicts_like_its_bf16_source(ckpts, mode):
    shards = CheckpointShards(ckpts[mode])
    assert shards.fp8_mode() == mode
    served, digest = build_from_shards(CFG, shards, torch.bfloat16, "cpu", lambda m: apply_fp8_mode(m, mode))
    assert fp8_mode_of(served) == mode
    experts = served.model.layers[1].mlp.experts
    assert isinstance(experts, FP8GroupedExperts)
    gate, up = shards.fp8("model.layers.1.mlp.experts.3.gate_proj.weight"), shards.fp8("model.layers.1.mlp.experts.3.up_proj.weight")
    assert torch.equal(experts.gate_up_proj[3].view(torch.uint8), torch.cat([gate[0], up[0]]).view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale[3], torch.cat([gate[1], up[1]]))
    q_proj = served.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, FP8Linear) == (mode == "all")
    # served in bf16 instead: dequantised per tensor, and hashed the same as the FP8-served twin
    dequantised, digest_bf16 = build_from_shards(CFG, shards, torch.bfloat16, "cpu")
    assert digest_bf16 == digest and fp8_mode_of(dequantised) == "off"
    source = load_checkpoint(ckpts["off"], torch.bfloat16)
    ref = _logits(source)
    # the yardstick: the bf16 source quantised on arrival, as engines served it before FP8 checkpoints loaded
    # (relative L2 of the logits, measured: experts 0.013, all 0.076; the FP8 checkpoint: 0.013, 0.074)
    baseline = float((_logits(apply_fp8_mode(load_checkpoint(ckpts["off"], torch.bfloat16), mode)) - ref).norm() / ref.norm())
    for model in (served, dequantised):
        err = float((_logits(model) - ref).norm() / ref.norm())
        assert err <= 1.2 * baseline and err < 0.1, (err, baseline)


def test_a_bf16_checkpoint_served_in_fp8_is_quantised_per_tensor_as_the_full_model_would_be(ckpts):
    shards = CheckpointShards(ckpts["off"])
    assert shards.quantization is None and shards.fp8_mode() == "off"
    streamed, digest = build_from_shards(CFG, shards, torch.bfloat16, "cpu", lambda m: apply_fp8_mode(m, "all"))
    whole = apply_fp8_mode(load_checkpoint(ckpts["off"], torch.bfloat16), "all")  # the old way: bf16 first
    for (name, a), (_, b) in zip(sorted(streamed.named_buffers()), sorted(whole.named_buffers())):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b), name
    plain, plain_digest = build_from_shards(CFG, shards, torch.bfloat16, "cpu")
    assert plain_digest == digest  # hashed as read (bf16), before quantisation
    from node.model.spec import weights_hash
    from node.model.fill import checkpoint_digest

    # one hash, however it is taken: of a built model, while filling, or by the trainer's rank 0 from the files
    assert weights_hash(plain) == plain_digest == checkpoint_digest(shards, CFG, torch.bfloat16)
    # tensors hashed on several threads arrive in any order: the same hash
    assert checkpoint_digest(shards, CFG, torch.bfloat16, threads=1) == checkpoint_digest(shards, CFG, torch.bfloat16,
                                                                                          threads=3) == plain_digest
    assert checkpoint_digest(CheckpointShards(ckpts["all"]), CFG, torch.bfloat16) == weights_hash(
        build_from_shards(CFG, CheckpointShards(ckpts["all"]), torch.bfloat16, "cpu")[0])
    # an FP8 checkpoint served in FP8: its e4m3 bytes go in as stored, and the pin (hashed on the fill's pool, of
    # the value in the run's dtype) is the same one
    assert build_from_shards(CFG, CheckpointShards(ckpts["all"]), torch.bfloat16, "cpu",
                             lambda m: apply_fp8_mode(m, "all"))[1] == checkpoint_digest(
        CheckpointShards(ckpts["all"]), CFG, torch.bfloat16, threads=1)


def _rewrite(directory, name, tensor):
    """Replace one tensor of the shard that holds it."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    path = directory / index["weight_map"][name]
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_fp8_checkpoints_are_refused_from_their_headers(ckpts, tmp_path):
    scale = "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"
    wrong = _copy(ckpts["experts"], tmp_path / "shape")
    _rewrite(wrong, scale, torch.ones(3, 1))
    with pytest.raises(MismatchedScales, match=r"down_proj.weight_scale_inv: shape \(3, 1\) does not fit"):
        CheckpointShards(wrong)
    f64 = _copy(ckpts["experts"], tmp_path / "dtype")
    _rewrite(f64, scale, torch.ones(2, 1, dtype=torch.float64))
    with pytest.raises(MismatchedScales, match="dtype F64, expected float32"):
        CheckpointShards(f64)
    config = json.loads((ckpts["experts"] / "config.json").read_text())
    for qc, says in [({"quant_method": "gptq", "bits": 4}, "'gptq' is not loaded"),
                     ({"quant_method": "awq", "bits": 4}, "'awq' is not loaded"),
                     ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not loaded"),
                     ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
                     ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'")]:
        other = _copy(ckpts["experts"], tmp_path / qc["quant_method"] / str(len(says)))
        (other / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(UnsupportedQuantization, match=says):
            CheckpointShards(other)
    missing = _copy(ckpts["off"], tmp_path / "missing")
    shard = sorted(missing.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(MissingModelFile, match=shard.name):
        CheckpointShards(missing)
    unsaid = _copy(ckpts["experts"], tmp_path / "unsaid")
    (unsaid / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(InvalidCheckpoint, match="FP8 scales but config.json has no quantization_config"):
        CheckpointShards(unsaid)


def test_a_checkpoint_the_spec_hash_does_not_match_is_refused(ckpts, tmp_path):
    from node.model.errors import WeightsHashMismatch
    from node.model.pretrained import PretrainedUnavailable, smollm2_dir
    from node.model.spec import load_model
    from protocol.model_spec import ModelSpec

    try:
        tok = smollm2_dir()
    except PretrainedUnavailable as exc:
        pytest.skip(str(exc))
    big_vocab = CFG.model_copy(update={"vocab_size": 49152})
    directory = write_random_shards(big_vocab, tmp_path / "m", "experts", tokenizer_from=tok)
    honest = load_model(ModelSpec(source=str(directory)))
    assert honest.model.model.embed_tokens.weight.dtype == torch.bfloat16  # a real checkpoint's default
    assert load_model(ModelSpec(source=str(directory), weights_hash=honest.weights_hash)).weights_hash == honest.weights_hash
    with pytest.raises(WeightsHashMismatch, match="blake3:0000"):
        load_model(ModelSpec(source=str(directory), weights_hash="blake3:" + "0" * 64))


def test_join_refuses_a_broken_or_foreign_checkpoint_in_one_line_with_exit_2(ckpts, tmp_path, capsys):
    from node.cli import main
    from protocol.identity import NodeKey
    from protocol.messages import RunSpec
    from protocol.model_spec import ModelSpec

    gptq = _copy(ckpts["off"], tmp_path / "gptq")
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    scales = _copy(ckpts["all"], tmp_path / "scales")
    _rewrite(scales, "model.layers.1.self_attn.o_proj.weight_scale_inv", torch.ones(1, 1))
    gone = _copy(ckpts["off"], tmp_path / "gone")
    sorted(gone.glob("model-*.safetensors"))[0].unlink()
    coord = NodeKey.generate().peer_id
    for directory, says in [(gptq, "quant_method 'gptq' is not loaded"), (scales, "o_proj.weight_scale_inv: shape"),
                            (gone, "is missing (listed in model.safetensors.index.json)")]:
        for role in ("inference", "validator", "trainer"):
            spec = RunSpec(run_id="r", coordinator=coord, environment="reverse", model=ModelSpec(source=str(directory)))
            (tmp_path / "spec.json").write_text(spec.model_dump_json())
            argv = ["join", "--role", role, "--spec", str(tmp_path / "spec.json"), "--bootstrap",
                    f"/ip4/127.0.0.1/tcp/1/p2p/{coord}", "--workdir", str(tmp_path / role)]
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_a_run_of_an_fp8_checkpoint_serves_it_as_stored_unless_the_run_toml_says_otherwise(ckpts):
    from node.run_config import RunConfig
    from protocol.identity import NodeKey

    trainer = NodeKey.from_seed(b"t" * 32).peer_id
    base = {"run_id": "r", "trainer": trainer, "verification_rate": 0.0}
    for source, table, fp8 in [(ckpts["all"], {}, "all"), (ckpts["experts"], {}, "experts"), (ckpts["off"], {}, "off"),
                               (ckpts["all"], {"fp8": "off"}, "off"), (ckpts["all"], {"fp8": "experts"}, "experts")]:
        cfg = RunConfig.model_validate({**base, "model": {"source": str(source), **table}})
        assert cfg.run_spec(trainer).model.fp8 == fp8, (source.name, table)


def test_model_pin_prints_the_model_table_whose_hash_every_member_checks_version_0_against(ckpts, tmp_path, capfd):
    import shutil
    import tomllib

    from node.cli import main
    from protocol.model_spec import ModelSpec

    assert main(["model", "pin", str(ckpts["all"]), "--max-seq-len", "64"]) == 0
    table = tomllib.loads(capfd.readouterr().out)["model"]
    spec = ModelSpec(**table)
    assert (spec.source, spec.dtype, spec.fp8, spec.max_seq_len) == (str(ckpts["all"]), "bfloat16", "all", 64)
    # what a member computes while it loads version 0 (and refuses to start on, if it differs)
    assert spec.weights_hash == build_from_shards(CFG, CheckpointShards(ckpts["all"]), torch.bfloat16, "cpu")[1]
    assert main(["model", "pin", str(ckpts["off"]), "--dtype", "float32"]) == 0
    plain = ModelSpec(**tomllib.loads(capfd.readouterr().out)["model"])
    assert plain.fp8 == "off" and plain.dtype == "float32"
    assert plain.weights_hash == build_from_shards(CFG, CheckpointShards(ckpts["off"]), torch.float32, "cpu")[1]
    broken = tmp_path / "broken"  # a shard the index lists is gone: one line, exit 2, nothing hashed
    shutil.copytree(ckpts["off"], broken)
    gone = sorted(broken.glob("model-*.safetensors"))[0]
    gone.unlink()
    assert main(["model", "pin", str(broken)]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("primerl-node model: error:") and gone.name in err and len(err.splitlines()) == 1, err
    assert main(["model", "pin", "tiny-moe"]) == 2
    assert "nothing to pin" in capfd.readouterr().err
