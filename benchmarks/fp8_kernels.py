"""FP8 kernel checks and speeds on CUDA: `python -m benchmarks.fp8_kernels [--decode-tiles | --grouped-tiles]`.

Correctness against float64 (relative Frobenius error) for the block-scaled GEMM, the row-group
GEMM used by weight gradients, the grouped expert GEMM and activation quantisation; then TFLOP/s
of ours against torch's bf16 matmul, torch's row-scaled `_scaled_mm`, and `_grouped_mm` (bf16).
"""

from __future__ import annotations

import torch

from benchmarks.fp8_common import cuda_time, log, machine_facts, write_result
from node.fp8.kernels import gemm_triton, grouped_gemm_triton, quantize_act_triton
from node.fp8.quantize import (
    FP8_DTYPE, dequantize_act, dequantize_weight, quantize_act, quantize_weight,
)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def check_gemm(m: int, n: int, k: int) -> dict:
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") * 0.02
    ref = x.double() @ w.double().t()
    xq, xs = quantize_act_triton(x)
    wq, ws = quantize_weight(w)
    out = gemm_triton(xq, wq, xs, ws, out_dtype=torch.float32)
    exact = dequantize_act(xq, xs).double() @ dequantize_weight(wq, ws).double().t()
    rq, rs = quantize_act(x)
    bq, bs = quantize_act(w)
    g1 = gemm_triton(xq, bq, xs, bs, b_group_n=1, out_dtype=torch.float32)
    return {
        "shape": [m, n, k],
        "rel_err_vs_fp64": rel(out, ref),
        "rel_err_vs_fp64_of_quantised_inputs": rel(out, exact),
        "rowgroup_rel_err_vs_fp64": rel(g1, ref),
        "act_quant_matches_torch": bool(torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)))
        and bool(torch.allclose(xs, rs)),
        "bf16_rel_err_vs_fp64": rel((x.bfloat16() @ w.bfloat16().t()).float(), ref),
    }


def check_grouped(tokens: int, experts: int, n: int, k: int) -> dict:
    counts = torch.bincount(torch.randint(0, experts, (tokens,), device="cuda"), minlength=experts)
    x = torch.randn(tokens, k, device="cuda")
    w = torch.randn(experts, n, k, device="cuda") * 0.02
    wq, ws = quantize_weight(w)
    xq, xs = quantize_act_triton(x)
    out = grouped_gemm_triton(xq, wq, counts, xs, ws, out_dtype=torch.float32)
    outb = grouped_gemm_triton(x.bfloat16(), w.bfloat16(), counts, out_dtype=torch.float32)
    refs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        refs.append(x[start : start + c].double() @ w[e].double().t())
        start += c
    ref = torch.cat(refs)
    return {"tokens": tokens, "rel_err_vs_fp64": rel(out, ref), "bf16_kernel_rel_err_vs_fp64": rel(outb, ref)}


def time_gemm(m: int, n: int, k: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k
    xq, xs = quantize_act_triton(x)
    wq, ws = quantize_weight(w)
    t_ours = cuda_time(lambda: gemm_triton(xq, wq, xs, ws))
    t_bf16 = cuda_time(lambda: x @ w.t())
    row = {"shape": [m, n, k], "ours_fp8_block_tflops": flops / t_ours / 1e12, "torch_bf16_tflops": flops / t_bf16 / 1e12}
    try:
        xr = x.float().abs().amax(1, keepdim=True) / 448
        wr = w.float().abs().amax(1, keepdim=True) / 448
        xr8, wr8 = (x / xr).to(FP8_DTYPE), (w / wr).to(FP8_DTYPE)
        t_sc = cuda_time(lambda: torch._scaled_mm(xr8, wr8.t(), xr, wr.t(), out_dtype=torch.bfloat16))
        row["torch_scaled_mm_rowwise_tflops"] = flops / t_sc / 1e12
    except Exception as exc:  # noqa: BLE001 - a peer we could not run is reported, not fatal
        row["torch_scaled_mm_rowwise_error"] = str(exc)[:200]
    return row


def time_grouped(tokens: int, experts: int = 128, n: int = 1536, k: int = 2048) -> dict:
    counts = torch.bincount(torch.randint(0, experts, (tokens,), device="cuda"), minlength=experts)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_weight(w)
    xq, xs = quantize_act_triton(x)
    flops = 2 * tokens * n * k
    t8 = cuda_time(lambda: grouped_gemm_triton(xq, wq, counts, xs, ws))
    tb = cuda_time(lambda: grouped_gemm_triton(x, w, counts))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    wt = w.transpose(-2, -1)
    tg = cuda_time(lambda: torch._grouped_mm(x, wt, offs=offs))
    touched = int((counts > 0).sum())
    return {
        "tokens": tokens, "ours_fp8_tflops": flops / t8 / 1e12, "ours_bf16_tflops": flops / tb / 1e12,
        "torch_grouped_mm_bf16_tflops": flops / tg / 1e12,
        "ours_fp8_weight_bytes_per_s": touched * n * k / t8, "ours_fp8_us": t8 * 1e6, "torch_bf16_us": tg * 1e6,
    }


DECODE_SHAPES = [(128, 4096, 2048), (128, 512, 2048), (128, 2048, 4096), (256, 4096, 2048), (256, 512, 2048),
                 (256, 2048, 4096)]
"""Qwen3-30B-A3B's attention projections (q 2048 -> 4096, k / v -> 512, o 4096 -> 2048) at decode batches 128, 256."""


def time_decode_tiles(shapes: list[tuple[int, int, int]] = DECODE_SHAPES) -> dict:
    """The dense FP8 GEMM at decode-sized rows with the tiles chosen to occupy the SMs (the default) and with
    the fixed tiles before it (PRIMERL_FP8_GEMM_TILES=fixed), same inputs, same run; each against the bandwidth
    of reading the weight once (its bytes over the time)."""
    import os

    rows = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_act_triton(x)
        wq, ws = quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
        row = {"shape": [m, n, k]}
        for name, env in (("occupancy", None), ("fixed", "fixed")):
            if env:
                os.environ["PRIMERL_FP8_GEMM_TILES"] = env
            try:
                t = cuda_time(lambda: gemm_triton(xq, wq, xs, ws))
            finally:
                os.environ.pop("PRIMERL_FP8_GEMM_TILES", None)
            row[f"{name}_us"], row[f"{name}_weight_gb_s"] = t * 1e6, n * k / t / 1e9
        row["speedup"] = row["fixed_us"] / row["occupancy_us"]
        rows.append(row)
        log(str({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}))
    return {"decode_tiles": rows, "speedup_min": min(r["speedup"] for r in rows),
            "speedup_max": max(r["speedup"] for r in rows)}


GROUPED_SHAPES = [(11_500, 1536, 2048), (11_500, 2048, 768), (2048, 1536, 2048), (2048, 2048, 768)]
"""Qwen3-30B-A3B's expert projections (gate+up 2048 -> 2x768, down 768 -> 2048; 128 experts, top-8) at a 30B
validator's 64 claims (11,500 tokens, ~720 rows an expert) and at a 2,048-token prefill."""


def time_grouped_tiles(shapes: list[tuple[int, int, int]] = GROUPED_SHAPES, experts: int = 128, top_k: int = 8) -> dict:
    """The grouped FP8 kernel over a sweep of (BLOCK_M, BLOCK_N, warps, stages) against the tiles in force
    (`grouped_tiles`), same inputs, each config checked against the one in force; peers: torch's bf16
    `_grouped_mm` on the same rows and our dense FP8 GEMM over all the rows against one expert's weight."""
    from node.fp8.kernels import grouped_tiles

    rows_out = []
    sweep = [(bm, bn, w, st) for bm in (64, 128) for bn in (64, 128, 256) for w in (4, 8) for st in (3, 4)
             if not (bm == 128 and bn == 256 and st == 4)]
    for tokens, n, k in shapes:
        t = tokens * top_k
        routed = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]).reshape(-1)
        counts = torch.bincount(routed, minlength=experts)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight(w)
        xq, xs = quantize_act_triton(x)
        flops = 2 * t * n * k
        now = grouped_tiles(t, experts)
        ref = grouped_gemm_triton(xq, wq, counts, xs, ws, config=now)
        row: dict = {"tokens": tokens, "rows": t, "n": n, "k": k, "in_force": list(now), "configs": {}}
        for cfg in [now] + [c for c in sweep if c != now]:
            try:
                out = grouped_gemm_triton(xq, wq, counts, xs, ws, config=cfg)
                err = rel(out.float(), ref.double())
                sec = cuda_time(lambda: grouped_gemm_triton(xq, wq, counts, xs, ws, config=cfg))
                row["configs"][",".join(map(str, cfg))] = {"tflops": round(flops / sec / 1e12, 1),
                                                           "us": sec * 1e6, "rel_to_in_force": err}
            except Exception as exc:  # noqa: BLE001 - a tile shape this Triton or this card will not build
                row["configs"][",".join(map(str, cfg))] = {"error": str(exc)[:160]}
        good = {c: v for c, v in row["configs"].items() if "tflops" in v}
        best, in_force = min(good, key=lambda c: good[c]["us"]), good[",".join(map(str, now))]
        row["best"], row["best_tflops"], row["in_force_tflops"] = best, good[best]["tflops"], in_force["tflops"]
        row["best_over_in_force"] = round(in_force["us"] / good[best]["us"], 3)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        row["torch_grouped_mm_bf16_tflops"] = round(flops / cuda_time(
            lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)) / 1e12, 1)
        row["ours_dense_fp8_tflops"] = round(flops / cuda_time(lambda: gemm_triton(xq, wq[0], xs, ws[0])) / 1e12, 1)
        log(str({key: v for key, v in row.items() if key != "configs"}))
        rows_out.append(row)
    # one config for both projections of a prefill of this size (what PRIMERL_FP8_GROUPED_TILES can set): the least
    # summed time over the shapes of the most tokens
    most = [r for r in rows_out if r["tokens"] == max(x["tokens"] for x in rows_out)]
    common = [c for c in most[0]["configs"] if all("us" in r["configs"].get(c, {}) for r in most)]
    both = min(common, key=lambda c: sum(r["configs"][c]["us"] for r in most))
    in_force = ",".join(map(str, most[0]["in_force"]))
    return {"grouped_tiles": rows_out, "best_over_in_force": [r["best_over_in_force"] for r in rows_out],
            "best_prefill_config": both,
            "best_prefill_over_in_force": round(sum(r["configs"][in_force]["us"] for r in most)
                                                / sum(r["configs"][both]["us"] for r in most), 3)}


def main() -> None:
    import sys

    torch.manual_seed(0)
    if "--grouped-tiles" in sys.argv:  # only the grouped expert kernel's tiles at the 30B shapes
        write_result("fp8_grouped_tiles", {"machine": machine_facts(), **time_grouped_tiles()})
        return
    if "--decode-tiles" in sys.argv:  # only the decode-sized dense GEMM's tiles, new against old
        write_result("fp8_decode_tiles", {"machine": machine_facts(), **time_decode_tiles()})
        return
    result: dict = {"machine": machine_facts()}
    log("correctness")
    result["gemm_checks"] = [check_gemm(*s) for s in [(1, 4096, 2048), (77, 1000, 300), (512, 2048, 4096)]]
    result["grouped_checks"] = [check_grouped(t, 16, 384, 512) for t in (5, 300, 4000)]
    log("dense speed")
    result["gemm_speed"] = [time_gemm(*s) for s in [(1, 4096, 2048), (256, 4096, 2048), (4096, 7168, 2048),
                                                      (16384, 4096, 2048), (8192, 8192, 8192)]]
    log("grouped speed")
    result["grouped_speed"] = [time_grouped(t) for t in (8, 2048, 32768)]
    big = result["gemm_speed"][-1]
    result["ratio_fp8_block_vs_bf16_at_8192"] = big["ours_fp8_block_tflops"] / big["torch_bf16_tflops"]
    g = result["grouped_speed"]
    result["ratio_grouped_fp8_vs_torch_bf16"] = [r["ours_fp8_tflops"] / r["torch_grouped_mm_bf16_tflops"] for r in g]
    for r in result["gemm_speed"] + result["grouped_speed"]:
        log(str({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}))
    write_result("fp8_kernels", result)


if __name__ == "__main__":
    main()
