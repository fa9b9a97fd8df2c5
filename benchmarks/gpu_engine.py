"""The engine the inference role runs on a GPU (`CudaEngine`), 8-layer Qwen3-30B-A3B shape, random
weights: `python -m benchmarks.gpu_engine [--layers 8] [--sections fixed,rl,anchors]` (needs CUDA).

(a) fixed batches 1 / 64 / 256, FP8 and bf16: `batch` requests of a 16-token prompt and 64 new
    tokens at T = 1 (seeded), hidden states and routes captured as the role runs it; end-to-end
    tok/s (prefill included) and the median decode step.
(b) an RL-shaped workload: 512 requests, log-normal prompt (16..512) and completion (8..1024)
    lengths, T = 1, continuous batching at 256 slots, TOPLOC proofs built from the hidden states.
(c) the validator's batched prefill (`CudaEngine.verify_prefill`) over the same rollouts.
Anchors, same run, same tokens, prefill counted the same way: the memory roofline of a decode step,
`FixedBatchDecoder` alone (benchmarks/fixed_decode.py: the engine's decode forward in a graph, greedy
argmax, no sampling, fixed batch: an upper bound, not a role path), and transformers `generate()` eager and with a static cache + torch.compile (benchmarks.gpu_engine_hf).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import numpy as np
import torch

from benchmarks.fp8_common import copy_bandwidth, log, machine_facts, qwen3_30b_a3b_config, write_result
from benchmarks.fp8_engine import step_bytes, time_decode
from node.engine import Request, SamplingParams
from node.engine.cuda_engine import CudaEngine
from node.fp8.ops import grouped_backend
from node.model.qwen3_moe import CausalLM

PROMPT, NEW = 16, 64


def _requests(cfg, n: int, prompt_lens: list[int], new: list[int], seed: int = 0) -> list[Request]:  # noqa: ANN001
    g = np.random.default_rng(seed)
    return [Request(f"r{i}", g.integers(3, cfg.vocab_size, prompt_lens[i]).tolist(),
                    SamplingParams(temperature=1.0, max_new_tokens=new[i], seed=1000 + i)) for i in range(n)]


def _sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def fixed_batch(engine: CudaEngine, cfg, b: int) -> dict:  # noqa: ANN001
    """End-to-end tok/s over b x NEW tokens (prefill included) and the median decode step; the
    second of two runs (the first compiles kernels for this batch's prefill shapes)."""
    _fixed_once(engine, cfg, b)
    return _fixed_once(engine, cfg, b)


def _fixed_once(engine: CudaEngine, cfg, b: int) -> dict:  # noqa: ANN001
    for r in _requests(cfg, b, [PROMPT] * b, [NEW] * b, seed=b):
        engine.add_request(r)
    steps, t0 = [], _sync()
    while engine.has_work():
        a = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - a)  # each step ends reading the sampled tokens: synchronised
    total = _sync() - t0
    decode = statistics.median(steps[1:-1]) if len(steps) > 2 else steps[-1]
    return {"e2e_tok_s": b * NEW / total, "step_ms": decode * 1e3, "decode_tok_s": b / decode}


def profiled(fn, steps: int = 1, top: int = 15) -> dict:  # noqa: ANN001
    """`fn()` `steps` times under `torch.profiler`: the wall seconds per step, the kernels' GPU seconds per step
    (their sum: how busy the GPU was), and the `top` kernels by GPU time per step (microseconds, calls, share of
    the kernels' total). On the CPU: operators by their own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = _sync() - t0
    if cuda:
        rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0
                and e.device_type == torch.autograd.DeviceType.CUDA]
    else:  # a CPU smoke run: operators by their own CPU time
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(t for _, t, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    out = {"wall_s_per_step": wall / steps, "kernels_s_per_step": total / 1e6 / steps,
           "top": [{"kernel": k[:120], "us_per_step": round(t / steps, 1), "calls_per_step": c / steps,
                    "share": round(t / total, 4)} for k, t, c in rows[:top]]}
    if cuda:  # where the host's time went beside the kernels: operators and CUDA runtime calls by their own CPU time
        host = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()
                       if e.self_cpu_time_total > 0 and e.device_type == torch.autograd.DeviceType.CPU),
                      key=lambda r: -r[1])
        out["host_top"] = [{"op": k[:80], "self_cpu_us_per_step": round(t / steps, 1), "calls_per_step": c / steps}
                           for k, t, c in host[:top]]
    return out


def decode_profile(engine: CudaEngine, cfg, b: int, steps: int = 4, top: int = 15) -> dict:  # noqa: ANN001
    """Where a batch-`b` decode step's GPU time goes (`profiled` over `steps` of the engine's own decode steps,
    graph replays included); admission and prefill run before, the batch is drained after."""
    for r in _requests(cfg, b, [PROMPT] * b, [NEW] * b, seed=b + 1):
        engine.add_request(r)
    engine.step()  # admission and prefill
    engine.step()
    out = profiled(engine.step, steps, top)
    while engine.has_work():  # drain
        engine.step()
    return out


def section_fixed(result: dict, bf16: CausalLM, cfg, bw: float, batches: list[int]) -> None:  # noqa: ANN001
    rows = {b: {"batch": b} for b in batches}
    default = os.environ.get("PRIMERL_FP8_GROUPED", "triton")
    variants = [("fp8", True, default), ("fp8_experts", "experts", default), ("bf16", False, default)]
    other = "triton" if default != "triton" else "auto"
    if os.environ.get("GPU_ENGINE_OTHER_BACKEND") == "1":  # the other grouped-GEMM backend, for comparison
        variants.append((f"fp8_{other}", True, other))
    for name, fp8, backend in variants:
        os.environ["PRIMERL_FP8_GROUPED"] = backend
        t = time.perf_counter()
        eng = CudaEngine(copy.deepcopy(bf16), max_batch=max(batches), max_seq_len=PROMPT + NEW + 8, eos_id=-1,
                         capture_hidden=True, capture_experts=True, fp8=fp8)
        eng.capture_all()
        log(f"{name}: engine built and {len(eng.buckets)} graphs captured in {time.perf_counter() - t:.1f}s")
        for b in batches:
            r = fixed_batch(eng, cfg, b)
            for k, v in r.items():
                rows[b][f"{name}_{k}"] = v
            rows[b][f"{name}_roofline_share"] = step_bytes(cfg, b, PROMPT + NEW, fp8) / bw / (r["step_ms"] / 1e3)
            log(f"batch {b} {name}: decode {r['decode_tok_s']:.0f} tok/s ({r['step_ms']:.2f} ms/step), "
                f"end-to-end {r['e2e_tok_s']:.0f} tok/s")
        if os.environ.get("GPU_ENGINE_PROFILE") == "1":
            result.setdefault("profile_b256_eager_step_top_kernels_ms", {})[name] = profile_step(eng, max(batches))
        del eng
        torch.cuda.empty_cache()
    os.environ["PRIMERL_FP8_GROUPED"] = default
    from node.engine.fp8.model import quantize_model_fp8

    fp8_model = quantize_model_fp8(copy.deepcopy(bf16))
    for b in batches:  # the benchmark-only loop, same shapes: decode step of greedy argmax, no sampling
        rows[b]["fixed_decode_fp8_step_ms"] = time_decode(fp8_model, b, NEW) * 1e3
        rows[b]["fixed_decode_bf16_step_ms"] = time_decode(bf16, b, NEW) * 1e3
        log(f"batch {b} FixedBatchDecoder: fp8 {rows[b]['fixed_decode_fp8_step_ms']:.2f} ms, "
            f"bf16 {rows[b]['fixed_decode_bf16_step_ms']:.2f} ms")
    del fp8_model
    torch.cuda.empty_cache()
    result["fixed"] = list(rows.values())
    top = rows[max(batches)]
    result.update(
        fp8_tok_s_b256=top["fp8_decode_tok_s"], bf16_tok_s_b256=top["bf16_decode_tok_s"],
        fp8_experts_tok_s_b256=top["fp8_experts_decode_tok_s"],
        fp8_experts_over_bf16_b256=top["fp8_experts_decode_tok_s"] / top["bf16_decode_tok_s"],
        fp8_over_bf16_b256=top["fp8_decode_tok_s"] / top["bf16_decode_tok_s"],
        roofline_share_b256_fp8=top["fp8_roofline_share"],
        engine_over_fixed_decode_b256_fp8=top["fixed_decode_fp8_step_ms"] / top["fp8_step_ms"],
    )
    if 1 in rows:
        result["step_ms_b1_fp8"] = rows[1]["fp8_step_ms"]
        result["step_ms_b1_bf16"] = rows[1]["bf16_step_ms"]
        result["step_ms_b1_fp8_experts"] = rows[1]["fp8_experts_step_ms"]


def profile_step(eng: CudaEngine, b: int, top: int = 12) -> dict:
    """CUDA time per kernel name of 3 eager decode steps at bucket b (padding rows: the GEMMs,
    routing and sampling of a full step; attention over one key), ms per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    eng._slot_buf.fill_(eng.scratch)
    with torch.inference_mode():
        eng._decode_body(b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                eng._decode_body(b)
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 3e3) for e in prof.key_averages()), key=lambda r: -r[1])
    out = {k[:90]: round(v, 4) for k, v in rows[:top]}
    out["_total_ms"] = round(sum(v for _, v in rows), 3)
    log(f"profile b{b}: {out}")
    return out


def rl_requests(cfg, n: int, max_prompt: int = 512, max_new: int = 1024) -> list[Request]:  # noqa: ANN001
    """The RL-shaped workload: log-normal prompt (16..512) and completion (8..1024) lengths, T = 1, seeded."""
    g = np.random.default_rng(7)
    plens = np.clip(np.round(g.lognormal(np.log(64), 0.8, n)), 16, max_prompt).astype(int).tolist()
    news = np.clip(np.round(g.lognormal(np.log(128), 1.0, n)), 8, max_new).astype(int).tolist()
    return _requests(cfg, n, plens, news, seed=11)


def rl_workload(eng, cfg, reqs: list[Request], result: dict) -> list:  # noqa: ANN001
    """Generate `reqs` with continuous batching and build their TOPLOC proofs, as the inference role does;
    figures into `result` (rl_*), the completions returned."""
    from verification.proof import build_proofs_many

    eng.generate(_requests(cfg, 16, [32] * 16, [16] * 16, seed=3))  # warm
    t0 = _sync()
    done = eng.generate(reqs)
    t_gen = _sync() - t0
    proofs = build_proofs_many([(c.hidden, c.versions) for c in done])
    t_all = _sync() - t0
    gen_tokens = sum(len(c.token_ids) for c in done)
    assert sum(len(p) for p in proofs) > 0
    news = [r.params.max_new_tokens for r in reqs]
    result.update(rl_requests=len(reqs), rl_generated_tokens=gen_tokens,
                  rl_prompt_tokens=sum(len(r.prompt_ids) for r in reqs), rl_generate_s=t_gen,
                  rl_proofs_s=t_all - t_gen, rl_workload_tok_s=gen_tokens / t_all, rl_max_new=max(news),
                  rl_median_new=int(np.median(news)))
    log(f"RL workload: {len(reqs)} requests, {gen_tokens} tokens in {t_gen:.2f}s + proofs {t_all - t_gen:.2f}s: "
        f"{gen_tokens / t_all:.0f} tok/s")
    return done


def section_rl(result: dict, bf16: CausalLM, cfg, n: int) -> None:  # noqa: ANN001
    reqs = rl_requests(cfg, n)
    plens = [len(r.prompt_ids) for r in reqs]
    eng = CudaEngine(copy.deepcopy(bf16), max_batch=256, max_seq_len=2048, eos_id=-1,
                     capture_hidden=True, capture_experts=True, fp8=True)
    t = time.perf_counter()
    eng.capture_all()
    result["rl_capture_s"] = time.perf_counter() - t
    done = rl_workload(eng, cfg, reqs, result)
    gen_tokens, t_all = result["rl_generated_tokens"], result["rl_generate_s"] + result["rl_proofs_s"]
    seqs = [c.prompt_ids + c.token_ids for c in done]
    eng.verify_prefill(seqs[:32], [len(c.prompt_ids) for c in done[:32]], [r.params for r in reqs[:32]])  # warm
    t0 = _sync()
    checks = eng.verify_prefill(seqs, [len(c.prompt_ids) for c in done], [r.params for r in reqs], with_routes=True)
    t_ver = _sync() - t0
    agree = sum(int((v.tokens.cpu() == torch.tensor(c.token_ids)).sum()) for v, c in zip(checks, done)) / gen_tokens
    eng_lp = torch.cat([torch.tensor(c.logprobs) for c in done])
    ver_lp = torch.cat([v.logprobs.cpu() for v in checks])
    result.update(engine_nonfinite_logprobs=int((~torch.isfinite(eng_lp)).sum()),
                  verify_nonfinite_logprobs=int((~torch.isfinite(ver_lp)).sum()),
                  verify_nonfinite_hidden=int(sum(int((~torch.isfinite(v.hidden)).sum()) for v in checks)))
    log(f"non-finite logprobs: engine {result['engine_nonfinite_logprobs']}, verify {result['verify_nonfinite_logprobs']}; "
        f"non-finite verify hidden {result['verify_nonfinite_hidden']}")
    errs = (ver_lp - eng_lp).abs()
    errs = errs[torch.isfinite(errs)]
    lp_err = float(errs.max())
    result.update(verify_mean_logprob_err=float(errs.mean()), verify_p99_logprob_err=float(errs.quantile(0.99)))
    result.update(verify_s=t_ver, verify_tok_s=gen_tokens / t_ver, verify_over_generate=(gen_tokens / t_ver) / (gen_tokens / t_all),
                  verify_token_agreement=agree, verify_max_logprob_err=lp_err)
    log(f"verify: {gen_tokens / t_ver:.0f} completion tok/s ({(gen_tokens + sum(plens)) / t_ver:.0f} incl. prompts), "
        f"token agreement {agree:.4f}, |logprob diff| max {lp_err:.3g} mean {float(errs.mean()):.3g} "
        f"p99 {float(errs.quantile(0.99)):.3g}")
    del eng
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--sections", default="fixed,rl,anchors")
    ap.add_argument("--rl-requests", type=int, default=512)
    ap.add_argument("--hf-compile-timeout", type=float, default=240.0)
    ap.add_argument("--name", default="gpu_engine")
    args = ap.parse_args()
    sections = args.sections.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    result: dict = {"machine": machine_facts(), "layers": args.layers, "prompt": PROMPT, "new_tokens": NEW,
                    "engine_class": "node.engine.cuda_engine.CudaEngine", "gemm_backend": grouped_backend("cuda")}
    log(f"FP8 grouped GEMM backend: {result['gemm_backend']}")
    bw = copy_bandwidth()
    result["copy_bandwidth_bytes_per_s"] = bw
    cfg = qwen3_30b_a3b_config(args.layers)
    with torch.device("cuda"):
        bf16 = CausalLM(cfg).to(torch.bfloat16).eval()
    result["params"] = sum(p.numel() for p in bf16.parameters())
    if "fixed" in sections:
        section_fixed(result, bf16, cfg, bw, batches)
    if "rl" in sections:
        section_rl(result, bf16, cfg, args.rl_requests)
    del bf16
    torch.cuda.empty_cache()
    if "anchors" in sections:
        from benchmarks.gpu_engine_hf import hf_anchors

        result["transformers"] = hf_anchors(cfg, batches, PROMPT, NEW, args.hf_compile_timeout)
        for row in result.get("fixed", []):
            hf = result["transformers"].get(str(row["batch"]), {})
            for k, v in hf.items():
                row[f"transformers_{k}"] = v
                if isinstance(v, float) and k.endswith("tok_s"):
                    row[f"fp8_e2e_over_transformers_{k}"] = row["fp8_e2e_tok_s"] / v
    write_result(args.name, result)


if __name__ == "__main__":
    main()
