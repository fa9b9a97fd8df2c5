"""Where the trainer role's step goes on one GPU: `python -m benchmarks.trainer_profile [--layers 8]`.

Times `node.rl.trainer.Trainer.train_step` (what `join --role trainer` calls each step, one update on the
whole batch) on a Qwen3-30B-A3B-shaped model (`--layers` layers, bf16 parameters and AdamW states as the
role holds them) with a long-tailed batch like the network's reverse-text-long steps (256 rows, median
completion ~30 tokens, a few near 1,000), then the same step's phases apart: the forward of each
micro-batch, its backward, gradient clipping, AdamW. Its figures are the step's seconds, tokens per
second, and each phase's share; `torch.profiler`'s top CUDA kernels by time go to the log. Ends with one
JSON line. The peer is the step's own sum of phases (`phases_over_step` near 1: the split is complete).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from benchmarks.random_checkpoint import SHAPES
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.model.routing import RouteShape, compact_routes_dtype
from node.rl.batch import TrainBatch
from node.rl.loss import policy_loss
from node.rl.trainer import Trainer, TrainerConfig

log = logging.getLogger("benchmarks.trainer_profile")


def long_tail_batch(rows: int, prompt: int, vocab: int, seed: int = 0,
                    routes: RouteShape | None = None) -> TrainBatch:
    """`rows` rows of a `prompt`-token prompt and a Pareto-tailed completion (median ~30, at most 960);
    with `routes`, every position's experts to replay (k consecutive ids from a random first one), as the
    trainer role's batches carry them when the inference nodes send routes (router replay, the default)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (15 * (1 - torch.rand(rows, generator=g)) ** (-1 / 1.1)).clamp(4, 960).long()
    t = prompt + int(lengths.max()) - 1
    ids = torch.randint(0, vocab, (rows, t + 1), generator=g)
    mask = torch.zeros(rows, t, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        mask[i, prompt - 1:prompt - 1 + n] = True
    adv = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0)[:, None].expand(rows, t).contiguous()
    replay = None
    if routes is not None:
        first = torch.randint(0, routes.num_experts, (rows, t, routes.moe_layers, 1), generator=g)
        # as compact as the role's batches hold them (`compact_routes_dtype`)
        replay = ((first + torch.arange(routes.top_k)) % routes.num_experts).to(compact_routes_dtype(routes))
    return TrainBatch(ids[:, :-1], ids[:, 1:], mask, torch.full((rows, t), -2.0), adv, replay)


def phases(trainer: Trainer, batch: TrainBatch, device: str) -> dict[str, float]:
    """The step's parts as `Trainer.train_step` runs them, each synchronised: per update and minibatch the
    forward and backward of each micro-batch, gradient clipping, AdamW (no no-grad pass since session 32: the
    mismatch is read from the first minibatch's forward)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    cfg = trainer.cfg
    out = {"forward_s": 0.0, "backward_s": 0.0, "clip_s": 0.0, "adamw_s": 0.0}
    batch = batch.to(device)
    trainer.model.train()

    def timed(key, fn):
        sync()
        t = time.perf_counter()
        r = fn()
        sync()
        out[key] += time.perf_counter() - t
        return r

    for _ in range(cfg.updates_per_batch):
        for rows in torch.randperm(len(batch)).chunk(cfg.minibatches):
            trainer.optimizer.zero_grad(set_to_none=True)
            for micro in trainer.micro_batches(batch.select(rows)):
                def forward():
                    logp, aux = trainer.logprobs(micro)
                    return policy_loss(logp, micro.inference_logprobs, micro.advantages, micro.loss_mask,
                                       cfg.loss).loss + 1e-3 * aux
                loss = timed("forward_s", forward)
                timed("backward_s", loss.backward)
            timed("clip_s", lambda: torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.max_grad_norm))
            timed("adamw_s", trainer.optimizer.step)
    trainer.model.eval()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b-8l", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt", type=int, default=60)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--router-replay", action=argparse.BooleanOptionalAction, default=True,
                   help="the batch carries every position's routed experts, replayed as the role does (default)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu with a few --layers (a smoke run)")
    p.add_argument("--overhead-tokens", default=TrainerConfig().micro_batch_overhead_tokens,
                   help="micro-batches grouped to pad least for this cost a micro-batch (-1: the fewest micro-batches; "
                   "auto: the trainer's default, by pass and device)")
    p.add_argument("--pack", default="auto", choices=["auto", "on", "off"],
                   help="micro-batches of sequences end to end (TrainerConfig.pack; auto: where varlen flash runs)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    cfg = ModelConfig(**shape, vocab_size=args.vocab_size, max_position_embeddings=args.prompt + 1024)
    torch.manual_seed(0)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.device(args.device):
        model = CausalLM(cfg).to(torch.bfloat16)
    overhead = "auto" if args.overhead_tokens == "auto" else int(args.overhead_tokens)
    overhead = None if overhead != "auto" and overhead < 0 else overhead  # -1: the fewest micro-batches
    # the recipe's defaults: updates and minibatches per step
    pack = {"auto": "auto", "on": True, "off": False}[args.pack]
    trainer = Trainer(model, TrainerConfig(lr=1e-5, micro_batch_overhead_tokens=overhead, pack=pack))
    batch = long_tail_batch(args.rows, args.prompt, args.vocab_size,
                            routes=RouteShape.of(cfg) if args.router_replay else None)
    tokens = args.rows * args.prompt + int(batch.loss_mask.sum())  # each row's prompt and completion
    micros = trainer.micro_batches(batch)
    padded = sum(m.input_ids.numel() for m in micros)
    log.info("batch: %d rows x %d positions, %d loss tokens, %d micro-batches of %d padded positions in all "
             "(the whole batch in one minibatch; %s)", *batch.input_ids.shape, int(batch.loss_mask.sum()),
             len(micros), padded, "packed" if trainer.packs() else f"grouped for {overhead} tokens a micro-batch")
    trainer.train_step(batch)  # warm: allocator, kernels, AdamW states
    steps = []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        trainer.train_step(batch)
        sync()
        steps.append(time.perf_counter() - t)
    step_s = sorted(steps)[len(steps) // 2]
    parts = phases(trainer, batch, args.device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        trainer.train_step(batch)
        sync()
    log.info("top kernels of one step:\n%s", prof.key_averages().table(
        sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25))
    result = {"benchmark": "trainer_profile", "machine": torch.cuda.get_device_name() if cuda else "cpu", "shape": args.shape,
              "layers": cfg.num_hidden_layers, "router_replay": batch.routed_experts is not None,
              "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
              "updates_per_batch": trainer.cfg.updates_per_batch, "minibatches": trainer.cfg.minibatches,
              "rows": args.rows, "positions": int(batch.input_ids.shape[1]), "tokens": tokens,
              "overhead_tokens": overhead, "backward_overhead_tokens": trainer.overhead_tokens(),
              "packed": trainer.packs(), "micro_batches": len(micros), "padded_positions": padded,
              "loss_tokens": int(batch.loss_mask.sum()), "step_s": round(step_s, 3),
              "tok_s": round(tokens / step_s, 1), **{k: round(v, 3) for k, v in parts.items()},
              "phases_over_step": round(sum(parts.values()) / step_s, 3),
              "gpu_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
