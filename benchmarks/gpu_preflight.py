"""Seconds-long checks of what each role does on its GPU, run before a network benchmark spends device
time on a run that cannot work (benchmarks/gpu_network_device.sh): on every visible GPU, from a worker
thread (as the roles call them), the built-in CUDA engine generates, the validator's reference
prefills, and the trainer takes a step. Ends with one JSON line: {"ok": bool, "checks": {...}}.

    python -m benchmarks.gpu_preflight
"""

from __future__ import annotations

import json
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from node.engine import SamplingParams
from node.engine.engine import Request
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.rl.batch import TrainBatch
from node.rl.trainer import Trainer, TrainerConfig

CFG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2)


def engine(device: str) -> str:
    from node.engine.cuda_engine import CudaEngine

    torch.manual_seed(0)
    e = CudaEngine(CausalLM(CFG), max_batch=8, max_seq_len=64, eos_id=0, capture_hidden=True, device=device,
                   dtype=torch.bfloat16)
    e.capture_all()
    done = e.generate([Request(str(i), [1, 2, 3, 4 + i], SamplingParams(temperature=1.0, seed=i, max_new_tokens=8))
                       for i in range(4)])
    return f"{sum(len(c.token_ids) for c in done)} tokens"


def reference(device: str) -> str:
    model = CausalLM(CFG).to(device=device, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model(torch.randint(1, 256, (4, 16), device=device))
    return f"logits {tuple(out.logits.shape)} finite {bool(out.logits.isfinite().all())}"


def trainer(device: str) -> str:
    t = Trainer(CausalLM(CFG).to(device), TrainerConfig(lr=1e-4))
    ids = torch.randint(1, 256, (4, 17))
    mask = torch.ones(4, 16, dtype=torch.bool)
    stats = t.train_step(TrainBatch(ids[:, :-1], ids[:, 1:], mask, torch.full((4, 16), -5.5), torch.ones(4, 16), None))
    return f"loss {stats['loss']:.4f}"


def main() -> None:
    checks, ok = {}, True
    for i in range(torch.cuda.device_count()):
        for name, fn in (("engine", engine), ("reference", reference), ("trainer", trainer)):
            t0 = time.time()
            try:
                with ThreadPoolExecutor(1) as pool:  # a worker thread: its current device is cuda:0
                    detail = pool.submit(fn, f"cuda:{i}").result(timeout=120)
                checks[f"{name}@cuda:{i}"] = {"ok": True, "s": round(time.time() - t0, 2), "detail": detail}
            except Exception as exc:  # every failure is reported, none stops the others
                ok = False
                checks[f"{name}@cuda:{i}"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400],
                                              "where": traceback.format_exc().splitlines()[-3:]}
            print(name, i, checks[f"{name}@cuda:{i}"], flush=True)
    print(json.dumps({"benchmark": "gpu_preflight", "ok": ok and bool(checks), "checks": checks}))


if __name__ == "__main__":
    main()
