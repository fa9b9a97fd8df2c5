"""What a `primerl-node sim` run shows at its end: the audit (`summarize`, from the coordinator's store
and the trainer's per-step log, never assumed) and report.png (reward curve, staleness, node timeline).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

REWARD_TARGET = 0.8
"""reward_last5 the reverse task must reach (the train-local target)."""


def summarize(out: Path, rows: list[dict], cfg: dict, keys: dict, cheater_names: list[str], wall: float,
              status: str, t0: float) -> dict:
    from protocol.coordinator import Coordinator
    from protocol.messages import RunSpec

    spec = RunSpec.model_validate_json((out / "coordinator" / "spec.json").read_bytes())
    state = Coordinator(out / "coordinator", spec)
    g = cfg["group_size"]
    try:
        accepted = state.store.accepted()
        unreadable = 0
        engine_of: dict[int, str] = {}
        for rec in accepted:
            try:
                unit = state.load_rollout(rec)
                engine_of[rec.work_id] = getattr(unit, "rollouts", [unit])[0].engine
            except Exception:
                unreadable += 1
        trained: dict[int, int] = {}
        for r in rows:
            for w in r["work_ids"]:
                trained[w] = trained.get(w, 0) + 1
        batched = state.store.batched_ids()
        # Batched by the coordinator but never trained: lost, except a batch of a step the trainer
        # had not finished when the run ended (it would get the same batch again on resume).
        last_step = rows[-1]["step"] if rows else 0
        open_batch = state.store.batched_ids(after_step=last_step)
        lost_groups = unreadable + len(batched - set(trained) - open_batch) + len(set(trained) - batched)
        dup_groups = sum(c - 1 for c in trained.values() if c > 1)
        banned = state.store.banned_peers()
        cheater_ids = {keys[n].peer_id for n in cheater_names}
        totals = state.store.totals()
        rejected, stale = totals["rejected"], totals["dropped_stale"]
    finally:
        state.close()
    rewards = [r["reward_mean"] for r in rows]
    reached = next((i for i in range(4, len(rows)) if sum(rewards[i - 4 : i + 1]) / 5 >= REWARD_TARGET), None)
    warm = json.loads((out / "trainer" / "warmup.json").read_text()) if (out / "trainer" / "warmup.json").exists() else {}
    return {
        "status": status, "task": cfg["task"], "steps": len(rows), "steps_target": cfg["recipe"]["steps"],
        "inference_nodes": sum(k.startswith("inference") for k in keys),
        "reward_first": rewards[0] if rewards else None,
        "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]) if rewards else None,
        "rollouts_accepted": len(accepted) * g, "rollouts_rejected": rejected * g,
        "rollouts_trained": len(trained) * g, "rollouts_dropped_stale": stale * g,
        "rollouts_lost": lost_groups * g, "rollouts_duplicated": dup_groups * g,
        "rollouts_trained_by_engine": {e: sum(engine_of.get(w) == e for w in trained) * g
                                       for e in sorted(set(engine_of.values()))},
        "max_off_policy_seen": max((max(r["lags"]) for r in rows), default=0),
        "max_off_policy_steps": cfg["max_off_policy_steps"],
        "cheaters": len(cheater_ids), "cheaters_banned": len(cheater_ids & banned),
        "honest_banned": len(banned - cheater_ids), "wall_s": round(wall, 1),
        "reward_target": REWARD_TARGET, "target_reached_step": None if reached is None else rows[reached]["step"],
        "target_reached_s": None if reached is None else round(rows[reached]["t"] - t0, 1), **warm,
    }



def plot_report(path: Path, rows: list[dict], events: dict[str, list[tuple[float, str]]], t0: float,
                summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows])
    a.set(xlabel="trainer step", ylabel="mean reward", ylim=(0, 1), title=f"reward ({summary.get('task')})")
    a.grid(alpha=0.3)
    lags = Counter(lag for r in rows for lag in r["lags"])
    b.bar(list(lags), list(lags.values()))
    b.set(xlabel="off-policy lag (versions)", ylabel="groups trained",
          title=f"staleness (k = {summary.get('max_off_policy_steps')})")
    end = max([t for ev in events.values() for t, _ in ev] + [t0 + 1])
    for y, (name, ev) in enumerate(sorted(events.items())):
        up = None
        for t, what in ev:
            if what == "start":
                up = t
            elif up is not None:
                c.plot([up - t0, t - t0], [y, y], color="tab:green", lw=6)
                if what == "kill":
                    c.plot([t - t0], [y], "rx")
                up = None
        if up is not None:
            c.plot([up - t0, end - t0], [y, y], color="tab:green", lw=6)
    c.set_yticks(range(len(events)), sorted(events))
    c.set(xlabel="seconds", title="node timeline (x = SIGKILL)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
