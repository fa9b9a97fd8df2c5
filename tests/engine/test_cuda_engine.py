"""CudaEngine: the same completions as `Engine`, on the CPU (eager, torch reference kernels) and,
where CUDA is present, with graph-captured steps (tests marked gpu)."""

import copy

import pytest
import torch

from node.engine import Engine, Request, SamplingParams
from node.engine.cuda_engine import CudaEngine, WeightsMismatch, buckets_for
from node.model import CausalLM, ModelConfig
from node.model.checkpoint import state_dict_to_hf


def tiny(seed=0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=32, head_dim=8, **kw)).eval()


def prompts(n, seed=0, lo=2, hi=9):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def requests(n, seed=0, temperature=0.9, top_p=1.0):
    return [Request(str(i), p, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=3 + i % 9, seed=i))
            for i, p in enumerate(prompts(n, seed))]


def assert_same(a, b, lp_tol=1e-4):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= lp_tol
        if x.hidden is not None:
            assert torch.allclose(x.hidden.cpu().float(), y.hidden.cpu().float(), atol=1e-4)
        if x.routed_experts is not None:
            assert torch.equal(x.routed_experts.sort(-1).values, y.routed_experts.sort(-1).values)


@pytest.mark.parametrize("temperature,top_p", [(0.9, 1.0), (0.0, 1.0), (1.0, 0.8)])
def test_matches_engine_token_for_token(temperature, top_p):
    model = tiny()
    reqs = requests(13, temperature=temperature, top_p=top_p)  # more than slots: joins as others leave
    ref = Engine(copy.deepcopy(model), max_batch=5, eos_id=-1, capture_hidden=True, capture_experts=True).generate(reqs)
    got = CudaEngine(copy.deepcopy(model), max_batch=5, eos_id=-1, capture_hidden=True,
                     capture_experts=True).generate(reqs)
    assert_same(got, ref)
    assert [len(c.token_ids) for c in got] == [3 + i % 9 for i in range(13)]


def test_chunked_prefill_matches_one_pass():
    model = tiny(1)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=6, seed=i)) for i, p in enumerate(prompts(5, 3, 20, 40))]
    ref = Engine(copy.deepcopy(model), max_batch=8, eos_id=-1, capture_hidden=True).generate(reqs)
    got = CudaEngine(copy.deepcopy(model), max_batch=8, eos_id=-1, capture_hidden=True,
                     prefill_tokens=16).generate(reqs)  # chunks of <= 16 tokens, several per prompt
    assert_same(got, ref)


def test_packed_prefill_matches_padded_groups_and_writes_each_prompt_to_its_own_slot():
    # prompts of unequal lengths admitted together: packed end to end (the default) and right-padded (the peer)
    model = tiny(2)
    reqs = [Request(str(i), p, SamplingParams(temperature=0.9, max_new_tokens=5, seed=i))
            for i, p in enumerate(prompts(9, 4, 2, 30))]
    runs = {pack: CudaEngine(copy.deepcopy(model), max_batch=9, eos_id=-1, capture_hidden=True, capture_experts=True,
                             pack_prefill=pack) for pack in (True, False)}
    got = {pack: engine.generate(reqs) for pack, engine in runs.items()}
    assert_same(got[True], got[False])
    assert len({len(r.prompt_ids) for r in reqs}) > 3  # the padded engine padded them
    # every slot's cached keys, up to its last written position, are the same both ways (a packed row written to
    # another slot or position would not be; past it the padded engine leaves its padding's keys)
    for slot in range(9):
        n = int(runs[True].state.pos[slot])
        assert n == int(runs[False].state.pos[slot]) and n > 2
        for layer in range(model.config.num_hidden_layers):
            assert torch.allclose(runs[True].cache.k[layer][slot, :n], runs[False].cache.k[layer][slot, :n], atol=1e-5)
            assert torch.allclose(runs[True].cache.v[layer][slot, :n], runs[False].cache.v[layer][slot, :n], atol=1e-5)


def test_eos_and_stop_and_length_limit():
    model = tiny(2)
    reqs = requests(6)
    ref = Engine(copy.deepcopy(model), max_batch=4, eos_id=7, max_seq_len=12).generate(reqs)
    got = CudaEngine(copy.deepcopy(model), max_batch=4, eos_id=7, max_seq_len=12).generate(reqs)
    assert_same(got, ref)


def test_weight_swap_between_steps_in_place_and_versions_recorded():
    model, newer = tiny(3), tiny(4)
    eng = CudaEngine(copy.deepcopy(model), max_batch=4, eos_id=-1, version=1)
    ptrs = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    eng.add_request(Request("a", [5, 6, 7], SamplingParams(max_new_tokens=10, seed=1)))
    for _ in range(3):
        eng.step()
    eng.load_weights(state_dict_to_hf(newer), version=2)
    done = []
    while eng.has_work():
        done += eng.step()
    assert done[0].versions == [1, 1, 1] + [2] * 7
    assert {n: p.data_ptr() for n, p in eng.model.named_parameters()} == ptrs
    ref = Engine(copy.deepcopy(newer), max_batch=4, eos_id=-1).generate(
        [Request("b", [9, 10], SamplingParams(max_new_tokens=4, seed=3))])
    assert eng.generate([Request("b", [9, 10], SamplingParams(max_new_tokens=4, seed=3))])[0].token_ids == ref[0].token_ids


def test_mismatched_version_refused_and_old_one_keeps_serving():
    model = tiny(5)
    eng = CudaEngine(copy.deepcopy(model), max_batch=4, eos_id=-1, version=3)
    wrong = state_dict_to_hf(CausalLM(ModelConfig(vocab_size=64, hidden_size=48, moe_intermediate_size=32, head_dim=8)))
    with pytest.raises(WeightsMismatch, match="shape"):
        eng.load_weights(wrong, version=4)
    partial = state_dict_to_hf(model)
    partial.pop("lm_head.weight")
    with pytest.raises(WeightsMismatch, match="missing"):
        eng.load_weights(partial, version=4)
    c = eng.generate([Request("x", [3, 4], SamplingParams(max_new_tokens=3))])[0]
    assert c.versions == [3, 3, 3]
    ref = Engine(copy.deepcopy(model), max_batch=4, eos_id=-1).generate([Request("x", [3, 4], SamplingParams(max_new_tokens=3))])
    assert c.token_ids == ref[0].token_ids


def test_buckets():
    assert buckets_for(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert buckets_for(5) == [1, 2, 4, 5]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.0, 1.0), (0.7, 0.9)])
def test_verify_prefill_re_derives_the_engines_tokens_logprobs_hidden_routes(temperature, top_p):
    model = tiny(7)
    eng = CudaEngine(copy.deepcopy(model), max_batch=4, eos_id=-1, capture_hidden=True, capture_experts=True)
    reqs = requests(7, seed=2, temperature=temperature, top_p=top_p)
    done = eng.generate(reqs)
    checks = eng.verify_prefill([c.prompt_ids + c.token_ids for c in done], [len(c.prompt_ids) for c in done],
                                [r.params for r in reqs], with_routes=True)
    for c, v in zip(done, checks):
        assert v.tokens.tolist() == c.token_ids
        assert (v.logprobs - torch.tensor(c.logprobs)).abs().max() <= 1e-4
        assert torch.allclose(v.hidden.float(), c.hidden.float(), atol=1e-4)
        assert torch.equal(v.routes.long().sort(-1).values, c.routed_experts.sort(-1).values)
    # a claimed token the rule would not pick shows up as a differing replay token
    bad = list(done[0].prompt_ids + done[0].token_ids)
    bad[-1] = (bad[-1] + 1) % 64
    v = eng.verify_prefill([bad], [len(done[0].prompt_ids)], [reqs[0].params])[0]
    assert v.tokens.tolist()[-1] != bad[-1]


def test_device_and_dtype_arguments_move_the_model():
    eng = CudaEngine(tiny(8).to(torch.float64), max_batch=2, eos_id=-1, device="cpu", dtype=torch.float32)
    assert next(eng.model.parameters()).dtype == torch.float32 and eng.device.type == "cpu"
    assert not eng.use_graphs
    with pytest.raises(ValueError, match="CUDA graphs"):
        CudaEngine(tiny(8), max_batch=2, use_graphs=True)
    with pytest.raises(ValueError, match="fp8"):
        CudaEngine(tiny(8), max_batch=2, fp8="sometimes")
