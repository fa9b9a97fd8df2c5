"""report.png for `primerl-node sim`: reward curve, staleness histogram, node timeline."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


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
