"""The CUDA engine's prefill of one admission (what the inference role's engine runs when leased groups arrive while
others decode): the admitted prompts packed end to end against right-padded groups (the way before session 42).

    python -m benchmarks.engine_prefill [--device cpu] [--shape qwen3-moe-tiny] [--rows 64] [--repeat 5] [--out FILE]

`--rows` prompts of the RL task `reverse-text-long` (the network benchmark's task), tokenized as the random models'
runs tokenize them (SmolLM2's tokenizer, `--tokenizer-from`), admitted at once into a `CudaEngine` of `--shape`
with random weights (bf16 on a GPU, float32 on the CPU), each asking one token: the step is the prefill and the
sampling of the first token (`EngineCore.phases`' prefill). Packed (the engine's default) and padded
(`pack_prefill=False`) alternate, best of `--repeat`; the peer is the padded engine in the same process. Also the
tokens each computes: every row real when packed, each group's longest prompt times its members when padded. Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import platform
from pathlib import Path

import torch

from benchmarks import emit
from benchmarks.random_checkpoint import SHAPES
from node.engine.core import Request
from node.engine.cuda_engine import CudaEngine
from node.engine.sampling import SamplingParams
from node.envs import get_env
from node.model.batching import token_budget_groups
from node.model.config import ModelConfig
from node.model.qwen3_moe import CausalLM
from node.model.tokenizer import HFTokenizer


def prompts(rows: int, tokenizer_dir: Path, task: str) -> list[list[int]]:
    tok, env = HFTokenizer(tokenizer_dir), get_env(task)
    return [env.sample_task(10_000 + i).prompt_ids(tok) for i in range(rows)]


def one_prefill(engine: CudaEngine, batch: list[list[int]], serial: int) -> float:
    """Seconds of the prefill that admits `batch` (each asking one token, so nothing decodes after it)."""
    for i, ids in enumerate(batch):
        engine.add_request(Request(f"{serial}-{i}", ids, SamplingParams(temperature=1.0, max_new_tokens=1, seed=i)))
    engine.phases.take()
    done = engine.step()
    assert len(done) == len(batch) and not engine.has_work()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return engine.phases.take()["prefill"][0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, choices=list(SHAPES), help="default: qwen3-moe-small on a GPU, "
                    "qwen3-moe-tiny on the CPU")
    ap.add_argument("--rows", type=int, default=64, help="prompts admitted at once (the role: slots / 8)")
    ap.add_argument("--task", default="reverse-text-long")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="default: the converted SmolLM2 directory")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    shape = args.shape or ("qwen3-moe-small" if cuda else "qwen3-moe-tiny")
    if args.tokenizer_from is None:
        from node.model.pretrained import smollm2_dir

        args.tokenizer_from = smollm2_dir()
    batch = prompts(args.rows, args.tokenizer_from, args.task)
    torch.manual_seed(0)
    cfg = ModelConfig(**{**SHAPES[shape], "vocab_size": max(SHAPES[shape].get("vocab_size", 0), 49_152)})
    model = CausalLM(cfg).eval()
    dtype = torch.bfloat16 if cuda else torch.float32
    engines = {pack: CudaEngine(model if pack else copy.deepcopy(model), max_batch=max(args.rows, 8), max_seq_len=2048,
                                device=args.device, dtype=dtype, pack_prefill=pack, use_graphs=False)
               for pack in (True, False)}
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeat + 1):  # the first of each warms (allocator, kernels' compilation)
        for pack, engine in engines.items():
            s = one_prefill(engine, batch, r)
            if r:
                seconds[pack].append(s)
    lens = [len(p) for p in batch]
    budget = engines[True].prefill_tokens
    padded = sum(len(g) * max(lens[i] for i in g) for g in token_budget_groups(lens, budget))
    packed_s, padded_s = min(seconds[True]), min(seconds[False])
    return emit({
        "bench": "engine_prefill", "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "task": args.task,
        "rows": args.rows, "prompt_tokens": sum(lens), "prompt_tokens_mean": round(sum(lens) / len(lens), 1),
        "prompt_tokens_max": max(lens), "padded_tokens": padded, "repeat": args.repeat,
        "packed_ms": round(1000 * packed_s, 2), "padded_ms": round(1000 * padded_s, 2),
        "packed_tok_s": round(sum(lens) / packed_s, 1), "padded_over_packed": round(padded_s / packed_s, 3),
        "padded_tokens_over_real": round(padded / sum(lens), 3),
    }, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
