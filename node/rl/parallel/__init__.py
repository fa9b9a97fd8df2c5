"""Trainer parallelism applied from outside the model: FSDP2, expert parallelism, context parallelism.

`ParallelDims` says how the world is split; `parallelize` rewires a `CausalLM` in place (EP swaps
each MoE block's dispatch/combine for all-to-alls and keeps only this rank's experts; CP swaps each
attention's forward for one that gathers keys and values across the sequence shards; FSDP2 shards
what is left). `DistributedTrainer` takes the optimizer step with a loss normalised over the global
token count, so N processes compute the same loss and gradients as one process on the whole batch.
Launched by torchrun (`python -m node.rl.parallel.launch` for the self-check; `join --role trainer
--dp/--ep/--cp` for the networked trainer, whose rank 0 leads the others through `world`); gloo on
CPU, NCCL on GPUs. A distributed checkpoint is a plain `Trainer` checkpoint (`state`).
"""

from node.rl.parallel.dims import ParallelDims, ParallelGroups, init_distributed, shutdown_distributed
from node.rl.parallel.apply import parallelize
from node.rl.parallel.trainer import DistributedTrainer, shard_batch

__all__ = ["ParallelDims", "ParallelGroups", "init_distributed", "shutdown_distributed", "parallelize", "DistributedTrainer", "shard_batch"]
