import copy

import torch

from node.engine import Engine, Request, SamplingParams
from node.engine.sampling import sample
from node.model import CausalLM, ModelConfig
from node.model.checkpoint import state_dict_to_hf
from node.rl.loss import token_logprobs


def tiny(seed=0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=32, head_dim=8, **kw)).eval()


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def full_forward_logprobs(model, c, temperature=1.0):
    seq = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        logits = model(seq[:, :-1]).logits
    lp = token_logprobs(logits, seq[:, 1:], temperature)[0]
    return lp[len(c.prompt_ids) - 1 :]


def test_continuously_batched_logprobs_equal_full_forward():
    model = tiny()
    engine = Engine(model, max_batch=6, eos_id=-1)  # more requests than slots: they join as others leave
    reqs = [Request(str(i), p, SamplingParams(temperature=0.9, max_new_tokens=5 + i % 7, seed=i)) for i, p in enumerate(prompts(14))]
    for c in engine.generate(reqs):
        assert len(c.token_ids) == int(c.request_id) % 7 + 5
        diff = (full_forward_logprobs(model, c, 0.9) - torch.tensor(c.logprobs)).abs().max()
        assert diff <= 1e-4


def test_request_joining_a_running_batch_gets_the_same_tokens_as_alone():
    model = tiny(1)
    p = prompts(1, seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=1234)
    alone = Engine(model, max_batch=4, eos_id=-1).generate([Request("x", p, params)])[0]
    engine = Engine(model, max_batch=4, eos_id=-1)
    for i, q in enumerate(prompts(3, seed=9)):
        engine.add_request(Request(f"other{i}", q, SamplingParams(max_new_tokens=20, seed=i)))
    for _ in range(4):
        engine.step()
    engine.add_request(Request("x", p, params))
    joined = None
    while engine.has_work():
        joined = next((c for c in engine.step() if c.request_id == "x"), joined)
    assert joined.token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(joined.logprobs, alone.logprobs)) <= 1e-4


def test_weight_swap_mid_generation_records_per_token_versions():
    model = tiny(2)
    newer = tiny(3)
    engine = Engine(copy.deepcopy(model), max_batch=2, eos_id=-1)
    engine.add_request(Request("a", [5, 6, 7], SamplingParams(max_new_tokens=10, seed=0)))
    for _ in range(4):
        assert engine.step() == []
    engine.load_weights(state_dict_to_hf(newer), version=1)
    done = []
    while engine.has_work():
        done += engine.step()
    c = done[0]
    assert c.versions == [0] * 4 + [1] * 6
    # the tokens after the swap were computed by the new weights on top of the old KV cache
    seq = torch.tensor([c.prompt_ids + c.token_ids])
    assert engine.version == 1
    with torch.no_grad():
        lp_old = token_logprobs(model(seq[:, :-1]).logits, seq[:, 1:])[0, 2:]
    assert torch.allclose(lp_old[:4], torch.tensor(c.logprobs[:4]), atol=1e-4)
    assert not torch.allclose(lp_old[4:], torch.tensor(c.logprobs[4:]), atol=1e-3)


def test_a_newer_pending_version_replaces_an_older_one_not_yet_applied():
    reqs = [Request(str(i), p, SamplingParams(temperature=0.8, max_new_tokens=6, seed=i)) for i, p in enumerate(prompts(3))]
    want = Engine(tiny(5), max_batch=4, eos_id=-1, version=2).generate(reqs)
    engine = Engine(tiny(0), max_batch=4, eos_id=-1)
    engine.load_weights(state_dict_to_hf(tiny(4)), version=1)
    engine.load_weights(state_dict_to_hf(tiny(5)), version=2)  # before any step applied version 1
    got = engine.generate(reqs)
    assert [c.versions for c in got] == [[2] * 6] * 3
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs)) <= 1e-5


def test_stop_conditions_eos_stop_token_stop_string_and_length():
    model = tiny(4)
    base = Engine(model, max_batch=4, eos_id=-1).generate([Request("r", [3, 4], SamplingParams(max_new_tokens=8, seed=7))])[0]
    third = base.token_ids[2]
    for eos, params, reason, n in [
        (third, SamplingParams(max_new_tokens=8, seed=7), "eos", 3),
        (-1, SamplingParams(max_new_tokens=8, seed=7, stop_token_ids=(third,)), "stop", 3),
        (-1, SamplingParams(max_new_tokens=8, seed=7, stop_strings=(f"<{third}>",)), "stop", 3),
        (-1, SamplingParams(max_new_tokens=5, seed=7), "length", 5),
    ]:
        engine = Engine(model, max_batch=2, eos_id=eos, decode=lambda ids: "".join(f"<{i}>" for i in ids))
        c = engine.generate([Request("r", [3, 4], params)])[0]
        assert (c.finish_reason, c.token_ids) == (reason, base.token_ids[:n])


def test_sampling_is_reproducible_from_seed_and_position_and_respects_top_p():
    logits = torch.randn(3, 50)
    params = [SamplingParams(seed=s, top_p=0.5) for s in (1, 2, 3)]
    a, b = sample(logits, params, [4, 4, 4]), sample(logits, params, [4, 4, 4])
    assert torch.equal(a.tokens, b.tokens)
    probs = torch.softmax(logits, -1)
    for row, tok in enumerate(a.tokens):
        sorted_p, order = probs[row].sort(descending=True)
        rank = (order == tok).nonzero().item()
        assert sorted_p[:rank].sum() < 0.5  # inside the nucleus
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 3, [0, 0, 0])
    assert torch.equal(greedy.tokens, logits.argmax(-1))


def test_hidden_states_and_routed_experts_match_a_prefill_of_the_completion():
    model = tiny(5)
    engine = Engine(model, max_batch=3, eos_id=-1, capture_hidden=True, capture_experts=True)
    for c in engine.generate([Request(str(i), p, SamplingParams(max_new_tokens=6, seed=i)) for i, p in enumerate(prompts(3))]):
        seq = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            out = model(seq[:, :-1])
        assert (out.hidden[0, len(c.prompt_ids) - 1 :] - c.hidden).abs().max() <= 1e-4
        assert torch.equal(out.routed_experts[0], c.routed_experts)
