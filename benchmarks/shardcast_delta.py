"""`python -m benchmarks.shardcast_delta`: bytes on the wire for a delta version vs the full one,
on two consecutive policy versions from real RL steps of our model (`primerl-node train-local`).

Runs train-local twice with the same seed on one thread (deterministic on CPU): N steps and
N+1 steps; their checkpoints are versions N and N+1 of one policy. A third run of N steps checks
that determinism (bit-exact). Then, over a real server on 127.0.0.1: a client that holds v N
fetches v N+1 published as a delta; a fresh client fetches v N+1 published as a full version.
Both results are checked bit-exact against the checkpoint. Repeated for the bf16 cast that
inference engines load.

`--real`: SmolLM2-135M-Instruct (real pretrained weights, `node.model.pretrained.load_smollm2`)
with fp32 and bf16 masters at lr 1e-6 and 1e-5, and the tiny MoE at its recipe's lr: versions from
real policy-gradient steps (the project's engine rolls out `reverse`, group advantages, the
project's Trainer/AdamW); per published dtype, bytes per version as full / XOR delta / sparse
delta and single-thread encode/decode GB/s; writes shardcast_delta-real-<machine>.json.
`--real --random SHAPE`: instead, a random model of a `benchmarks.random_checkpoint` shape (N(0, 0.02), as the GPU
network benchmark's `random:` models) with each master dtype and learning rate: the share of its elements (all, the
decoder layers', its bytes) one RL step changes, which sets `benchmarks.gpu_network`'s learning rate for them. The peer (shardcast 0.3.2) has neither compression nor deltas: it sends
the file as is, so its bytes on the wire are the safetensors file's size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[shardcast-delta {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train(out: Path, steps: int, task: str, lr: float | None) -> dict[str, torch.Tensor]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "node.cli", "--log-level", "WARNING", "train-local", "--task", task, "--steps", str(steps),
           "--out", str(out), "--seed", "0", "--threads", "1"] + ([] if lr is None else ["--lr", str(lr)])
    log(" ".join(cmd[2:]))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return load_file(str(out / "checkpoint" / "model.safetensors"))


async def wire_bytes(work: Path, prev: dict, cur: dict, v: int, shard_mib: int) -> dict:
    from protocol.identity import NodeKey
    from shardcast.fetch import fetch_version
    from shardcast.manifest import TrustedPublishers
    from shardcast.publish import PublishOptions, publish
    from shardcast.server import ShardServer
    from shardcast.store import Store

    key = NodeKey.generate()
    trusted = TrustedPublishers([key.peer_id])
    opts = PublishOptions(shard_size=shard_mib << 20, keyframe_every=8)
    delta_origin, full_origin = Store(work / "delta-origin"), Store(work / "full-origin")
    publish(delta_origin, key, "r", v, prev, options=opts)
    dm = publish(delta_origin, key, "r", v + 1, cur, parent=v, options=opts).manifest
    fm = publish(full_origin, key, "r", v + 1, cur, options=opts).manifest
    assert dm.encoding == "delta" and fm.encoding == "full"
    out = {}
    for name, origin in (("delta", delta_origin), ("full", full_origin)):
        server = ShardServer(origin)
        port = await server.start("127.0.0.1", 0)
        try:
            client = Store(work / f"client-{name}")
            url = [f"http://127.0.0.1:{port}"]
            if name == "delta":  # the client already follows the run: it holds v
                await fetch_version(client, url, trusted, "r", v)
            got = await fetch_version(client, url, trusted, "r", v + 1)
            for k, t in cur.items():
                assert torch.equal(got.tensors()[k].view(torch.uint8), t.contiguous().view(torch.uint8)), k
            out[name] = got.wire_bytes_downloaded
        finally:
            await server.stop()
    out["raw"] = fm.total_bytes
    return out


# ---- real RL updates: SmolLM2-135M-Instruct and the tiny MoE (--real) ------------------------

class ChatTokenizer:
    """The engine/rollout tokenizer interface over SmolLM2's HF tokenizer: a task prompt
    ('12345>') becomes a one-turn chat asking for the reversed digits."""

    def __init__(self, hf):
        self.hf, self.eos_id = hf, hf.eos_token_id
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id

    def encode(self, text: str, bos: bool = False) -> list[int]:
        if not bos:
            return self.hf.encode(text, add_special_tokens=False)
        msg = f"Write the digits {text.rstrip('>')} in reverse order. Reply with the digits only."
        text = self.hf.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False)
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True).strip()

    def encode_prompt(self, prompt) -> list[int]:  # noqa: ANN001 (node.envs' Prompt: the task's text or chat messages)
        """The tokenizer interface's prompt encoding (node/model/tokenizer.py): a task's text as the chat above."""
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return self.encode(text, bos=True)


def rl_versions(model, tok, lr: float, steps: int, prompts: int, samples: int, seed: int = 0, task: str = "reverse"):
    """Policy versions 0..steps: the model, then after each real policy-gradient step (rollouts
    from the project's engine on `task`, group advantages, the project's Trainer/AdamW)."""
    import copy

    from node.engine import Engine, SamplingParams
    from node.envs import get_env
    from node.envs.rollout import run_episodes
    from node.model.checkpoint import state_dict_to_hf
    from node.rl.advantages import group_advantages
    from node.rl.batch import build_batch
    from node.rl.warmup import task_seed
    from node.rl.trainer import Trainer, TrainerConfig

    env = get_env(task)
    engine = Engine(copy.deepcopy(model), max_batch=prompts * samples, max_seq_len=128, eos_id=tok.eos_id, decode=tok.decode,
                    capture_experts=model.config.num_experts > 0)
    trainer = Trainer(model, TrainerConfig(lr=lr))
    yield {k: v.clone() for k, v in state_dict_to_hf(model).items()}
    for step in range(steps):
        t0 = time.time()
        episodes = [(f"{step}-{i}-{j}", env.sample_task(task_seed(seed, step, i)), SamplingParams(temperature=1.0, seed=task_seed(seed, step, i) * 64 + j))
                    for i in range(prompts) for j in range(samples)]
        rollouts = run_episodes(engine, env, tok, episodes)
        rewards = torch.tensor([r.reward for r in rollouts]).view(prompts, samples)
        adv = group_advantages(rewards, normalize_std=True).flatten().tolist()
        stats = trainer.train_step(build_batch(rollouts, adv, tok.pad_id))
        state = {k: v.clone() for k, v in state_dict_to_hf(model).items()}
        engine.load_weights(state, version=step + 1)
        log(f"  step {step + 1}: reward {float(rewards.mean()):.3f} (groups with signal {int((rewards.std(1) > 0).sum())}/{prompts}), "
            f"grad norm {stats['grad_norm']:.3g}, {time.time() - t0:.1f}s")
        yield state


def codec_case(prev: dict, cur: dict, shard_mib: int) -> dict:
    """Bytes of `cur` on the wire as a full version, an XOR delta and a sparse-or-XOR delta
    against `prev`; single-thread encode and decode (wire hash, decode, raw hash) GB/s."""
    import numpy as np

    from shardcast.codec import check_wire, decode_shard, encode_shard, flatten, shard_ranges
    from shardcast.publish import shard_word
    from shardcast.sparse import is_sparse

    tensors, new = flatten(cur)
    _, old = flatten(prev)
    ranges = shard_ranges(len(new), shard_mib << 20)
    words = [shard_word(tensors, a, b) for a, b in ranges]
    full = sum(encode_shard(i, new[a:b], None)[0].wire_size for i, (a, b) in enumerate(ranges))
    xor = sum(encode_shard(i, new[a:b], old[a:b], sparse=False)[0].wire_size for i, (a, b) in enumerate(ranges))
    t0 = time.perf_counter()
    enc = [encode_shard(i, new[a:b], old[a:b], word=w) for i, ((a, b), w) in enumerate(zip(ranges, words))]
    enc_s = time.perf_counter() - t0
    out = np.empty_like(new)
    t0 = time.perf_counter()
    for (entry, wire), (a, b) in zip(enc, ranges):
        check_wire(entry, wire)
        decode_shard(entry, wire, out[a:b], old[a:b])
    dec_s = time.perf_counter() - t0
    assert np.array_equal(out, new), "sparse round trip is not bit-exact"
    sparse = sum(e.wire_size for e, _ in enc)
    per = {k: int((prev[k].contiguous().view(torch.uint8).view(-1, prev[k].element_size()) !=
                   cur[k].contiguous().view(torch.uint8).view(-1, cur[k].element_size())).any(1).sum()) for k in cur if cur[k].numel()}
    changed = sum(per.values())
    numel = sum(t.numel() for t in cur.values())
    # the decoder layers alone: most of a large model's bytes (88% of the 8-layer 30B-A3B shape), where a small
    # one's are mostly its embeddings, whose rows only the tokens seen move
    layers = [k for k in per if ".layers." in k]
    decoder = sum(per[k] for k in layers) / max(1, sum(cur[k].numel() for k in layers))
    # the bytes a fetcher keeps as `ChangedBytes` (shardcast/fetch.py, up to CHANGES_UP_TO of the version's)
    changed_bytes = int(np.count_nonzero(new != old))
    return {"raw_bytes": len(new), "full_wire_bytes": full, "xor_wire_bytes": xor, "sparse_wire_bytes": sparse,
            "sparse_shards": sum(is_sparse(w) for _, w in enc), "shards": len(enc), "changed_elements": changed,
            "changed_fraction": changed / numel, "changed_byte_fraction": changed_bytes / len(new),
            "decoder_changed_fraction": decoder,
            "encode_s": enc_s, "decode_s": dec_s}


def real_main(args) -> None:
    from node.model.pretrained import PretrainedUnavailable, load_smollm2

    torch.manual_seed(0)
    cases: list[dict] = []

    def measure(model_name: str, master: str, lr: float, versions: list[dict], published: list[str],
                arch: torch.nn.Module | None = None) -> None:
        for dtype in published:
            if dtype.startswith("fp8-"):  # an FP8 run's versions as the trainer publishes them (bf16 base)
                cast = served_versions(versions, arch, dtype.removeprefix("fp8-"))
            else:
                cast = [{k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in s.items()} for s in versions]
            agg: dict = {}
            steps_changed = []
            for t in range(1, len(cast)):
                r = codec_case(cast[t - 1], cast[t], args.shard_mib)
                steps_changed.append(r["changed_fraction"])
                for k, v in r.items():
                    agg[k] = agg.get(k, 0) + v
            n = len(cast) - 1
            case = {"model": model_name, "master": master, "dtype": dtype, "lr": lr, "transitions": n,
                    "raw_bytes": agg["raw_bytes"] // n, "full_wire_bytes": agg["full_wire_bytes"] // n,
                    "xor_wire_bytes": agg["xor_wire_bytes"] // n, "sparse_wire_bytes": agg["sparse_wire_bytes"] // n,
                    "sparse_shards_share": round(agg["sparse_shards"] / agg["shards"], 3),
                    "changed_fraction": round(agg["changed_fraction"] / n, 7),
                    "changed_byte_fraction": round(agg["changed_byte_fraction"] / n, 7),
                    "decoder_changed_fraction": round(agg["decoder_changed_fraction"] / n, 7),
                    "changed_fraction_per_step": [round(x, 7) for x in steps_changed],
                    "full_over_xor": round(agg["full_wire_bytes"] / agg["xor_wire_bytes"], 2),
                    "full_over_sparse": round(agg["full_wire_bytes"] / agg["sparse_wire_bytes"], 2),
                    "xor_over_sparse": round(agg["xor_wire_bytes"] / agg["sparse_wire_bytes"], 2),
                    "encode_gb_s": round(agg["raw_bytes"] / agg["encode_s"] / 1e9, 3),
                    "decode_gb_s": round(agg["raw_bytes"] / agg["decode_s"] / 1e9, 3)}
            cases.append(case)
            partial = REPO / "benchmarks" / "results" / f".shardcast_delta-real-{args.machine}.partial.json" if not args.out else Path(args.out + ".partial")
            partial.write_text(json.dumps({"cases": cases}, indent=2) + "\n")  # a killed run keeps its finished cases
            log(f"{model_name} master {master} lr {lr:g} as {dtype}: changed {case['changed_fraction']:.4%} (decoder "
                f"{case['decoder_changed_fraction']:.4%}, bytes {case['changed_byte_fraction']:.4%}), full/xor "
                f"{case['full_over_xor']}x, full/sparse {case['full_over_sparse']}x, enc {case['encode_gb_s']} GB/s, dec {case['decode_gb_s']} GB/s")

    try:
        base, hf_tok, _ = load_smollm2(torch.float32)
    except PretrainedUnavailable as exc:
        raise SystemExit(f"SmolLM2 weights unavailable: {exc}")
    tok = ChatTokenizer(hf_tok)
    if args.random:  # a random model of a real shape, as benchmarks.gpu_network's `random:` runs train one
        random_cases(args, tok, measure)
        return write_real(args, cases, "what one RL step changes of a random model, by master dtype and learning rate")
    for master in args.masters.split(","):
        for lr in [float(x) for x in args.lrs.split(",")]:
            import copy

            model = copy.deepcopy(base).to(getattr(torch, master))
            log(f"SmolLM2-135M-Instruct, {master} master, lr {lr:g}: {args.real_steps} RL steps")
            versions = list(rl_versions(model, tok, lr, args.real_steps, args.prompts, args.samples))
            del model
            measure("SmolLM2-135M-Instruct", master, lr, versions, ["bfloat16"] + (["float32"] if master == "float32" else [])
                    + [f"fp8-{m}" for m in args.served.split(",") if m], base)
    if args.skip_moe:
        moe_versions = []
    else:
        moe_versions, moe = tiny_moe_versions(args)
        measure("tiny-MoE (train-local recipe)", "float32", args.moe_lr, moe_versions,
                ["bfloat16", "float32"] + [f"fp8-{m}" for m in args.served.split(",") if m], moe)
    head = [c for c in cases if c["model"].startswith("SmolLM2") and c["dtype"] == "bfloat16" and c["lr"] == 1e-6]
    write_real(args, cases, None, {"aim_full_over_sparse_bf16_lr1e-6": 100,
                                   "headline_full_over_sparse_bf16_lr1e-6": min((c["full_over_sparse"] for c in head),
                                                                                default=None)})


def write_real(args, cases: list[dict], note: str | None, extra: dict | None = None) -> None:
    result = {"benchmark": "shardcast_delta", "mode": "real", "machine": args.machine,
              "task": "reverse-text" if args.random else "reverse", "shard_mib": args.shard_mib,
              "steps_per_setting": args.real_steps, "rollouts_per_step": args.prompts * args.samples, "cases": cases,
              **(extra or {}), **({"note": note} if note else {}),
              "sparse_never_worse_than_xor": all(c["sparse_wire_bytes"] <= c["xor_wire_bytes"] for c in cases)}
    out = Path(args.out or REPO / "benchmarks" / "results" / f"shardcast_delta-real-{args.machine}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    print(json.dumps(result))


def random_cases(args, tok, measure) -> None:  # noqa: ANN001 (real_main's ChatTokenizer and measure)
    """`--random SHAPE`: the shape with N(0, 0.02) weights (benchmarks/random_checkpoint.py's init, SmolLM2's
    vocabulary), each of `--masters`, real RL steps on `reverse-text` (its LCS reward varies even for a random model, so
    the advantages and the gradients are not zero) at each of `--lrs`, published in bf16 (and each `--served` FP8
    form): how many elements and bytes one step changes."""
    from benchmarks.random_checkpoint import SHAPES
    from node.model.qwen3_moe import CausalLM, ModelConfig

    for master in args.masters.split(","):
        for lr in [float(x) for x in args.lrs.split(",")]:
            torch.manual_seed(0)
            model = CausalLM(ModelConfig(**SHAPES[args.random], vocab_size=len(tok.hf), max_position_embeddings=512))
            model.reset_parameters(std=0.02)
            model = model.to(getattr(torch, master))
            log(f"random {args.random}, {master} master, lr {lr:g}: {args.real_steps} RL steps")
            versions = list(rl_versions(model, tok, lr, args.real_steps, args.prompts, args.samples, task="reverse-text"))
            measure(f"random:{args.random}", master, lr, versions,
                    ["bfloat16"] + [f"fp8-{m}" for m in args.served.split(",") if m], model)
            del model, versions


def tiny_moe_versions(args) -> tuple[list[dict], torch.nn.Module]:
    """The tiny MoE of `train-local` (warm-up from random init, then RL at the recipe's lr): its versions, and
    the model (its architecture names what an FP8 run serves in e4m3)."""
    import copy

    from node.engine import Engine
    from node.envs import get_env
    from node.model.qwen3_moe import CausalLM
    from node.model.tokenizer import CharTokenizer
    from node.rl.warmup import warm_up
    from node.train_local import LocalRunConfig

    cfg = LocalRunConfig()
    torch.manual_seed(0)
    env, tok = get_env("reverse"), CharTokenizer()
    model = CausalLM(cfg.tiny().config(tok.vocab_size))
    engine = Engine(copy.deepcopy(model), max_batch=64, eos_id=tok.eos_id, decode=tok.decode)
    log(f"tiny MoE: warm-up {warm_up(model, engine, env, tok, cfg.warmup())}; {args.real_steps} RL steps at lr {args.moe_lr:g}")
    return list(rl_versions(model, tok, args.moe_lr, args.real_steps, 16, 8)), model


def served_versions(versions: list[dict], arch: torch.nn.Module, mode: str) -> list[dict]:
    """Each HF-named version as an FP8 run's trainer publishes it (node/rl/parallel/publish.py `hf_pieces`,
    the role's own rule): the weights cast to bf16, every tensor `mode` serves in e4m3 quantised beside
    its block scales (node/model/served_form.py)."""
    from node.model.checkpoint import hf_to_internal
    from node.model.served_form import fp8_served_params
    from node.rl.parallel.publish import hf_pieces

    names, tied = fp8_served_params(arch, mode), arch.config.tie_word_embeddings
    return [{hf: t for n, w in hf_to_internal(s, arch.config).items()
             for hf, t in hf_pieces(n, w.to(torch.bfloat16), tied, n in names)} for s in versions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="RL steps before the measured step")
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--lr", type=float, default=None, help="RL learning rate (default: train-local's)")
    ap.add_argument("--shard-mib", type=int, default=8)
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--out", default=None)
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct + tiny MoE, real RL steps, full vs XOR vs sparse")
    ap.add_argument("--real-steps", type=int, default=3, help="--real: RL steps per setting (versions measured: steps)")
    ap.add_argument("--masters", default="float32,bfloat16", help="--real: master weight dtypes")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="--real: SmolLM2 learning rates")
    ap.add_argument("--moe-lr", type=float, default=1e-3, help="--real: the tiny MoE's lr (TrainerConfig's default, the recipe's)")
    ap.add_argument("--prompts", type=int, default=4, help="--real: prompts per step")
    ap.add_argument("--served", default="all", help="--real: FP8 modes whose served form (e4m3 + block scales) is "
                    "measured too, comma-separated ('' for none)")
    ap.add_argument("--skip-moe", action="store_true", help="--real: SmolLM2 only")
    ap.add_argument("--random", default=None, metavar="SHAPE",
                    help="--real: instead, a random model of this benchmarks.random_checkpoint shape at each of --lrs")
    ap.add_argument("--samples", type=int, default=4, help="--real: samples per prompt")
    args = ap.parse_args()
    if args.real:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        return real_main(args)
    work = Path(tempfile.mkdtemp(prefix="shardcast-delta-"))
    try:
        n = args.steps
        prev = train(work / "a", n, args.task, args.lr)
        cur = train(work / "b", n + 1, args.task, args.lr)
        again = train(work / "c", n, args.task, args.lr)
        deterministic = all(torch.equal(prev[k], again[k]) for k in prev)
        changed = sum(int((prev[k] != cur[k]).sum()) for k in prev)
        numel = sum(t.numel() for t in prev.values())
        log(f"versions {n} and {n + 1}: {numel} parameters, {changed / numel:.1%} changed; deterministic rerun: {deterministic}")
        result = {"benchmark": "shardcast_delta", "machine": args.machine, "task": args.task, "versions": [n, n + 1], "lr": args.lr or "train-local default",
                  "parameters": numel, "changed_fraction": round(changed / numel, 4), "train_deterministic": deterministic,
                  "checkpoint_dtype": str(next(iter(prev.values())).dtype).removeprefix("torch.")}
        for label, p, c in (("ckpt", prev, cur), ("bf16", {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in prev.items()},
                                                   {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in cur.items()})):
            r = asyncio.run(wire_bytes(work / label, p, c, n, args.shard_mib))
            shutil.rmtree(work / label, ignore_errors=True)
            result[f"{label}_raw_bytes"] = r["raw"]
            result[f"{label}_full_wire_bytes"] = r["full"]
            result[f"{label}_delta_wire_bytes"] = r["delta"]
            result[f"{label}_ratio_full_over_delta"] = round(r["full"] / r["delta"], 2)
            result[f"{label}_ratio_peer_over_delta"] = round(r["raw"] / r["delta"], 2)
            log(f"{label}: raw {r['raw']} B, full {r['full']} B, delta {r['delta']} B -> {r['full'] / r['delta']:.2f}x fewer than full")
        out = Path(args.out or REPO / "benchmarks" / "results" / f"shardcast_delta-{args.machine}.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out}")
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
