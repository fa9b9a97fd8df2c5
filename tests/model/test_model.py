import json

import pytest
import torch

from node.model import CausalLM, InvalidCheckpoint, ModelConfig, load_checkpoint, save_checkpoint
from node.model.cache import KVCache
from node.model.config import InvalidModelConfig
from node.model.errors import UnsupportedModelType

transformers = pytest.importorskip("transformers")


def moe_config(**kw) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=64, moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=[1])
    base.update(kw)
    return ModelConfig(**base)


def test_checkpoint_loads_in_transformers_with_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(moe_config()).eval()
    save_checkpoint(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 17))
    with torch.no_grad():
        diff = (model(ids).logits - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_dense_qwen3_checkpoint_matches_transformers(tmp_path):
    torch.manual_seed(1)
    model = CausalLM(moe_config(model_type="qwen3", num_experts=0, mlp_only_layers=[])).eval()
    save_checkpoint(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (3, 11))
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_checkpoint_round_trip_is_exact(tmp_path):
    model = CausalLM(moe_config())
    save_checkpoint(model, tmp_path)
    again = load_checkpoint(tmp_path)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_kv_cached_decode_equals_full_forward():
    torch.manual_seed(2)
    model = CausalLM(moe_config()).eval()
    ids = torch.randint(0, 96, (3, 12))
    cache = KVCache(3, 5, 2, 32, 16)
    slots = torch.tensor([4, 0, 2])
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :7], torch.arange(7).expand(3, 7), cache, slots).logits
        steps = [model(ids[:, i : i + 1], torch.full((3, 1), i), cache, slots).logits for i in range(7, 12)]
    assert (first - full[:, :7]).abs().max() <= 1e-5
    assert (torch.cat(steps, 1) - full[:, 7:]).abs().max() <= 1e-5


def test_router_routes_top_k_and_reports_balancing_loss():
    model = CausalLM(moe_config())
    out = model(torch.randint(0, 96, (2, 9)))
    assert out.routed_experts.shape == (2, 9, 2, 2)  # two MoE layers (layer 1 dense), top-2
    assert out.routed_experts.max() < 4 and out.aux_loss.item() >= 0.99  # >= 1 at perfect balance (E*sum f*P)
    out.aux_loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_garbage_weights_file_fails_clearly(tmp_path):
    save_checkpoint(CausalLM(moe_config()), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(InvalidCheckpoint):
        load_checkpoint(tmp_path)


def test_wrong_shapes_fail_clearly(tmp_path):
    save_checkpoint(CausalLM(moe_config(hidden_size=32, head_dim=8)), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 64
    cfg["head_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidCheckpoint, match="shape"):
        load_checkpoint(tmp_path)


def test_missing_expert_and_bad_config_fail_clearly(tmp_path):
    from safetensors.torch import load_file, save_file

    save_checkpoint(CausalLM(moe_config()), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidCheckpoint, match="expert"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"num_attention_heads": 3, "num_key_value_heads": 2}')
    with pytest.raises(UnsupportedModelType, match="model_type None"):
        load_checkpoint(tmp_path)
    cfg = CausalLM(moe_config()).config.to_hf_dict()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 3}))
    with pytest.raises(InvalidModelConfig, match="(?s)config.json.*num_key_value_heads must divide"):
        load_checkpoint(tmp_path)


def _moe_block(dtype: torch.dtype, device: str = "cpu"):
    from node.model.moe import MoEBlock

    torch.manual_seed(0)
    block = MoEBlock(256, 128, 16, 4, True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    return block.to(device=device, dtype=dtype)


def test_the_moe_combine_sums_each_tokens_choices_as_the_per_token_sum_does(monkeypatch):
    """Each token's output is the router-weighted sum of its k experts' outputs, in a fixed order (a gather back to
    token order, then a sum over k): the same as adding them one by one, and as the index_add_ it replaced."""
    block = _moe_block(torch.float32)
    x = torch.randn(300, 256)
    with torch.no_grad():
        got, routing = block(x)
        x_sorted, counts, order = block.dispatch(x, routing)
        y = block.experts(x_sorted, counts) * routing.weights.reshape(-1)[order].unsqueeze(-1)
        want = torch.zeros_like(got)
        for row, slot in enumerate(order.tolist()):  # row `row` of the sorted outputs is token slot // k's choice
            want[slot // block.top_k] += y[row]
        monkeypatch.setenv("PRIMERL_MOE_COMBINE", "index_add")
        before, _ = block(x)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5) and torch.allclose(got, before, atol=1e-6, rtol=1e-5)
    assert got.abs().max() > 0.1  # not a block of zeros


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_moe_combine_is_repeatable_on_a_gpu():
    """bf16 on a GPU, 8,192 tokens over 16 experts: ten forwards give the same bits (the combine writes each row
    once and sums in a fixed order; no atomics)."""
    block = _moe_block(torch.bfloat16, "cuda")
    x = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        first, _ = block(x)
        assert all(torch.equal(block(x)[0], first) for _ in range(10))
