"""Weak tampering: detection rate per submission against the size of a weight perturbation, next to
the honest variation the thresholds must pass.

    python -m benchmarks.weak_tamper [--rollouts 48] [--out benchmarks/results/weak_tamper-cpu-2core.json]
    python -m benchmarks.weak_tamper --fp8 experts --dtypes float32 --sizes 0.0003,0.001,0.003,0.01 \
        [--out benchmarks/results/weak_tamper-fp8-experts-float32-cpu-2core.json]

Tiny MoE model (tests/verification/rollouts.py), CPU. Tampered engines run weights
w + s * std(w) * N(0, 1) for s from 0.01% to 1% of each tensor's std, on layer 0 only or on every
layer (norm weights untouched), in float32 and bfloat16; every rollout (one submission, with proof,
logprobs and routed experts) goes through `verify_claims` against the honest weights. The peer in
the same run is the honest variation: engine batch 1/8/32, 1 and 2 threads, each precision, which
must all pass; their raw figures (`verification.calibration.measure`) and the router-logit spread
(KV-cached decode against one prefill) are reported beside. Prints progress, then one JSON line.

`--fp8 experts|all`: an FP8 run (`ModelSpec.fp8`). The honest engines and the validator's reference are
quantised by `apply_fp8_mode` (the CPU reference GEMM); a tampered engine perturbs the high-precision
weights, then quantises them as an honest node would, so the detection figures are at the FP8
thresholds (`fp8-<mode>-<dtype>` in verification/checks.py).

On a GPU (the node's CUDA engine and the validator's GPU path), per submission, with the engine swaps
(an FP8 engine in a bf16 run, an unquantised one in an FP8 run) and a stale version: `benchmarks.detection_device`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

from node.engine import Engine
from node.model.cache import KVCache
from node.model.routing import RouteShape, encode_routes
from protocol.model_spec import FP8_MODES
from verification.calibration.measure import measure, summarize
from verification.checks import THRESHOLDS, Severity
from verification.validator import verify_claims

log = logging.getLogger("bench.weak_tamper")
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "verification"))
import rollouts as R  # noqa: E402  (the shared harness: model, engine, claims)

SIZES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
"""Perturbation std as a share of each weight tensor's std (0.01% .. 1%)."""


def perturbed(model: torch.nn.Module, size: float, scope: str, seed: int = 1) -> torch.nn.Module:
    """A copy whose weights (layer 0 only, or all) carry Gaussian noise of `size` x their std."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or (scope == "layer0" and not name.startswith("model.layers.0.")):
                continue
            w = p.float()
            p.copy_((w + size * w.std() * torch.randn(p.shape, generator=g)).to(p.dtype))
    return m


def claims_of(engine_model, ref_model, work, max_batch: int, threads: int, version: int = 0):
    """Rollouts of `engine_model` (serving policy `version`) as claims with routes, generated at this
    batch size and thread count."""
    torch.set_num_threads(threads)
    engine = Engine(engine_model, max_batch=max_batch, max_seq_len=R.MAX_SEQ, eos_id=R.TOK.eos_id,
                    decode=R.TOK.decode, capture_hidden=True, capture_experts=True, version=version)
    comps = R.generate(engine, work)
    torch.set_num_threads(2)
    shape = RouteShape.of(ref_model.config)
    return [c.model_copy(update={"routed_experts": encode_routes(comp.routed_experts, shape)})
            for c, comp in zip(R.claims_from(comps, work), comps)]


def judged(claims, ref, details: int = 0, evidence: list | None = None) -> dict:
    """Shares of `claims` rejected by `verify_claims` (as proof, as borderline), the reasons, and the first
    `details` rejections' detail lines; with `evidence` (an empty list), also the verdicts under `verdicts`
    and each claim's evidence in the list."""
    verdicts = verify_claims(claims, ref, evidence=evidence)
    n = len(verdicts)
    out = {"rollouts": n, "rejected": round(sum(not v.accepted for v in verdicts) / n, 4),
           "proof": round(sum(v.severity == Severity.PROOF for v in verdicts) / n, 4),
           "borderline": round(sum(v.severity == Severity.BORDERLINE for v in verdicts) / n, 4),
           "reasons": dict(Counter(v.reason.value for v in verdicts if not v.accepted))}
    if details:
        out["details"] = [v.detail[:200] for v in verdicts if not v.accepted][:details]
    if evidence is not None:
        out["verdicts"] = verdicts
    return out


def ref_precision(dtype: str, fp8: str) -> str:
    """The thresholds key the validator's reference picks (node/replay.py TorchReference.precision)."""
    return dtype if fp8 == "off" else f"fp8-{fp8}-{dtype}"


@torch.inference_mode()
def router_logit_spread(model, threads: int, batch: int = 8, length: int = 48) -> float:
    """Largest |router logit| difference between KV-cached decode (one token per step, `batch` rows)
    and one prefill of the same sequences: the delta of `verification.routing.ROUTER_TIE`."""
    torch.set_num_threads(threads)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    full = torch.stack(model(ids).router_logits, 1).float().view(batch, length, -1)
    cache = KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, length, cfg.head_dim,
                    dtype=next(model.parameters()).dtype)
    steps = [torch.stack(model(ids[:, t : t + 1], torch.full((batch, 1), t), cache, torch.arange(batch)).router_logits,
                         1).float().view(batch, 1, -1) for t in range(length)]
    torch.set_num_threads(2)
    return float((full - torch.cat(steps, 1)).abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=48, help="rollouts (submissions) per case")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="base dtypes to run, comma-separated")
    ap.add_argument("--sizes", default=",".join(f"{x:g}" for x in SIZES),
                    help="noise sizes (share of each tensor's std), comma-separated")
    ap.add_argument("--fp8", choices=FP8_MODES, default="off",
                    help="judge an FP8 run: engines and reference quantised this way (node/engine/fp8/model.py)")
    args = ap.parse_args(argv)
    from node.engine.fp8.model import apply_fp8_mode

    def served(m: torch.nn.Module) -> torch.nn.Module:
        """What an engine (or the validator) of this run computes with: a copy, quantised as the run says."""
        return apply_fp8_mode(copy.deepcopy(m), args.fp8)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.perf_counter()
    work = [(s, R.spec(s)) for s in range(5000, 5000 + args.rollouts)]
    honest, tamper, spread, threshold = {}, {}, {}, {}
    sizes = tuple(float(x) for x in args.sizes.split(","))
    dtypes = [d for d in args.dtypes.split(",") if d]
    for precision, dtype in ((d, getattr(torch, d)) for d in dtypes):
        model = R.tiny_model(dtype=dtype)
        ref = R.reference({0: served(model)})
        assert ref.precision == ref_precision(precision, args.fp8), ref.precision
        spread[precision] = {f"threads{t}": router_logit_spread(served(model), t) for t in (1, 2)}
        rows_all = []
        for batch in (1, 8, 32):
            for threads in (1, 2):
                claims = claims_of(served(model), model, work, batch, threads)
                rows_all += measure(claims, ref)
                honest[f"{precision}/batch{batch}/threads{threads}"] = judged(claims, ref)
                log.info("honest %s batch %d threads %d: %s", precision, batch, threads,
                         honest[f"{precision}/batch{batch}/threads{threads}"])
        honest[f"{precision}/figures"] = summarize(rows_all)
        for scope in ("layer0", "all"):
            for size in sizes:
                claims = claims_of(served(perturbed(model, size, scope)), model, work, 32, 2)
                name = f"{precision}/{scope}/{size:g}"
                tamper[name] = {**judged(claims, ref), "figures": summarize(measure(claims, ref))}
                log.info("tamper %s: %s", name, {k: v for k, v in tamper[name].items() if k != "figures"})
            caught = [s for s in sizes if tamper[f"{precision}/{scope}/{s:g}"]["rejected"] >= 0.99]
            threshold[f"{precision}/{scope}"] = min(caught) if caught else None
    honest_rejected = {p: max(v["rejected"] for k, v in honest.items() if k.startswith(p) and "rejected" in v)
                       for p in dtypes}
    result = {
        "bench": "weak_tamper", "machine": platform.node(), "torch": torch.__version__,
        "command": f"python -m benchmarks.weak_tamper --rollouts {args.rollouts} --dtypes {args.dtypes} "
                   f"--sizes {args.sizes}" + (f" --fp8 {args.fp8}" if args.fp8 != "off" else ""),
        "fp8": args.fp8, "thresholds": {p: asdict(THRESHOLDS[ref_precision(p, args.fp8)]) for p in dtypes},
        "seconds": round(time.perf_counter() - t0, 1),
        "honest_rejected_max": honest_rejected,
        "smallest_size_caught_99pct": threshold,
        "detection_at_0.1pct": {k: tamper.get(f"{k}/0.001", {}).get("rejected") for k in threshold},
        "detection_at_1pct": {k: tamper.get(f"{k}/0.01", {}).get("rejected") for k in threshold},
        "detection_by_size": {k: {f"{s:g}": tamper[f"{k}/{s:g}"]["rejected"] for s in sizes} for k in threshold},
        "honest_rollouts": sum(v["rollouts"] for k, v in honest.items() if "rejected" in v),
        "router_logit_spread": spread, "honest": honest, "tamper": tamper,
    }
    line = json.dumps(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
