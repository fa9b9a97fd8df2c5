"""torchrun entry: `torchrun --nproc-per-node N -m benchmarks.parallel_parity --layouts dp2-ep2,cp2`.

For each layout it builds the same tiny MoE model in every process, computes the one-process loss
(policy loss plus the load-balancing loss), gradients and post-step parameters locally (no
collectives), then the parallel ones, and reports the largest differences (rank 0 writes them as JSON). It is both the CI check of the parallel trainer
and the smoke test to run first on a new cluster (NCCL on GPUs). With `--router-replay` the batch
carries routed experts (another router's choices, as an engine one version behind would send) and
both sides replay them.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time

import torch
import torch.distributed as dist

from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.rl.batch import TrainBatch
from node.rl.loss import policy_loss, token_logprobs
from node.rl.parallel.apply import parallelize
from node.rl.parallel.dims import ParallelDims, ParallelGroups, init_distributed, parse_layout, shutdown_distributed
from node.rl.parallel.trainer import DistributedTrainer, shard_batch
from node.rl.trainer import TrainerConfig

log = logging.getLogger("node.rl.parallel")


def check_model(seed: int = 0, aux_coef: float = 0.01) -> CausalLM:
    cfg = ModelConfig(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, router_aux_loss_coef=aux_coef, max_position_embeddings=256)
    torch.manual_seed(seed)
    return CausalLM(cfg)


def check_batch(model: CausalLM, rows: int = 4, length: int = 30, seed: int = 1, routes: bool = False) -> TrainBatch:
    """`routes`: carry the experts a moved router (gate weights + noise) picks, which differ from the
    model's own at some positions, so replaying them changes the loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (rows, length + 1), generator=g)
    mask = torch.rand(rows, length, generator=g) < 0.7
    mask[:, : length // 3] = False  # a prompt
    with torch.no_grad():
        logp = token_logprobs(model(ids[:, :-1]).logits, ids[:, 1:])
    inference = logp + 0.3 * torch.randn(rows, length, generator=g)  # some ratios leave the trust region
    adv = torch.randn(rows, 1, generator=g).expand(rows, length).contiguous()
    experts = None
    if routes:
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for layer in moved.model.layers:
                layer.mlp.gate.weight.add_(0.5 * torch.randn(layer.mlp.gate.weight.shape, generator=g))
            experts = moved(ids[:, :-1]).routed_experts
    return TrainBatch(ids[:, :-1], ids[:, 1:], mask, inference, adv, experts)


def reference(model: CausalLM, batch: TrainBatch, cfg: TrainerConfig):
    out = model(batch.input_ids, routed_experts=batch.routed_experts if cfg.router_replay else None)
    po = policy_loss(token_logprobs(out.logits, batch.targets), batch.inference_logprobs, batch.advantages,
                     batch.loss_mask, cfg.loss)
    loss = po.loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), foreach=False)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    opt.step()
    return loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


STEP_TOLERANCE = 1e-3
"""Largest `step_errors` value a parallel trainer's step may show against the one-process step. Float noise in
the gradients' reduction order (gloo's sum over ranks against one process's sum) is amplified by Adam's
1/sqrt(v) on elements whose gradient is tiny, so a few elements move by up to ~lr: one CI machine moved one
element by 1.07e-4 of its tensor's largest value (another ~1e-6), which is why the bound is on the norm of the
difference against the norm of the step, not on one element (measured at most 2e-5 on cpu-2core). A wrong
minibatch, learning rate or loss term moves whole tensors by ~lr: errors near 1."""


def step_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                before: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: |got - want| over |want - before| (L2 norms): how far a parallel step's result `got` is from
    the one-process step's `want`, as a share of how far that step moved the weights from `before`."""
    assert sorted(got) == sorted(want) == sorted(before)
    return {n: float((got[n].cpu() - want[n]).norm() / (want[n] - before[n]).norm().clamp(min=1e-30)) for n in want}


def run_layout(dims: ParallelDims, device: str, router_replay: bool = False, micro_batch_tokens: int | None = None,
               foreach: bool | None = None) -> dict:
    """`micro_batch_tokens`: the parallel side in micro-batches of that many padded tokens, against the
    one-process whole-batch step (the load-balancing loss off: micro-batches share it by rows, an approximation)."""
    cfg = TrainerConfig(router_replay=router_replay, **({"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {}))
    aux = 0.0 if micro_batch_tokens else 0.01
    ref_model = check_model(aux_coef=aux)
    batch = check_batch(ref_model, routes=router_replay)
    ref_loss, ref_grads, ref_params = reference(ref_model, batch, cfg)

    started = time.perf_counter()
    groups = ParallelGroups.build(dims, device)
    model = parallelize(check_model(aux_coef=aux).to(device), groups)
    trainer = DistributedTrainer(model, groups, cfg, foreach=foreach)
    local = shard_batch(batch, groups).to(torch.device(device))
    loss = trainer.backward(local)
    grads = trainer.full_gradients()
    trainer.clip_grad_norm(cfg.max_grad_norm)
    trainer.optimizer.step()
    params = trainer.full_parameters()

    def worst(a: dict, b: dict) -> float:
        return max(float((a[n].cpu() - b[n]).abs().max() / (b[n].abs().max() + 1e-12)) for n in b)

    return {"layout": dims.model_dump(), "loss": loss, "ref_loss": ref_loss,
            "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss), "grad_rel_err": worst(grads, ref_grads),
            "param_rel_err": worst(params, ref_params), "missing": sorted(set(ref_grads) - set(grads)),
            "optimizer_groups": len(trainer.optimizer.param_groups), "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", required=True, help="comma-separated, e.g. dp2-ep2,cp2")
    parser.add_argument("--no-fsdp", action="store_true", help="replicate instead of sharding")
    parser.add_argument("--router-replay", action="store_true", help="the batch carries routed experts to replay")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in the backward")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="the parallel side in micro-batches of this many padded tokens (load-balancing loss off)")
    parser.add_argument("--foreach", action="store_true",
                        help="the parallel side's AdamW on its multi-tensor path (a GPU's default) on any device")
    parser.add_argument("--out", help="rank 0 writes the results here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = init_distributed()
    results = []
    for text in args.layouts.split(","):
        dims = parse_layout(text, fsdp=not args.no_fsdp, activation_checkpointing=args.activation_checkpointing)
        result = run_layout(dims, device, args.router_replay, args.micro_batch_tokens, args.foreach or None)
        if dist.get_rank() == 0:
            log.info("%s: loss %.6g (one process %.6g) grad rel err %.2e param rel err %.2e", text,
                     result["loss"], result["ref_loss"], result["grad_rel_err"], result["param_rel_err"])
        results.append(result)
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
