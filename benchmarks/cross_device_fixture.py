"""Cross-device fixture: honest rollouts generated on one device, judged on another.

    python -m benchmarks.cross_device_fixture --device cuda --out DIR    # generate (or --device cpu)
    python -m benchmarks.cross_device_fixture --judge DIR [--device cuda] # judge DIR on this device
    bash benchmarks/cross_device_device.sh                               # the H200 run, output under $OUT

Generation runs the inference role's own code: an `InferenceNode` of a run whose spec names the tiny
MoE (Qwen3-MoE layout, the character tokenizer's 88-token vocabulary, recipe `SHAPE`, bf16 weights as
the GPU engine serves them), its engine built by the registry as the role builds it (`builtin-cuda`:
`CudaEngine` with a CUDA graph per batch bucket, captured before the weights arrive; `builtin`: `Engine`
on the CPU), version 0 loaded through `load_weights`, rounds of leases rolled out and proved by
`InferenceNode._roll_out` (routed experts attached, router replay on), and every submission turned into
the claim the validator role builds (`ValidatorNode._claim`). Cases (`CASES`): four environments
(`ENVIRONMENTS`: short and longer prompts, completions of 1 to 39 tokens, multi-turn episodes whose later
turns prefill the transcript so far) x engine batches 1, 8 and 64 (leases x group size) at temperature 1,
seeded; and greedy at batch 8.
Writes the fixture (benchmarks/cross_device_files.py) to DIR and ends with one JSON line.

`--judge DIR` loads a fixture's weights on `--device` as the validator role does (`--device cuda`: the
role's GPU path, the same `TorchReference` with its model on the GPU) and verifies every claim with
`verify_claims`, in one round and each claim in a round of its own; one JSON line with the accepted /
rejected counts, the reasons, the honest drift beside the thresholds in force, and the fixture's origin.
tests/verification/test_cross_device.py judges the committed fixture on the CPU in CI.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.cross_device_files import drift, judge, read_fixture, reference, write_fixture, write_weights
from node.envs.user import is_user_task, task_identity
from node.model.checkpoint import read_weights
from node.roles.common import blank_model, check_device
from node.roles.inference import InferenceNode
from node.roles.validator import ValidatorNode
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import LeaseGrant, RunSpec, StoredWork
from protocol.model_spec import ModelSpec
from verification.claim import RolloutClaim

log = logging.getLogger("bench.cross_device")

SHAPE = {"hidden": 128, "layers": 2, "experts": 8, "top_k": 2, "seed": 0}
"""The tiny MoE's recipe: qwen3-moe-tiny's widths (benchmarks/random_checkpoint.py: hidden 128, 4 heads of
32, 2 KV heads, 8 experts, top-2, 2 layers), its expert width the tiny MoE's (= hidden)."""
WEIGHT_STD = 0.1
"""Init std of the random weights: peaked next-token distributions (0.02 gives nearly uniform ones)."""
ENVIRONMENTS = ("reverse", "calculator", "benchmarks.cross_device_env:Echo", "benchmarks.cross_device_env:Chatter")
"""Built-in character tasks (prompts of 5-8 tokens, turns of 8-12) and the fixture's own (longer prompts and
completions, frequent tool turns; benchmarks/cross_device_env.py), pinned by source hash as a run pins them."""
CASES = [(env, leases, group, temperature)
         for env in ENVIRONMENTS
         for leases, group, temperature in ((1, 1, 1.0), (4, 2, 1.0), (16, 4, 1.0), (4, 2, 0.0))]
"""(environment, leases per round, group size, temperature): the engine's batch is leases x group size."""
ROUNDS = {1: 4}
"""Rounds per case by engine batch (default 1): batch 1 runs 4 single-rollout rounds."""


def fixture_spec(env: str, group: int) -> RunSpec:
    env = task_identity(env) if is_user_task(env) else env
    return RunSpec(run_id="cross-device", coordinator="c", environment=env, group_size=group, recipe=SHAPE,
                   model=ModelSpec(dtype="bfloat16"))


def random_weights(spec: RunSpec) -> torch.nn.Module:
    torch.manual_seed(SHAPE["seed"])
    model = blank_model(spec)  # on the CPU: the engine moves it to its device
    model.reset_parameters(std=WEIGHT_STD)
    return model


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def roll_out_case(env: str, leases: int, group: int, temperature: float, device: str, engine: str, state: dict,
                  manifest: bytes, workdir: Path, first_work_id: int) -> tuple[list[RolloutClaim], dict]:
    """One case: a fresh inference node and engine of batch leases x group, `ROUNDS` rounds of leases,
    each submission turned into the validator role's claim."""
    spec = fixture_spec(env, group)
    key = NodeKey.generate()
    node = InferenceNode(key, spec, "", workdir / "inference", leases_per_request=leases, engine=engine,
                         device=device)
    validator = ValidatorNode(NodeKey.generate(), spec, "", workdir / "validator")
    if temperature != node.recipe.temperature:
        # greedy is no recipe's temperature (it must be > 0), but a lease's sampling may be: both sides
        # read the recipe's, so both are told the same
        node.recipe = node.recipe.model_copy(update={"temperature": temperature})
        validator.recipe = node.recipe
    from node.engine import registry

    node.engine = registry.build(node.engine_name, node.engine_setup)  # as the role does in its start-up task
    node.engine.load_weights(state, 0)
    node.hashes, node._newest_loaded = {0: manifest.hex()}, 0
    claims, work_id = [], first_work_id
    for _ in range(ROUNDS.get(leases * group, 1)):
        grants = [LeaseGrant(work_id=work_id + i, holder=key.peer_id, policy_version=0, task_index=7919 * (work_id + i),
                             seed=1_000_003 * (work_id + i) + 17, deadline=time.time() + 3600) for i in range(leases)]
        work_id += leases
        for grant, group_msg in zip(grants, node._roll_out(grants)):
            item = StoredWork(work_id=grant.work_id, task_index=grant.task_index, seed=grant.seed,
                              envelope=seal(key, spec.run_id, group_msg))
            claims += [validator._claim(item, j, sub) for j, sub in enumerate(group_msg.rollouts)]
    facts = {"engine": f"{type(node.engine).__module__}.{type(node.engine).__name__}",
             "graphs": bool(getattr(node.engine, "use_graphs", False))}
    registry.close(node.engine)
    return claims, facts


def generate(device: str, out: Path, engine: str | None = None) -> dict:
    """`engine`: the registry's name (default: `builtin-cuda` on a CUDA device, `builtin` on the CPU)."""
    engine = engine or ("builtin-cuda" if device.startswith("cuda") else "builtin")
    base = fixture_spec(CASES[0][0], 1)
    model = random_weights(base)
    manifest = write_weights(out, model)
    state = read_weights(out)  # the HF-named tensors a fetched version hands the engine
    check_device(device)
    claims: list[RolloutClaim] = []
    cases: list[str] = []
    facts: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for env, leases, group, temperature in CASES:
            got, facts = roll_out_case(env, leases, group, temperature, device, engine, state, manifest, Path(tmp),
                                       first_work_id=len(claims) + 1)
            name = f"{env.rpartition(':')[2].lower()}/batch{leases * group}/t{temperature:g}"
            log.info("%-26s %3d claims, %4d tokens", name, len(got), sum(len(c.token_ids) for c in got))
            claims += got
            cases += [name] * len(got)
    provenance = {
        "command": f"python -m benchmarks.cross_device_fixture --device {device} --engine {engine} --out DIR",
        "device": device, "device_name": device_name(device), "torch": torch.__version__,
        "cuda": torch.version.cuda if device.startswith("cuda") else None, "triton": triton_version(),
        "dtype": base.model.dtype,
        "fp8": base.model.fp8, **facts, "engine_batches": sorted({leases * group for _, leases, group, _ in CASES}),
        "temperatures": sorted({t for *_, t in CASES}),
        "environments": sorted({fixture_spec(c[0], 1).environment for c in CASES}),
        "router_replay": any(c.routed_experts is not None for c in claims), "threads": torch.get_num_threads(),
        "numerics": numerics(device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "generate_s": round(time.perf_counter() - t0, 1),
    }
    write_fixture(out, base, claims, cases, provenance)
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    return {"out": str(out), "claims": len(claims), "tokens": sum(len(c.token_ids) for c in claims),
            "with_routes": sum(c.routed_experts is not None for c in claims),
            "multi_turn": sum(not all(c.sampled_mask) for c in claims), "bytes": sizes,
            "total_bytes": sum(sizes.values()), **{k: provenance[k] for k in ("device_name", "engine", "graphs", "torch")}}


def judge_report(directory: Path, device: str, singly: bool = True) -> dict:
    """Counts of one judging round of every claim; with `singly`, also of each claim judged in a round of its
    own (the recomputation's numbers move with the batch a claim is prefilled in: docs/verification.md)."""
    fx = read_fixture(directory)
    t0 = time.perf_counter()
    ref = reference(fx, device)
    verdicts = judge(fx, ref=ref)
    judge_s = time.perf_counter() - t0
    rejected = Counter(f"{case}: {v.reason.value}" for case, v in zip(fx.cases, verdicts) if not v.accepted)
    return {"fixture": str(directory), "generated_on": fx.generated_on, "judged_on": device_name(device),
            "judge_device": device, "torch": torch.__version__, "claims": len(verdicts),
            "accepted": sum(v.accepted for v in verdicts), "rejected": sum(not v.accepted for v in verdicts),
            "rejections": dict(rejected), "details": [v.detail for v in verdicts if not v.accepted][:20],
            "judge_s": round(judge_s, 2), "numerics": numerics(device), "drift": drift(fx, ref),
            **(_singly(fx, ref) if singly else {})}


def _singly(fx, ref) -> dict:
    verdicts = [judge(fx, [c], ref=ref)[0] for c in fx.claims]
    return {"one_at_a_time": {"accepted": sum(v.accepted for v in verdicts), "rejected": sum(not v.accepted for v in verdicts),
                              "rejections": dict(Counter(f"{case}: {v.reason.value}" for case, v in zip(fx.cases, verdicts)
                                                         if not v.accepted)),
                              "details": [v.detail for v in verdicts if not v.accepted][:20]}}


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def numerics(device: str) -> dict:
    """The matmul settings the recomputation ran under on this device."""
    out = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
           "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    if device.startswith("cuda"):
        out.update(cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                   cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                   bf16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:i: where to generate (or judge)")
    ap.add_argument("--out", type=Path, help="directory to write the fixture to")
    ap.add_argument("--engine", choices=["builtin", "builtin-cuda"], default=None,
                    help="the engine to generate with (default: builtin-cuda on CUDA, builtin on the CPU; "
                         "builtin-cuda on the CPU runs CudaEngine eagerly, without graphs)")
    ap.add_argument("--judge", type=Path, help="judge this fixture on --device instead of generating one")
    ap.add_argument("--batched-only", action="store_true", help="with --judge: skip judging each claim on its own")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if (args.out is None) == (args.judge is None):
        ap.error("give exactly one of --out (generate) and --judge (judge)")
    if args.judge is not None:
        report = judge_report(args.judge, args.device, singly=not args.batched_only)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        report = generate(args.device, args.out, args.engine)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
