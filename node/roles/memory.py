"""Each role's memory plan, made from the run spec before the role builds anything
(`node.engine.memory_plan` holds the arithmetic): printed at start next to what its device has free,
and refused in one line (`MemoryPlanDoesNotFit`, exit 2) when it cannot fit.

Invariant: planning reads only the model's config (config.json, or the tiny MoE's shape): no weights,
no tensors, so a model far too large for the machine is refused in well under a second.
"""

from __future__ import annotations

import torch

from node.engine import registry as engines
from node.engine.memory_plan import MemoryPlan, host_or_gpu_free, plan_inference, plan_trainer, plan_validator
from node.model.spec import DTYPES
from node.replay import forward_tokens, logits_budget_of
from node.rl.loss import LOGPROB_CHUNK_BYTES
from node.rl.trainer import TrainerConfig
from node.roles.common import model_config
from protocol.messages import RunSpec

LEASES_PER_REQUEST = 8
"""Groups an inference node asks for at once (node/roles/inference.py InferenceNode's default): its CPU
engine's slots are this many groups."""


def role_plan(spec: RunSpec, role: str, device: str, free_bytes: int | None = None, parallel: dict | None = None,
              engine: str = "builtin", fp8: str | None = None, master_float32: bool = False) -> MemoryPlan | None:
    """What `role` will hold on `device` for this run (None: a relay, or an engine that plans its own
    memory, as vLLM does). `free_bytes`: what the device has (default: free now); `master_float32`: a one-process
    trainer that trains in float32 whatever the run's dtype (`join --master-float32`)."""
    cfg = model_config(spec)
    dtype = DTYPES[spec.model.dtype]
    free = host_or_gpu_free(device) if free_bytes is None else free_bytes
    if role == "trainer":
        p = parallel or {}
        world = p.get("dp", 1) * p.get("cp", 1)
        return plan_trainer(cfg, torch.float32 if master_float32 else dtype, device, free,
                            TrainerConfig().micro_batch_tokens, LOGPROB_CHUNK_BYTES,
                            world=world, sharded=p.get("fsdp", True),
                            checkpointed=p.get("activation_checkpointing", False),
                            longest_row=cfg.max_position_embeddings)
    if role == "validator":
        budget = logits_budget_of(device, free, cfg.vocab_size)
        return plan_validator(cfg, dtype, device, free, spec.model.fp8, budget,
                              forward_tokens(budget, cfg.vocab_size, torch.device(device), dtype))
    if role == "inference" and engine in ("builtin", "builtin-cuda"):
        mode = engines.serving_fp8(spec.model.fp8, fp8)
        slots = spec.group_size if device.startswith("cuda") else LEASES_PER_REQUEST * spec.group_size
        return plan_inference(cfg, dtype, device, free, mode, cfg.max_position_embeddings, slots)
    return None


def shared_device_plans(plans: list[MemoryPlan]) -> list[MemoryPlan]:
    """Roles that share one device (`sim` puts them so), each device's plans summed into one: what that
    device must hold for all of them at once."""
    by_device: dict[str, list[MemoryPlan]] = {}
    for p in plans:
        by_device.setdefault(p.device, []).append(p)
    return [ps[0] if len(ps) == 1 else
            MemoryPlan(" + ".join(p.role for p in ps), device, tuple((f"{p.role} {name}", b) for p in ps for name, b in p.parts),
                       ps[0].free_bytes, "; ".join(p.note for p in ps if p.note),
                       next((p.micro_batch_tokens for p in ps if p.micro_batch_tokens), None))
            for device, ps in by_device.items()]


def local_run_plan(cfg, dtype, micro_batch_tokens: int, slots: int, max_seq_len: int, free_bytes: int) -> MemoryPlan:
    """`train-local`: the trainer and its engine's own copy of the model, one process on the CPU (the
    summed plan carries the trainer's micro-batch size)."""
    return shared_device_plans([
        plan_trainer(cfg, dtype, "cpu", free_bytes, micro_batch_tokens, LOGPROB_CHUNK_BYTES, longest_row=max_seq_len),
        plan_inference(cfg, dtype, "cpu", free_bytes, "off", max_seq_len, slots)])[0]
