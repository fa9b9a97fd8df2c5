"""The inference role's expert-parallel engine (`join --role inference --ep N`: engine `builtin-ep`,
rank 0's `EPLeader` and ranks following its orders) against `EPEngine` driven directly on every rank
(what `benchmarks.multigpu`'s engine section times) and the one-process built-in engine, on the same
requests: what the role's order channel (one scatter of orders and one gather of completions per
step, over gloo) and its weight switch (broadcast + expert scatter inside a step order) cost.

    python -m benchmarks.ep_role [--ep 2] [--device cpu|cuda] [--batch 8] [--new-tokens 32] [--repeats 3]

Each world is a process that starts its other ranks as `join --ep` does (`node.engine.ep_spawn`),
gloo on the CPU, NCCL with `--device cuda` (rank R on GPU R). Greedy, no EOS (every request decodes
`--new-tokens`), eager. Prints progress; ends with one JSON line (medians over `--repeats`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model(args, seed: int):
    from node.model.config import ModelConfig
    from node.model.qwen3_moe import CausalLM

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, moe_intermediate_size=args.hidden // 2,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=args.hidden // 4, num_experts=args.experts, num_experts_per_tok=2,
                      max_position_embeddings=args.prompt + args.new_tokens + 2)
    torch.manual_seed(seed)
    with torch.device(args.device if args.device == "cpu" else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"):
        return CausalLM(cfg).eval()


def requests(args, n: int) -> list:
    from node.engine.engine import Request
    from node.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    return [Request(f"q{i}", torch.randint(3, args.vocab, (args.prompt,), generator=g).tolist(), params) for i in range(n)]


def timed_generate(engine, reqs, device: str, sync=None) -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(reqs)
    if sync is not None:
        sync()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def world_role(args) -> dict:
    """Rank 0: the engine the role runs, built through the registry."""
    from node.engine import registry as engines
    from node.engine.ep_world import follow
    from node.engine.registry import EngineSetup
    from node.model.checkpoint import state_dict_to_hf

    m = model(args, 0)
    setup = EngineSetup(model=lambda: model(args, 99), hf_config=m.config.to_hf_dict(), max_batch=args.batch,
                        max_seq_len=m.config.max_position_embeddings, eos_id=-1, encode=list, decode=None, bos_id=1,
                        capture_experts=True, workdir=Path(args.result).parent, salt="bench", ep=args.ep,
                        device="cpu" if args.device == "cpu" else f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    if int(os.environ["RANK"]) > 0:
        follow(setup)
        return {}
    leader = engines.build("builtin-ep", setup)
    try:
        leader.load_weights(state_dict_to_hf(m), 0)
        leader.generate(requests(args, 2))  # warm-up
        gen = [timed_generate(leader, requests(args, args.ep * args.batch), args.device) for _ in range(args.repeats)]
        idle, switch = [], []
        for v in range(args.repeats):
            t0 = time.perf_counter()
            leader.step()  # no work anywhere: the order channel's round trip and one all-reduce
            idle.append(time.perf_counter() - t0)
            leader.load_weights(state_dict_to_hf(model(args, v + 1)), v + 1)
            t0 = time.perf_counter()
            leader.step()  # the same, plus the version: checked, broadcast and scattered to every rank
            switch.append(time.perf_counter() - t0)
        return {"generate_s": gen, "idle_step_s": idle, "switch_step_s": switch}
    finally:
        leader.close()


def world_direct(args) -> dict:
    """Every rank: `EPEngine` driven directly with its share of the requests (benchmarks.multigpu's way)."""
    import torch.distributed as dist

    from node.engine.ep import EPEngine
    from node.model.checkpoint import state_dict_to_hf
    from node.rl.parallel.dims import shutdown_distributed

    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank = dist.get_rank()
    eng = EPEngine(model(args, 99), max_batch=args.batch, eos_id=-1)
    eng.load_weights(state_dict_to_hf(model(args, 0)), 0)
    mine = requests(args, args.ep * args.batch)[rank * args.batch:(rank + 1) * args.batch]
    warm = requests(args, 2)[:1]
    eng.generate([type(r)(f"w{rank}-{r.request_id}", r.prompt_ids, r.params) for r in warm])
    gen = []
    for i in range(args.repeats):
        batch = [type(r)(f"{i}-{r.request_id}", r.prompt_ids, r.params) for r in mine]
        gen.append(timed_generate(eng, batch, args.device, sync=dist.barrier))
    shutdown_distributed()
    return {"generate_s": gen} if rank == 0 else {}


def world_one(args) -> dict:
    """One process, the built-in engine, every request."""
    from node.engine.engine import Engine

    eng = Engine(model(args, 0), max_batch=args.ep * args.batch, eos_id=-1)
    eng.generate(requests(args, 2))
    return {"generate_s": [timed_generate(eng, requests(args, args.ep * args.batch), args.device)
                           for _ in range(args.repeats)]}


WORLDS = {"role": world_role, "direct": world_direct, "one": world_one}


def run_world(name: str, argv: list[str], args) -> dict:
    with tempfile.TemporaryDirectory(prefix="ep_role-") as tmp:
        result = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "benchmarks.ep_role", *argv, "--world", name, "--result", str(result)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"world {name} failed: {proc.stderr[-2000:]}")
        return json.loads(result.read_text())


def world_main(args) -> None:
    if args.world in ("role", "direct") and "RANK" not in os.environ:
        from node.engine.ep_spawn import spawn_followers

        followers = spawn_followers(args.ep, [sys.executable, "-m", "benchmarks.ep_role", *sys.argv[1:]],
                                    Path(args.result).parent)
    else:
        followers = None
    out = WORLDS[args.world](args)
    if followers is not None:
        followers.close()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--out", help="where the JSON goes (default benchmarks/results/ep_role-MACHINE.json)")
    ap.add_argument("--world", choices=sorted(WORLDS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.world:
        world_main(args)
        return 0
    shared = [a for a in (argv if argv is not None else sys.argv[1:])]
    got = {}
    for name in ("one", "direct", "role"):
        log(f"world {name}: {'1 process' if name == 'one' else f'{args.ep} processes'}, "
            f"{args.ep * args.batch} requests x {args.new_tokens} tokens, {args.repeats} repeats")
        got[name] = run_world(name, shared, args)
        log(f"world {name}: generate {statistics.median(got[name]['generate_s']):.3f} s (median)")
    tokens = args.ep * args.batch * args.new_tokens
    med = {k: statistics.median(v["generate_s"]) for k, v in got.items()}
    idle, switch = statistics.median(got["role"]["idle_step_s"]), statistics.median(got["role"]["switch_step_s"])
    result = {
        "machine": args.machine, "device": args.device, "ep": args.ep, "batch_per_rank": args.batch,
        "new_tokens": args.new_tokens, "layers": args.layers, "hidden": args.hidden, "experts": args.experts,
        "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
        "role_tok_s": tokens / med["role"], "direct_ep_tok_s": tokens / med["direct"], "one_process_tok_s": tokens / med["one"],
        "role_over_direct": med["direct"] / med["role"], "role_over_one_process": med["one"] / med["role"],
        "role_step_ms": 1e3 * med["role"] / args.new_tokens, "direct_step_ms": 1e3 * med["direct"] / args.new_tokens,
        "idle_step_ms": 1e3 * idle, "version_switch_ms": 1e3 * (switch - idle),
        "raw": got,
    }
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"ep_role-{args.machine}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"written {out}")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k != "raw"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
