"""benchmarks.gpu_network's picture: per run (k), each step's time stacked (waiting for the batch,
training: the host's batch and the update apart where the rows say, publishing), and a timeline of the policy
version each inference node sampled with."""

from __future__ import annotations

from pathlib import Path


def plot(path: Path, runs: list[dict], result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(5 * len(runs), 7), squeeze=False)
    for col, run in enumerate(runs):
        rows = run["_rows"]
        steps = [r["step"] for r in rows]
        bottom = [0.0] * len(rows)
        ax = axes[0][col]
        # the trainer's rows since session 31 split train_s: the host's batch, the update, and the rest (the thread's hop)
        split = bool(rows) and all("batch_s" in r and "update_s" in r for r in rows)
        parts = (("batch_s", "#aec7e8"), ("update_s", "#1f77b4"), ("other_s", "#9edae5")) if split else \
            (("train_s", "#1f77b4"),)
        for key, color in (("wait_s", "#bbbbbb"), *parts, ("publish_s", "#ff7f0e")):
            values = [max(0.0, r["train_s"] - r["batch_s"] - r["update_s"] if key == "other_s" else r[key])
                      for r in rows]
            ax.bar(steps, values, bottom=bottom, color=color, label=key.removesuffix("_s"))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"k = {run['k']}: median step {run['step_s']} s")
        ax.set_xlabel("trainer step")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        t0 = rows[0]["t"] - rows[0]["step_s"] if rows else 0.0
        ax.step([r["t"] - t0 for r in rows], steps, where="post", color="black", label="trainer version")
        for node, points in run["_timeline"].items():
            ax.plot([t - t0 for t, _ in points], [v for _, v in points], ".", label=f"{node} samples with")
        ax.set_xlabel("seconds since step 1 began")
        ax.set_ylabel("policy version")
        ax.set_title(f"weight latency median {run['weight_latency_s']} s")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']} on {result['machine']}: async speedup {result['async_speedup']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
