"""Rank 0 of the EP role-engine tests (test_ep_role.py): run as a plain script, it starts rank 1 the way
`join --role inference --ep 2` does (node.engine.ep_spawn), builds the engine through the registry
(`builtin-ep`), and writes what it saw to argv[1] as JSON. Started with RANK > 0, it is that rank.

Modes (argv[2]): `serve` (tokens, logprobs, versions, routes against the built-in engine; a version switch
mid-generation; a refused version; the real validator's verdicts), `rank-dies` (rank 1 is SIGKILLed
between two steps), `leader-dies` (rank 0 SIGKILLs itself once rank 1 serves).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "verification"))
import rollouts as R  # noqa: E402

from node.engine import Engine  # noqa: E402
from node.engine import registry as engines  # noqa: E402
from node.engine.ep_spawn import spawn_followers, watch_parent  # noqa: E402
from node.engine.ep_world import EPRankLost, EPWorldStopped, follow  # noqa: E402
from node.engine.registry import EngineSetup, EngineUnavailable  # noqa: E402
from node.model.checkpoint import InvalidCheckpoint, state_dict_to_hf  # noqa: E402
from verification.validator import verify_claims  # noqa: E402


def setup(workdir: Path) -> EngineSetup:
    cfg = R.tiny_model().config
    return EngineSetup(model=lambda: R.tiny_model(seed=99), hf_config=cfg.to_hf_dict(), max_batch=4,
                       max_seq_len=R.MAX_SEQ, eos_id=R.TOK.eos_id, encode=R.TOK.encode, decode=R.TOK.decode,
                       bos_id=R.TOK.bos_id, capture_experts=True, workdir=workdir, salt="run", ep=2)


def work(n: int = 8):
    return [(7000 + i, R.spec(7000 + i, temperature=0.0 if i % 2 == 0 else 1.0, max_new_tokens=24)) for i in range(n)]


def run(engine, items, swap_after: int | None = None, new=None):
    """`items` through `engine`; with `swap_after`, version 1 is queued after that many steps."""
    for seed, sp in items:
        engine.add_request(R.request(seed, sp))
    done, steps = {}, 0
    while engine.has_work():
        for c in engine.step():
            done[c.request_id] = c
        steps += 1
        if steps == swap_after:
            engine.load_weights(new, version=1)
    return [done[f"w{seed}"] for seed, _ in items]


def summary(completions) -> list:
    return [(c.token_ids, c.logprobs, c.versions) for c in completions]


def serve(ep, out: dict) -> None:
    m0, m1 = R.tiny_model(seed=0), R.tiny_model(seed=1)
    v0, v1 = state_dict_to_hf(m0), state_dict_to_hf(m1)
    items = work()
    ep.load_weights(v0, version=0)
    ref = Engine(R.tiny_model(seed=0), max_batch=8, max_seq_len=R.MAX_SEQ, eos_id=R.TOK.eos_id, decode=R.TOK.decode,
                 capture_hidden=True, capture_experts=True)
    want, got = run(ref, items, swap_after=3, new=v1), run(ep, items, swap_after=3, new=v1)
    out["served"] = list(ep.served)
    out["tokens_equal"] = [c.token_ids for c in got] == [c.token_ids for c in want]
    out["versions_equal"] = [c.versions for c in got] == [c.versions for c in want]
    out["versions"] = sorted({v for c in got for v in c.versions})
    out["logprob_max_diff"] = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
    out["hidden_max_diff"] = max(float((g.hidden - w.hidden).abs().max()) for g, w in zip(got, want))
    out["routes_equal"] = all(torch.equal(g.routed_experts, w.routed_experts) for g, w in zip(got, want))
    verdicts = verify_claims(R.claims_from(got, items), R.reference({0: m0, 1: m1}))
    out["verdicts"] = [(v.accepted, str(v.reason), v.detail) for v in verdicts]
    bad = dict(v1)
    name = next(k for k in bad if "experts" in k)
    bad[name] = bad[name][:-1]
    ep.load_weights(bad, version=2)
    try:
        ep.step()
        out["refused"] = None
    except InvalidCheckpoint as exc:
        out["refused"] = str(exc)
    again = run(ep, items[:2])  # every rank still serves version 1
    out["after_refused"] = [c.versions for c in again] == [[1] * len(c.versions) for c in again]


def main() -> None:
    path, mode = Path(sys.argv[1]), sys.argv[2]
    workdir = path.parent
    if int(os.environ.get("RANK", "0")) > 0:
        if mode == "rank-fails-at-start":
            raise SystemExit(5)
        watch_parent(poll_s=0.2)
        follow(setup(workdir))
        return
    followers = spawn_followers(2, [sys.executable, __file__, *sys.argv[1:]], workdir)
    out: dict = {"mode": mode}
    t0 = time.time()
    if mode == "rank-fails-at-start":
        try:
            engines.build("builtin-ep", setup(workdir))
            out["error"] = None
        except EngineUnavailable as exc:
            out["error"] = f"EngineUnavailable: {exc}"
        out["error_after_s"] = time.time() - t0
        out["exit_codes"] = followers.close()
        path.write_text(json.dumps(out))
        return
    ep = engines.build("builtin-ep", setup(workdir))
    out["start_s"] = time.time() - t0
    try:
        if mode == "serve":
            serve(ep, out)
        elif mode == "rank-dies":
            ep.load_weights(state_dict_to_hf(R.tiny_model()), version=0)
            run(ep, work(2))
            followers.procs[1].send_signal(signal.SIGKILL)
            followers.procs[1].wait()
            t = time.time()
            try:
                run(ep, work(2))
                out["error"] = None
            except EPRankLost as exc:
                out["error"] = f"EPRankLost: {exc}"
            out["error_after_s"] = time.time() - t
        elif mode == "leader-dies":
            ep.load_weights(state_dict_to_hf(R.tiny_model()), version=0)
            run(ep, work(2))
            path.write_text(json.dumps({"follower_pid": followers.procs[1].pid}))
            os.kill(os.getpid(), signal.SIGKILL)
    finally:
        t = time.time()
        ep.close()
        out["exit_codes"] = followers.close()
        out["close_s"] = time.time() - t
        try:
            run(ep, work(1))
            out["after_close"] = None
        except EPWorldStopped as exc:
            out["after_close"] = type(exc).__name__
    path.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
    # a world that lost a rank leaves gloo threads that abort the interpreter's finalization ("terminate called
    # without an active exception", exit -6, once in a fresh-clone suite): the figures are written, leave now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
