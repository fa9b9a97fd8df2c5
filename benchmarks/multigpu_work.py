"""The measurements of `benchmarks.multigpu`, one per section, each run in its own torchrun world
(`python -m torch.distributed.run --nproc-per-node N -m benchmarks.multigpu_work SECTION ...`).
Rank 0 writes the section's figures as JSON to `--result`. NCCL on GPUs (bf16), gloo on CPU
(float32, tiny shapes: that is how the tests run it).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from node.model.config import ModelConfig
from node.rl.parallel.dims import shutdown_distributed

H200_BF16_PEAK = 989.4e12
"""Dense bf16 FLOP/s of one H100/H200 SXM by NVIDIA's datasheet (MFU denominator, as usual)."""


def shapes(tiny: bool, layers: int) -> ModelConfig:
    if tiny:
        return ModelConfig(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=512)
    from benchmarks.fp8_common import qwen3_30b_a3b_config

    return qwen3_30b_a3b_config(layers)


def setup() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return torch.device("cuda", local), torch.bfloat16
    dist.init_process_group("gloo")
    return torch.device("cpu"), torch.float32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median wall seconds of fn() (synchronised), the slowest rank's median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    med = torch.tensor(sorted(times)[len(times) // 2], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    m = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return round(float(m), 2)


# ---- expert-parallel MoE layer ---------------------------------------------------------------
def moe(args, device, dtype) -> dict:
    from node.model.moe import MoEBlock
    from node.distributed.experts import shard_experts

    cfg, n = shapes(args.tiny, 1), dist.get_world_size()
    torch.manual_seed(0)
    block = MoEBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    block = block.to(device, dtype)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(args.tokens, cfg.hidden_size, generator=g).to(device, dtype)
    grad = torch.randn(args.tokens, cfg.hidden_size, generator=g).to(device, dtype)
    with torch.no_grad():
        ref = block(x)[0].float()  # all experts here: the one-process answer for this rank's tokens
    if n > 1:
        shard_experts(block, dist.get_rank(), n, dist.group.WORLD)
        block.experts.to(dtype)  # shard_experts builds the slice in the default dtype
    with torch.no_grad():
        out = block(x)[0].float()
    err = torch.tensor(float((out - ref).norm() / ref.norm()), device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    xg = x.detach().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            block(x)

    def fwd_bwd():
        y, _ = block(xg)
        y.backward(grad)

    t_f = timed(fwd, device, args.iters, 2)
    t_fb = timed(fwd_bwd, device, args.iters, 2)
    flops = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok * args.tokens
    return {"gpus": n, "tokens_per_gpu": args.tokens, "experts_per_gpu": cfg.num_experts // n,
            "fwd_s": t_f, "fwd_bwd_s": t_fb, "fwd_tok_s": n * args.tokens / t_f, "fwd_bwd_tok_s": n * args.tokens / t_fb,
            "expert_tflops_per_gpu_fwd_bwd": 3 * flops / t_fb / 1e12, "rel_err_vs_one_process": float(err),
            "backend": "nccl all_to_all_single" if device.type == "cuda" else "gloo", "peak_mem_gib": peak_memory_gib(device)}


# ---- distributed trainer (FSDP2 + EP) ----------------------------------------------------------
def train_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Forward + backward FLOPs per token (6 x active matmul parameters, plus causal attention)."""
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok + cfg.hidden_size * cfg.num_experts
    per_layer = 2 * (attn + mlp) + 2 * 2 * (seq / 2) * cfg.num_attention_heads * cfg.head_dim
    return 3 * (cfg.num_hidden_layers * per_layer + 2 * cfg.hidden_size * cfg.vocab_size)


def _clip_on_device(trainer, max_norm: float) -> float:
    """`DistributedTrainer.clip_grad_norm` with its two accumulators on the gradients' device
    (the original keeps them on the CPU, which NCCL cannot all-reduce). Same arithmetic."""
    from torch.distributed.tensor import DTensor

    from node.rl.parallel.apply import is_expert_param

    g, dims = trainer.groups, trainer.groups.dims
    dev = next(trainer.model.parameters()).device
    dense = torch.zeros((), dtype=torch.float64, device=dev)
    expert = torch.zeros((), dtype=torch.float64, device=dev)
    for name, p in trainer.model.named_parameters():
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        sq = local.double().pow(2).sum()
        if is_expert_param(name) and dims.ep > 1:
            expert += sq
        else:
            dense += sq
    if dims.fsdp:
        dist.all_reduce(dense, group=g.world_mesh.get_group())
        dist.all_reduce(expert, group=g.expert_mesh.get_group())
    if dims.ep > 1:
        dist.all_reduce(expert, group=g.ep_group)
    norm = float((dense + expert).sqrt())
    if max_norm / (norm + 1e-6) < 1.0:
        torch._foreach_mul_([p.grad for p in trainer.model.parameters() if p.grad is not None], max_norm / (norm + 1e-6))
    return norm


def trainer(args, device, dtype) -> dict:
    from node.model.qwen3_moe import CausalLM
    from node.rl.batch import TrainBatch
    from node.rl.parallel import DistributedTrainer, ParallelDims, ParallelGroups, parallelize, shard_batch
    from node.rl.parallel.trainer import LocalBatch
    from node.rl.trainer import TrainerConfig

    n = dist.get_world_size()
    cfg = shapes(args.tiny, args.layers)
    dims = ParallelDims(dp=n, ep=n if cfg.num_experts % n == 0 else 1)
    groups = ParallelGroups.build(dims, device.type)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = CausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    model = parallelize(model, groups)
    torch.set_default_dtype(torch.float32)
    tcfg = TrainerConfig(router_replay=False)
    tr = DistributedTrainer(model, groups, tcfg)
    rows, seq = args.rows * n, args.seq
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (rows, seq + 1), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.bool)
    batch = TrainBatch(ids[:, :-1], ids[:, 1:], mask, torch.full((rows, seq), -float(torch.log(torch.tensor(cfg.vocab_size)))),
                       torch.randn(rows, 1, generator=g).expand(rows, seq).contiguous(), None)
    local = shard_batch(batch, groups)
    b = local.batch
    local = LocalBatch(TrainBatch(b.input_ids.to(device), b.targets.to(device), b.loss_mask.to(device),
                                  b.inference_logprobs.to(device), b.advantages.to(device), None), local.positions.to(device))
    losses = []

    def step():
        tr.optimizer.zero_grad(set_to_none=True)
        losses.append(tr.backward(local))
        _clip_on_device(tr, tcfg.max_grad_norm)
        tr.optimizer.step()

    t = timed(step, device, args.iters, 2)
    tokens = rows * seq
    flops = train_flops_per_token(cfg, seq) * tokens
    return {"gpus": n, "layers": cfg.num_hidden_layers, "params": params, "layout": dims.model_dump(),
            "tokens_per_step": tokens, "tokens_per_gpu": tokens // n, "seq": seq, "step_s": t,
            "tok_s": tokens / t, "model_tflop_per_step": flops / 1e12, "mfu": flops / t / (n * H200_BF16_PEAK),
            "losses": [round(x, 5) for x in losses], "peak_mem_gib": peak_memory_gib(device),
            "optimizer": "AdamW (bf16 states, foreach=False)" if device.type == "cuda" else "AdamW"}


# ---- built-in engine with expert parallelism -----------------------------------------------------
def engine(args, device, dtype) -> dict:
    from node.engine.engine import Engine, Request
    from node.engine.ep import EPEngine
    from node.engine.sampling import SamplingParams
    from node.model.qwen3_moe import CausalLM

    n, rank = dist.get_world_size(), dist.get_rank()
    cfg = shapes(args.tiny, args.layers)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = CausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    max_batch = max(args.batches)
    kw = dict(max_batch=max_batch, max_seq_len=args.prompt + args.new_tokens + 1, eos_id=-1)
    eng = EPEngine(model, **kw) if n > 1 else Engine(model, **kw)
    forward_s = [0.0]
    plain_forward = eng.model.forward

    def timed_forward(*a, **k):  # the part expert parallelism changes, without the sampler
        sync(device)
        t0 = time.perf_counter()
        out = plain_forward(*a, **k)
        sync(device)
        forward_s[0] += time.perf_counter() - t0
        return out

    eng.model.forward = timed_forward
    if args.greedy_sampler:
        import node.engine.engine as engine_module

        engine_module.sample = greedy_sample
    g = torch.Generator().manual_seed(7 + rank)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)

    def requests(batch: int, tag: str) -> list:
        return [Request(f"{tag}-{rank}-{i}", torch.randint(3, cfg.vocab_size, (args.prompt,), generator=g).tolist(), params)
                for i in range(batch)]

    def run(batch: int) -> tuple[float, float]:
        """(prefill step seconds, decode seconds) for `batch` sequences on every rank."""
        for r in requests(batch, f"b{batch}"):
            eng.add_request(r)
        step, more = eng.step, (eng.has_work if n == 1 else eng.has_work_anywhere)
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        t1 = time.perf_counter()
        forward_s[0] = 0.0
        while more():
            step()
        sync(device)
        return t1 - t0, time.perf_counter() - t1, forward_s[0]

    run(2)  # warm-up: kernels, allocator
    rows = []
    for batch in args.batches:
        pre, dec, fwd = run(batch)
        t = torch.tensor([dec, fwd], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dec, fwd = t.tolist()
        decoded, steps = n * batch * (args.new_tokens - 1), args.new_tokens - 1
        rows.append({"batch_per_gpu": batch, "prefill_step_s": pre, "decode_s": dec, "decode_tok_s": decoded / dec,
                     "step_ms": 1e3 * dec / steps, "forward_s": fwd, "forward_tok_s": decoded / fwd,
                     "forward_ms": 1e3 * fwd / steps})
    return {"gpus": n, "layers": cfg.num_hidden_layers, "experts_per_gpu": cfg.num_experts // n, "prompt": args.prompt,
            "new_tokens": args.new_tokens, "engine": "EPEngine (eager)" if n > 1 else "Engine (eager)", "rows": rows,
            "sampler": "greedy argmax (benchmark)" if args.greedy_sampler else "engine",
            "peak_mem_gib": peak_memory_gib(device)}


def greedy_sample(logits: torch.Tensor, params: list, positions: list[int]):
    """Greedy stand-in for the engine's sampler in this benchmark: the real one draws numpy Gumbel
    noise over the whole 151,936-token vocabulary for every row, greedy rows too; with it the 1-GPU
    engine section (batches 1/64/256, 64 tokens) did not finish in 110 s on the H200 host, and the
    sampler, not the model step that expert parallelism changes, would be what is measured."""
    from node.engine.sampling import Samples

    if any(p.temperature != 0 for p in params):
        raise ValueError("the benchmark's greedy sampler takes temperature 0 only")
    logp = torch.log_softmax(logits.float(), dim=-1)
    top2 = logp.topk(2, dim=-1)
    return Samples(top2.indices[:, 0], top2.values[:, 0], top2.values[:, 0] - top2.values[:, 1])


SECTIONS = {"moe": moe, "trainer": trainer, "engine": engine}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("section", choices=sorted(SECTIONS))
    ap.add_argument("--result", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="moe: tokens per GPU")
    ap.add_argument("--rows", type=int, default=4, help="trainer: sequences per GPU")
    ap.add_argument("--seq", type=int, default=2048, help="trainer: sequence length")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--greedy-sampler", action="store_true", help="engine: greedy argmax instead of the engine's CPU sampler")
    args = ap.parse_args(argv)
    device, dtype = setup()
    try:
        result = SECTIONS[args.section](args, device, dtype)
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump(result, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
