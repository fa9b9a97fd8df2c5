"""`python -m benchmarks.shardcast`: ours vs shardcast 0.3.2 on one 1 GiB bf16 payload, 127.0.0.1.

Measures, for each system in the same run: seconds from `go` until 1 client (alone), and until
all of N clients (started together), hold the verified file; throughput and ratios. Our clients
run in peer mode (each serves what it verified to the others); the peer's clients fetch from its
origin, the way its ClientNode works. Client processes are fully set up (imports, probes) before
`go`, so interpreter start-up is not timed for either. The peer runs from /tmp/peer-venv
(`python -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install shardcast==0.3.2`); without it
the peer is skipped and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PEER_PY = Path(os.environ.get("SHARDCAST_PEER_PYTHON", "/tmp/peer-venv/bin/python"))


def log(msg: str) -> None:
    print(f"[shardcast-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def realistic_bf16_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Qwen3-shaped dense state dict of ~total_bytes of bf16: N(0, 0.02) matrices with a
    log-normal scale per output row (trained weights are heavy-tailed per channel), norms near 1.
    Below 256 MiB the vocabulary shrinks so that embedding + head alone make up `total_bytes`."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, kv = 2048, 6144, 512
    vocab = min(32768, max(1024, total_bytes // (2 * hidden * 2) // 1024 * 1024))

    def mat(rows: int, cols: int) -> torch.Tensor:
        scale = torch.exp(0.3 * torch.randn(rows, 1, generator=g)) * 0.02
        return (torch.randn(rows, cols, generator=g) * scale).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": mat(vocab, hidden)}
    layer = 0
    while sum(t.numel() * 2 for t in state.values()) + vocab * hidden * 2 < total_bytes:
        p = f"model.layers.{layer}."
        for name, shape in [("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (kv, hidden)),
                            ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)), ("mlp.down_proj", (hidden, inter))]:
            state[p + name + ".weight"] = mat(*shape)
        for n in ("input_layernorm", "post_attention_layernorm"):
            state[p + n + ".weight"] = (1 + 0.05 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
        layer += 1
    state["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    state["lm_head.weight"] = mat(vocab, hidden)
    return state


class Actor:
    """One benchmark process speaking the ready/go/done protocol of benchmarks.shardcast_actors."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        """stdout, line by line, read by a thread (a blocking readline cannot time out); None at EOF."""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, word: str, timeout: float = 600) -> list[str]:
        deadline = time.time() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError(f"{self.proc.args}: no {word!r} within {timeout:.0f}s") from None
            if line is None:
                raise RuntimeError(f"{self.proc.args} exited before {word!r}")
            parts = line.split()
            if parts and parts[0] == word:
                return parts[1:]
            if parts and parts[0] == "failed":
                raise RuntimeError(f"{self.proc.args}: {line.strip()}")

    def close(self, kill: bool = False) -> list[str]:
        """Close stdin (the actor's signal to exit; `kill`: do not wait for it); its remaining output lines."""
        if self.proc.stdin.closed:  # type: ignore[union-attr]
            return []
        self.proc.stdin.close()  # type: ignore[union-attr]
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        rest = []
        while True:
            try:
                line = self.lines.get(timeout=5)
            except queue.Empty:
                break
            if line is None:
                break
            rest.append(line.rstrip("\n"))
        return rest

    def cpu_s(self) -> float:
        """CPU seconds this process and its waited-for children (the peer's wget) have used."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]


def _ours_env(repo: Path = REPO) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")


def _wait_done(clients: list[Actor], t0: float, timeout: float) -> tuple[list[list[str]], str | None]:
    """Every client's `done` line, or why not: a client failed or `timeout` s passed since `t0`."""
    done = []
    try:
        for c in clients:
            done.append(c.expect("done", timeout=max(1.0, t0 + timeout - time.perf_counter())))
    except (RuntimeError, TimeoutError) as exc:
        return done, f"{type(exc).__name__}: {exc}"[:300]
    return done, None


def run_ours(work: Path, store: Path, trust: str, n_clients: int, uplink_mibps: float = 0, seed_copies: int = 0,
             repo: Path = REPO, timeout: float = 600) -> dict:
    """Our origin and clients; `repo` is the checkout whose code they run (another commit: a baseline)."""
    env = _ours_env(repo)
    py = [sys.executable, "-m", "benchmarks.shardcast_actors"]
    origin = Actor(py + ["ours-origin", str(store), str(uplink_mibps), str(seed_copies)], repo, env)
    clients: list[Actor] = []
    try:
        origin_url = f"http://127.0.0.1:{origin.expect('ready')[0]}"
        ports = []
        for i in range(n_clients):
            clients.append(Actor(py + ["ours-client", str(work / f"ours-client{i}"), "bench", "0", trust], repo, env))
            ports.append(clients[-1].expect("ready")[0])
        cpu0 = sum(a.cpu_s() for a in [origin, *clients])
        t0 = time.perf_counter()
        for i, c in enumerate(clients):
            peers = [f"http://127.0.0.1:{p}" for j, p in enumerate(ports) if j != i]
            c.send("go " + " ".join([origin_url] + peers))
        done, failed = _wait_done(clients, t0, timeout)
        wall = time.perf_counter() - t0
        cpu = sum(a.cpu_s() for a in [origin, *clients]) - cpu0
        if failed:
            for c in clients:
                c.close(kill=True)
            return {"wall_s": wall, "cpu_s": cpu, "failed": failed, "peer_served_bytes": 0}
        served = []
        for c in clients:
            tail = [ln for ln in c.close() if ln.startswith("served")]
            served.append(int(tail[-1].split()[1]) if tail else 0)
        return {"wall_s": wall, "cpu_s": cpu, "client_s": [float(d[0]) for d in done], "peer_served_bytes": sum(served)}
    finally:
        for c in clients:
            c.close()
        origin.close()
        for i in range(n_clients):
            shutil.rmtree(work / f"ours-client{i}", ignore_errors=True)


def run_peer(work: Path, payload_file: Path, n_clients: int, uplink_mibps: float = 0, timeout: float = 600) -> dict:
    from benchmarks.shardcast_actors import PEER_CLIENT, PEER_ORIGIN

    (work / "peer_origin.py").write_text(PEER_ORIGIN)
    (work / "peer_client.py").write_text(PEER_CLIENT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["SHARDCAST_LOG_LEVEL"] = "WARNING"
    port = 18000 + os.getpid() % 1000
    origin = Actor([str(PEER_PY), "peer_origin.py", str(work / "peer-data"), str(port), str(payload_file), str(uplink_mibps)], work, env)
    clients: list[Actor] = []
    try:
        version = origin.expect("ready")[0]
        for i in range(n_clients):  # sequential: each client's probe writes /tmp/dummy.bin
            clients.append(Actor([str(PEER_PY), "peer_client.py", f"http://127.0.0.1:{port}", str(work / f"peer-client{i}"), version], work, env))
            clients[-1].expect("ready")
        cpu0 = sum(a.cpu_s() for a in [origin, *clients])
        t0 = time.perf_counter()
        for c in clients:
            c.send("go")
        done, failed = _wait_done(clients, t0, timeout)
        wall = time.perf_counter() - t0
        # The peer's clients wait for their wget children, so those count here too.
        cpu = sum(a.cpu_s() for a in [origin, *clients]) - cpu0
        if failed:
            for c in clients:
                c.close(kill=True)
            return {"wall_s": wall, "cpu_s": cpu, "failed": failed, "attempts": [int(d[1]) for d in done]}
        return {"wall_s": wall, "cpu_s": cpu, "client_s": [float(d[0]) for d in done], "attempts": [int(d[1]) for d in done]}
    finally:
        for c in clients:
            c.close()
        origin.close()
        shutil.rmtree(work / "peer-data", ignore_errors=True)
        for i in range(n_clients):
            shutil.rmtree(work / f"peer-client{i}", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="payload size in GiB")
    ap.add_argument("--clients", type=int, default=8, help="clients in the many-client run")
    ap.add_argument("--uplink-mibps", type=float, default=100, help="also run both with the origin paced to this uplink (0: skip)")
    ap.add_argument("--shard-mib", type=int, default=64, help="our shard size in MiB (the peer keeps its 50 MB default)")
    ap.add_argument("--skip-peer", action="store_true", help="measure ours only")
    ap.add_argument("--ns", default=None, help="client counts to run (default: 1 and --clients), e.g. 1,4,8,16")
    ap.add_argument("--super-seed", type=int, default=0, help="our origin hands each shard out this many times, then peers spread it (0: off)")
    ap.add_argument("--workdir", default=None, help="where stores and downloads go (default: a temp dir; tmpfs takes the disk out)")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions of each scenario, ours and the peer interleaved; medians reported")
    ap.add_argument("--baseline-repo", default=None, help="also run our actors from this checkout (e.g. a git worktree of an "
                    "earlier commit) as system 'base', interleaved with the others")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds a scenario may take before it counts as "
                    "failed (recorded, time counted as this lower bound)")
    ap.add_argument("--machine", default="cpu-2core", help="machine label for the results file")
    ap.add_argument("--out", default=None, help="results JSON path (default benchmarks/results/shardcast-<machine>.json)")
    args = ap.parse_args()

    from protocol.identity import NodeKey
    from shardcast.publish import PublishOptions, publish
    from shardcast.store import Store

    work = Path(tempfile.mkdtemp(prefix="shardcast-bench-", dir=args.workdir))
    try:
        log(f"building {args.gib} GiB of bf16 weights")
        state = realistic_bf16_state(int(args.gib * 2**30))
        raw = sum(t.numel() * t.element_size() for t in state.values())
        key = NodeKey.generate()
        store = Store(work / "origin")
        t0 = time.perf_counter()
        signed = publish(store, key, "bench", 0, state, options=PublishOptions(shard_size=args.shard_mib << 20))
        publish_s = time.perf_counter() - t0
        m = signed.manifest
        log(f"ours: published {raw / 2**20:.0f} MiB as {len(m.shards)} shards, {m.wire_bytes / raw:.3f} wire/raw, {publish_s:.1f}s")
        peer_ok = not args.skip_peer and PEER_PY.exists() and subprocess.run([str(PEER_PY), "-c", "import shardcast"], cwd=work).returncode == 0
        result: dict = {"benchmark": "shardcast", "machine": args.machine, "workdir": str(work.parent), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "payload_bytes": raw, "shard_bytes": m.shard_size, "shards": len(m.shards), "wire_bytes": m.wire_bytes,
                        "compression": round(m.wire_bytes / raw, 4), "hash": m.hash_name, "publish_s": round(publish_s, 2),
                        "clients": args.clients, "super_seed_copies": args.super_seed}
        payload_file = work / "payload.bin"
        if peer_ok:
            from safetensors.torch import save_file

            save_file(state, str(payload_file))
        del state

        mib, n = raw / 2**20, args.clients
        ks = sorted({int(x) for x in args.ns.split(",")}) if args.ns else [1, n]
        n = ks[-1]
        systems = ["ours"] + (["base"] if args.baseline_repo else []) + (["peer"] if peer_ok else [])
        if not peer_ok:
            result["peer"] = f"skipped: no shardcast 0.3.2 at {PEER_PY}"
        for uplink in ([0.0, args.uplink_mibps] if args.uplink_mibps else [0.0]):
            tag = "" if not uplink else "uplink_"
            where = "loopback" if not uplink else f"origin uplink {uplink:g} MiB/s"
            for k in ks:
                runs: dict[str, list[dict]] = {s: [] for s in systems}
                for rep in range(args.repeat):
                    # Interleaved, order alternating, so a change in the machine's load hits both.
                    for system in (systems if rep % 2 == 0 else systems[::-1]):
                        t_sync = time.perf_counter()
                        os.sync()  # the previous scenario's dirty pages must not slow this one's writes
                        load0 = os.getloadavg()[0]
                        log(f"{system}: {k} client(s), {where}, repetition {rep + 1}/{args.repeat} "
                            f"(waited {time.perf_counter() - t_sync:.1f}s for writeback; load {load0:.2f})")
                        if system in ("ours", "base"):
                            repo = REPO if system == "ours" else Path(args.baseline_repo).resolve()
                            r = run_ours(work, store.root, key.peer_id, k, uplink, args.super_seed, repo, args.run_timeout)
                        else:
                            r = run_peer(work, payload_file, k, uplink, args.run_timeout)
                        r["load_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
                        runs[system].append(r)
                        if "failed" in r:
                            log(f"{system}: {k} client(s) did NOT all finish: {r['failed']} after {r['wall_s']:.2f}s "
                                f"(counted as that time, a lower bound)")
                        else:
                            log(f"{system}: {k} client(s) hold the verified file after {r['wall_s']:.2f}s, "
                                f"{r['cpu_s']:.2f} CPU-s in all its processes ({where})")
                for system, rs in runs.items():
                    result[f"{system}_{tag}{k}_s"] = round(statistics.median(r["wall_s"] for r in rs), 3)
                    result[f"{system}_{tag}{k}_cpu_s"] = round(statistics.median(r["cpu_s"] for r in rs), 3)
                    if args.repeat > 1:
                        result[f"{system}_{tag}{k}_s_all"] = [round(r["wall_s"], 3) for r in rs]
                        result[f"{system}_{tag}{k}_cpu_s_all"] = [round(r["cpu_s"], 3) for r in rs]
                    result[f"{system}_{tag}{k}_load_1min"] = [r["load_1min"] for r in rs]
                    if any("failed" in r for r in rs):
                        result[f"{system}_{tag}{k}_failed"] = [r.get("failed") for r in rs]
                    if system != "peer":
                        result[f"{system}_{tag}{k}_peer_served_bytes"] = rs[-1]["peer_served_bytes"]
                    else:
                        result[f"peer_{tag}{k}_download_attempts"] = [r["attempts"] for r in rs]
                if "peer" in runs:
                    ours, peer = runs["ours"], runs["peer"]
                    # Per repetition (the two ran back to back), then the median of those ratios.
                    result[f"ratio_{tag}{k}_time_peer_over_ours_per_rep"] = [round(p["wall_s"] / o["wall_s"], 3) for o, p in zip(ours, peer)]
                    result[f"ratio_{tag}{k}_time_peer_over_ours_median"] = round(statistics.median(result[f"ratio_{tag}{k}_time_peer_over_ours_per_rep"]), 3)
                    result[f"ratio_{tag}{k}_cpu_peer_over_ours"] = round(result[f"peer_{tag}{k}_cpu_s"] / result[f"ours_{tag}{k}_cpu_s"], 3)
                    if "base" in runs:
                        result[f"ratio_{tag}{k}_time_peer_over_base_median"] = round(statistics.median(
                            p["wall_s"] / b["wall_s"] for b, p in zip(runs["base"], peer)), 3)
            for system in systems:
                if f"{system}_{tag}1_s" not in result:
                    continue
                result[f"{system}_{tag}1_mibps"] = round(mib / result[f"{system}_{tag}1_s"], 1)
                result[f"{system}_{tag}{n}_over_1"] = round(result[f"{system}_{tag}{n}_s"] / result[f"{system}_{tag}1_s"], 3)
            if peer_ok and 1 in ks:
                result[f"ratio_{tag}1_client_throughput_ours_over_peer"] = round(result[f"ours_{tag}1_mibps"] / result[f"peer_{tag}1_mibps"], 3)
                result[f"ratio_{tag}{n}_clients_time_peer_over_ours"] = round(result[f"peer_{tag}{n}_s"] / result[f"ours_{tag}{n}_s"], 3)
        result["uplink_mibps"] = args.uplink_mibps
        result["repeat"] = args.repeat
        result["command"] = "python -m benchmarks.shardcast " + " ".join(sys.argv[1:])
        out = Path(args.out or REPO / "benchmarks" / "results" / f"shardcast-{args.machine}.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out}")
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
