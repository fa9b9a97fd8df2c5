"""Trainer parallelism applied from outside the model: FSDP2 (bf16 policy, fp32 master weights),
expert parallelism, ring-attention context parallelism, activation checkpointing.

`ParallelDims` says how the world is split; `parallelize` rewires a `CausalLM` in place, on the meta
device or real (EP swaps each MoE block's dispatch/combine for all-to-alls and keeps only this
rank's experts; CP swaps each attention's forward for ring attention; FSDP2 shards what is left).
`DistributedTrainer` takes the optimizer step with a loss normalised over the global token count,
so N processes compute the same loss and gradients as one process on the whole batch, each on its
own share of it (`plan_rank`). Nothing is gathered whole during training: `state` moves one tensor
at a time, `publish` streams the weights into shardcast, `checkpoint` writes sharded DCP
checkpoints resumable under any layout. Launched by torchrun (`python -m benchmarks.parallel_parity`
for the self-check; `join --role trainer --dp/--ep/--cp` for the networked trainer, whose rank 0
leads the others through `world`); gloo on CPU, NCCL on GPUs.
"""

from node.rl.parallel.dims import LayoutError, ParallelDims, ParallelGroups, init_distributed, shutdown_distributed
from node.rl.parallel.apply import parallelize
from node.rl.parallel.trainer import DistributedTrainer, shard_batch

__all__ = ["LayoutError", "ParallelDims", "ParallelGroups", "init_distributed", "shutdown_distributed", "parallelize", "DistributedTrainer", "shard_batch"]
