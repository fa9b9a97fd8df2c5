"""torchrun worker for test_ep_engine.py: EPEngine across the world vs the one-process Engine.

Every rank serves different requests (rank 0 more and longer ones, so other ranks go idle and must
keep joining the all-to-alls). Rank 0 writes what it saw, gathered from all ranks, to argv[1].
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from node.engine.engine import Engine, Request
from node.engine.ep import EPEngine
from node.engine.sampling import SamplingParams
from node.model.checkpoint import InvalidCheckpoint, state_dict_to_hf
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.rl.parallel.dims import shutdown_distributed


def model(seed: int) -> CausalLM:
    cfg = ModelConfig(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    return CausalLM(cfg)


def requests(rank: int) -> list[Request]:
    g = torch.Generator().manual_seed(rank)
    n = 3 if rank == 0 else 1
    return [Request(f"r{rank}-{i}", torch.randint(3, 96, (5 + i,), generator=g).tolist(),
                    SamplingParams(temperature=0.8 if i % 2 else 0.0, max_new_tokens=12 if rank == 0 else 4, seed=i))
            for i in range(n)]


def tokens(completions) -> list:
    return [(c.token_ids, [round(x, 4) for x in c.logprobs], c.versions) for c in completions]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kw = dict(max_batch=4, max_seq_len=64, eos_id=-1)
    new = state_dict_to_hf(model(1))
    ref = Engine(model(0), **kw)
    want = [tokens(ref.generate(requests(rank)))]
    ref.load_weights(new, version=1)
    want.append(tokens(ref.generate(requests(rank))))

    ep = EPEngine(model(0), **kw)
    local_experts = ep.model.model.layers[0].mlp.experts.num_experts
    got = [tokens(ep.generate(requests(rank)))]
    bad = dict(new)
    name = next(k for k in bad if "experts" in k)
    bad[name] = bad[name][:-1]
    ep.load_weights(bad, version=9)
    try:
        ep.step()
        rejected = None
    except InvalidCheckpoint as exc:
        rejected = str(exc)
    got.append(tokens(ep.generate(requests(rank))))  # still the version-0 weights
    ep.load_weights(new, version=1)
    got.append(tokens(ep.generate(requests(rank))))

    mine = {"rank": rank, "want": want, "got": got, "rejected": rejected, "local_experts": local_experts}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(everyone, f)
    shutdown_distributed()  # no rank leaves while another still talks to it (gloo aborts otherwise)
    # Skip the interpreter's finalization: gloo's worker threads can still hold work objects whose tensors
    # are freed there, and that aborts the process after everything was done ("terminate called without
    # an active exception", exit -6: seen once in a fresh-clone suite at load 4-6). The result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
