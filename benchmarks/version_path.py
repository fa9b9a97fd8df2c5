"""The path of one policy version, module by module, before and after issue 13, and now (issue 22's last
changes): `python -m benchmarks.version_path`.

From the trainer's step that makes version v to the trainer opening the batch that holds rollouts
sampled with v: publish, announce, fetch and load on an inference node, lease, roll out, prove,
submit, verify, verdicts, batch. Each path is a list of the repository modules control passes
through, in order (a call into another module, and the return from it, are each one entry;
consecutive entries in one module are one; third-party and standard-library code is not counted;
the wire between two processes is `protocol/transport.py` on both sides). Traced by hand from the
code: `BEFORE` from main at c734c3a, `AFTER` from issue 13's branch, `NOW` from main at ca5fae3 with
issue 22's last changes (its trace says what moved); docs/architecture.md shows them.

Counts: `modules` (distinct modules on the path), `returns` (entries into a module the path had
already passed through) and `revisits` (returns other than the end of a call into one other module,
A > B > A). The last line is one JSON object.
"""

from __future__ import annotations

import json

TR, INF, VAL = "node/roles/trainer.py", "node/roles/inference.py", "node/roles/validator.py"
COMMON, CLIENT = "node/roles/common.py", "protocol/client.py"
MSG, NET, ENV, ID, WIRE = ("protocol/messages.py", "protocol/network.py", "protocol/envelope.py",
                           "protocol/identity.py", "protocol/transport.py")
SVC, COORD, PIPE, STORE, SEG, LEDGER = ("protocol/coordinator_service.py", "protocol/coordinator.py",
                                        "protocol/pipeline.py", "protocol/store.py", "protocol/segments.py",
                                        "protocol/ledger.py")
TASK, BASE, TOK, ROLL = "node/envs/arithmetic.py", "node/envs/base.py", "node/model/tokenizer.py", "node/envs/rollout.py"
MODEL, MOE, CACHE, ROUTES = "node/model/qwen3_moe.py", "node/model/moe.py", "node/model/cache.py", "node/model/routing.py"
SC_FETCH = ["shardcast/fetch.py", "shardcast/sources.py", "shardcast/fetch.py", "shardcast/manifest.py",
            ID, "shardcast/manifest.py", "shardcast/fetch.py", "shardcast/codec.py", "shardcast/fetch.py",
            "shardcast/store.py", "shardcast/fetch.py"]


def send(seal_from: list[str]) -> list[str]:
    """A signed request or reply leaving a process: seal, then the wire."""
    return [*seal_from, NET, ENV, ID, ENV, NET, WIRE]


def arrive() -> list[str]:
    """A signed message arriving: the wire, open (signature, schema), dispatch."""
    return [WIRE, NET, ENV, ID, ENV, MSG, ENV, NET]


def served(handler: list[str]) -> list[str]:
    """The coordinator answers one request."""
    return [*arrive(), SVC, *handler, SVC, *send([])]


def rpc_before(role: list[str], handler: list[str], built: str) -> list[str]:
    """main: `common.call` runs a lambda or an inner async def of the role's that calls
    `member.net.request`; nothing checks the reply's type. `built`: where the request message is made:
    "first" (before `call`), "lambda" (inside a lambda: `call` awaits what it returns), "inner" (inside
    an inner async def that `call` awaits), "given" (the message exists already, an inner def sends it)."""
    r = role[-1]
    make = [MSG, r]
    if built == "first":
        out, back = [*role, *make, COMMON, r, COMMON], [COMMON, r]
    elif built == "lambda":
        out, back = [*role, COMMON, r, *make, COMMON], [COMMON, r]
    elif built == "inner":
        out, back = [*role, COMMON, r, *make], [r, COMMON, r]
    else:
        out, back = [*role, COMMON, r], [r, COMMON, r]
    return [*out, *send([]), *served(handler), *arrive(), *back]


def rpc_after(role: list[str], handler: list[str]) -> list[str]:
    """This branch: the role calls one `CoordinatorClient` method; the client builds the message,
    sends, and checks the reply's type."""
    return [*role, CLIENT, MSG, CLIENT, *send([]), *served(handler), *arrive(), CLIENT, role[-1]]


def train_step(before: bool) -> list[str]:
    to_rollouts = [TOK, TR, ROLL, TR] if before else [BASE, TOK, BASE, TR, ROLL, MSG, ROLL, TR]
    return [TR, TASK, TR, *to_rollouts, ROUTES, TR, "node/rl/advantages.py", TR, "node/rl/batch.py", TR,
            "node/rl/trainer.py", MODEL, MOE, MODEL, "node/rl/trainer.py", "node/rl/loss.py", "node/rl/trainer.py",
            TR, LEDGER, TR]


def publish_to_shardcast() -> list[str]:
    return [TR, "shardcast/store.py", TR, "node/model/checkpoint.py", TR, "shardcast/publish.py", "shardcast/codec.py",
            "shardcast/publish.py", "shardcast/manifest.py", ID, "shardcast/manifest.py", "shardcast/publish.py",
            "shardcast/store.py", "shardcast/publish.py", TR]


ANNOUNCE = [COORD, LEDGER, COORD, STORE, COORD]           # advance_policy: ledger, versions, stale leases
ANNOUNCE_AFTER = [COORD, LEDGER, COORD, STORE, SEG, STORE, COORD]  # + retention (prune)
GOSSIP = [SVC, *send([]), WIRE, NET, ENV, ID, ENV, MSG, ENV, NET, "protocol/member.py"]


def fetch_and_load(role: str) -> list[str]:
    return [role, COMMON, *SC_FETCH, COMMON, role]


def lease_handler(before: bool) -> list[str]:
    check = [COORD, "protocol/membership.py", COORD]
    grant = [COORD, STORE, "protocol/work.py", COORD] if before else [COORD, STORE, "protocol/work.py", STORE, COORD]
    return ([*check, PIPE, *grant, PIPE] if before      # the service checks membership, then the pipeline
            else [PIPE, *check, PIPE, STORE, PIPE, *grant, PIPE])


def roll_out(before: bool) -> list[str]:
    episodes = [INF, TASK, INF, "protocol/work.py", INF, ROLL, *([TOK] if before else [BASE, TOK, BASE]), ROLL,
                "node/engine/engine.py", "node/engine/sampling.py", "node/engine/engine.py", MODEL, CACHE, MODEL,
                "node/engine/engine.py", ROLL, TASK, ROLL, INF, "verification/proof.py", "verification/poly.py",
                "verification/proof.py", INF]
    submission = ([INF, ROUTES, INF, MSG, INF] if before                      # version_runs + to_submission here
                  else [INF, ROLL, MSG, ROLL, ROUTES, ROLL, INF, MSG, INF])   # Rollout.to_submission, runs_of
    cheat = [INF] if before else []                                         # the cheating branch ran inline
    return [*episodes, *submission, *cheat, INF, "protocol/member.py", INF] if before else \
        [*episodes, *submission, INF, CLIENT, "protocol/member.py", CLIENT, INF]


SUBMIT = [COORD, STORE, COORD, LEDGER, COORD, STORE, SEG, STORE, COORD]
SUBMIT_BEFORE = [COORD, STORE, COORD, LEDGER, COORD, STORE, COORD]
TO_VERIFY = [PIPE, STORE, PIPE, LEDGER, PIPE, STORE, SEG, STORE, PIPE]
TO_VERIFY_BEFORE = [PIPE, STORE, PIPE, LEDGER, PIPE, STORE, PIPE]


def judge(before: bool) -> list[str]:
    claim = [VAL, TASK, VAL, TOK, VAL] if before else [VAL, TASK, BASE, TOK, BASE, VAL, MSG, VAL]
    return [VAL, ENV, ID, ENV, MSG, ENV, VAL, *claim, "protocol/work.py", VAL, "verification/claim.py", VAL,
            *fetch_and_load(VAL), "node/model/checkpoint.py", VAL, "node/replay.py", VAL, "verification/validator.py",
            "verification/checks.py", "verification/proof.py", "verification/hidden_check.py", "verification/routing.py",
            "verification/validator.py", "node/replay.py", MODEL, "node/replay.py", "verification/validator.py", VAL]


VERDICTS = [PIPE, STORE, PIPE]
BATCH = [PIPE, STORE, PIPE, LEDGER, PIPE, STORE, PIPE, STORE, SEG, STORE, PIPE]
BATCH_BEFORE = [PIPE, STORE, PIPE, LEDGER, PIPE, STORE, PIPE, STORE, PIPE]
OPEN_BATCH = [TR, ENV, ID, ENV, MSG, ENV, TR, LEDGER, TR]


def path(before: bool) -> list[str]:
    def rpc(role: list[str], handler: list[str], built: str) -> list[str]:
        return rpc_before(role, handler, built) if before else rpc_after(role, handler)
    seq = [*train_step(before), *publish_to_shardcast()]
    seq += rpc([TR], ANNOUNCE if before else ANNOUNCE_AFTER, "first")   # publish: the coordinator records v
    seq += GOSSIP                                                        # and gossips its announcement
    seq += [INF, *fetch_and_load(INF), "node/engine/engine.py", INF]      # inference: fetch, verify, queue for the engine
    seq += rpc([INF], lease_handler(before), "inner")                    # lease
    seq += roll_out(before)
    seq += rpc([INF], SUBMIT_BEFORE if before else SUBMIT, "given")       # submit
    seq += rpc([VAL], TO_VERIFY_BEFORE if before else TO_VERIFY, "lambda")  # validator: work to verify
    seq += judge(before)
    seq += rpc([VAL], VERDICTS, "lambda")                                # verdicts
    seq += rpc([TR], BATCH_BEFORE if before else BATCH, "lambda")        # trainer: the batch of step v + 1
    seq += OPEN_BATCH
    return [m for i, m in enumerate(seq) if i == 0 or m != seq[i - 1]]


def counts(seq: list[str]) -> dict:
    """modules; returns (entries into a module already passed through); revisits (those returns that
    are not simply the end of a call into one other module, A > B > A)."""
    seen: set[str] = set()
    returns = revisits = 0
    for i, m in enumerate(seq):
        if m in seen:
            returns += 1
            revisits += not (i >= 2 and seq[i - 2] == m)
        seen.add(m)
    return {"modules": len(seen), "returns": returns, "revisits": revisits, "entries": len(seq)}


# ---- now: main at ca5fae3 with issue 22's last changes (branch s8-core) --------------------------------
# Traced the same way and at the same grain as AFTER: each call AFTER lists is followed to where it goes
# now, and a call is added where the code added one (calls AFTER leaves out, such as codec > hashing,
# stay out). What moved since: the trainer's streamed publication (`node/rl/parallel/publish.py`); the
# version lock and retention in shardcast (`locks.py`, `retention.py`) and its downloads (`download.py`);
# the engine core with its weight plan and staging (`core.py`, `weights.py`, `weight_staging.py`) and
# one padding helper (`node/model/batching.py`); seeds bound to the lease holder (`protocol/work.py` in
# `pipeline.stored`) and the unit's shape checked at admission; the client opening accepted units
# (`protocol/work.py` `open_unit`); the validator's resident model (`node/roles/resident_policy.py`);
# verdicts in `protocol/judging.py`; the trainer re-checking each unit and recomputing rewards.
CORE, ENGINE, BATCHING = "node/engine/core.py", "node/engine/engine.py", "node/model/batching.py"
STAGING, WEIGHTS = "node/engine/weight_staging.py", "node/engine/weights.py"
WORK, JUDGING, RESIDENT = "protocol/work.py", "protocol/judging.py", "node/roles/resident_policy.py"
SC_STORE, LOCKS, RETENTION = "shardcast/store.py", "shardcast/locks.py", "shardcast/retention.py"
SC_PUB, PAR_PUBLISH, REPLAY = "shardcast/publish.py", "node/rl/parallel/publish.py", "node/replay.py"
VERSION_LOCK = [SC_STORE, LOCKS, SC_STORE]                 # `store.lock(run, v)`: its lock file's path
RETAIN = [SC_STORE, RETENTION, LOCKS, RETENTION, SC_STORE]  # `store.retain`: versions nobody holds go
SC_FETCH_NOW = ["shardcast/fetch.py", "shardcast/sources.py", "shardcast/fetch.py", "shardcast/manifest.py", ID,
                "shardcast/manifest.py", "shardcast/fetch.py", *VERSION_LOCK, "shardcast/fetch.py", LOCKS,
                "shardcast/fetch.py", "shardcast/download.py", "shardcast/fetch.py", "shardcast/codec.py",
                "shardcast/fetch.py", SC_STORE, "shardcast/fetch.py"]


def fetch_and_load_now(role: str) -> list[str]:
    return [role, COMMON, *SC_FETCH_NOW, COMMON, *RETAIN, COMMON, role]


def reward_now(role: str) -> list[str]:
    """The reward recomputed from the transcript (decode, then the task's reward)."""
    return [role, TOK, role, TASK, role]


def train_step_now() -> list[str]:
    return [TR, TASK, TR, BASE, TOK, BASE, TR, ROLL, MSG, ROLL, TR, ROUTES, *reward_now(TR), "node/rl/advantages.py",
            TR, "node/rl/batch.py", TR, "node/rl/trainer.py", "node/rl/batch.py", BATCHING, "node/rl/batch.py",
            "node/rl/trainer.py", MODEL, MOE, MODEL, "node/rl/trainer.py", "node/rl/loss.py", "node/rl/trainer.py",
            TR, LEDGER, TR]


def publish_now() -> list[str]:
    """`publish_trainer`: the payload's layout and the gather (rank 0 of a world or one process), then
    shardcast's streamed publication under the version's lock; retention once the manifest is listed."""
    return [TR, SC_STORE, TR, PAR_PUBLISH, "shardcast/codec.py", PAR_PUBLISH, "node/rl/parallel/state.py", PAR_PUBLISH,
            SC_PUB, *VERSION_LOCK, SC_PUB, LOCKS, SC_PUB, "shardcast/codec.py", SC_PUB, "shardcast/manifest.py", ID,
            "shardcast/manifest.py", SC_PUB, SC_STORE, SC_PUB, *RETAIN, SC_PUB, PAR_PUBLISH, TR]


def load_now() -> list[str]:
    """The inference node queues the version: checked whole and planned, held by the engine's core."""
    return [INF, *fetch_and_load_now(INF), CORE, ENGINE, STAGING, WEIGHTS, STAGING, ENGINE, CORE, INF]


def roll_out_now() -> list[str]:
    """AFTER's, through the engine core: the swap between two steps (`_apply_pending`: the staged
    version copied in place), admission, the backend's prefill (padded by `node.model.batching`)."""
    episodes = [INF, TASK, INF, WORK, INF, ROLL, BASE, TOK, BASE, ROLL, CORE, ENGINE, STAGING, WEIGHTS, STAGING,
                ENGINE, CORE, ENGINE, BATCHING, ENGINE, MODEL, CACHE, MODEL, ENGINE, "node/engine/sampling.py", ENGINE,
                CORE, ENGINE, CORE, ROLL, TASK, ROLL, INF, "verification/proof.py", "verification/poly.py",
                "verification/proof.py", INF]
    submission = [INF, ROLL, MSG, ROLL, ROUTES, ROLL, INF, MSG, INF]
    return [*episodes, *submission, INF, CLIENT, "protocol/member.py", CLIENT, INF]


def rpc_opened(role: list[str], handler: list[str]) -> list[str]:
    """A client call whose reply holds accepted units: the client opens each (`open_unit`: the envelope,
    then the run's group shape) before the role sees it."""
    return [*role, CLIENT, MSG, CLIENT, *send([]), *served(handler), *arrive(), CLIENT, WORK, ENV, ID, ENV, MSG, ENV,
            WORK, CLIENT, role[-1]]


SUBMIT_NOW = [COORD, STORE, COORD, WORK, COORD, LEDGER, COORD, STORE, SEG, STORE, COORD]  # + the unit's shape
STORED_NOW = [PIPE, STORE, PIPE, WORK, PIPE, STORE, SEG, STORE, PIPE]  # `stored`: seeds bound to the holder
TO_VERIFY_NOW = [PIPE, STORE, PIPE, LEDGER, PIPE, STORE, *STORED_NOW]
BATCH_NOW = [PIPE, STORE, PIPE, LEDGER, PIPE, STORE, PIPE, STORE, *STORED_NOW]


def judge_now() -> list[str]:
    """The units arrive opened; version v joins the resident model as a delta, and the reference
    switches to it in place while its claims are recomputed."""
    claim = [VAL, TASK, BASE, TOK, BASE, VAL, MSG, VAL, WORK, VAL, "verification/claim.py", VAL]
    hold = [VAL, RESIDENT, "node/model/checkpoint.py", RESIDENT, VAL]
    return [*claim, *fetch_and_load_now(VAL), *hold, REPLAY, RESIDENT, REPLAY, VAL, "verification/validator.py",
            "verification/checks.py", "verification/proof.py", "verification/hidden_check.py",
            "verification/routing.py", "verification/validator.py", REPLAY, BATCHING, REPLAY, RESIDENT, REPLAY, MODEL,
            REPLAY, "verification/validator.py", VAL]


def open_batch_now() -> list[str]:
    """`TrainerNode._open` on each opened unit: versions, then what the step will read (task, prompt,
    rollouts, the recomputed reward)."""
    return [TR, LEDGER, TR, TASK, TR, BASE, TOK, BASE, TR, ROLL, MSG, ROLL, *reward_now(TR)]


def path_now() -> list[str]:
    seq = [*train_step_now(), *publish_now()]
    seq += rpc_after([TR], ANNOUNCE_AFTER)                     # announce: the coordinator records v
    seq += GOSSIP                                              # and gossips it
    seq += load_now()                                          # inference: fetch, verify, queue for the engine
    seq += rpc_after([INF], lease_handler(before=False))       # lease
    seq += roll_out_now()                                      # the swap lands, roll out, prove
    seq += rpc_after([INF], SUBMIT_NOW)                        # submit
    seq += rpc_opened([VAL], TO_VERIFY_NOW)                    # validator: work to verify, opened
    seq += judge_now()
    seq += rpc_after([VAL], [JUDGING, STORE, JUDGING])         # verdicts
    seq += rpc_opened([TR], BATCH_NOW)                         # trainer: the batch of step v + 1, opened
    seq += open_batch_now()
    return [m for i, m in enumerate(seq) if i == 0 or m != seq[i - 1]]


BEFORE, AFTER, NOW = path(before=True), path(before=False), path_now()


def main() -> None:
    for name, seq in (("before", BEFORE), ("after", AFTER), ("now", NOW)):
        print(f"[{name}] " + " > ".join(m.removesuffix(".py") for m in seq), flush=True)
    b, a, n = counts(BEFORE), counts(AFTER), counts(NOW)
    print(json.dumps({"benchmark": "version_path", "method": "hand-traced module sequence (see module docstring)",
                      "before": b, "after": a, "now": n,
                      "ratio_returns_now_vs_before": round(n["returns"] / b["returns"], 3),
                      "ratio_returns_after_vs_before": round(a["returns"] / b["returns"], 3),
                      "ratio_modules_after_vs_before": round(a["modules"] / b["modules"], 3),
                      "ratio_revisits_after_vs_before": round(a["revisits"] / b["revisits"], 3)}))


if __name__ == "__main__":
    main()
