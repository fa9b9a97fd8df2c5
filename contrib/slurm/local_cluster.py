"""A throwaway Slurm cluster on this host: one `slurmctld` and N `slurmd` (one per node name, all on
127.0.0.1), for testing the job templates end to end without a real cluster.

Needs Debian's `slurmctld`, `slurmd` and `slurm-client` (22.05 here) and root (slurmd launches jobs as
their owner). Authentication is `auth/none`: acceptable only because every daemon listens on
127.0.0.1 of a test machine; never use this configuration on a shared host.

    with LocalSlurm(Path("/tmp/cluster"), nodes=2) as cluster:
        job = cluster.sbatch(script)
        cluster.wait(job, lambda state: state == "RUNNING", 60)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


class SlurmUnavailable(RuntimeError):
    """The Slurm daemons are not installed here, or cannot run (not root)."""


def available() -> str | None:
    """None when a local cluster can start here, else why not."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; Debian: apt-get install slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int | None = None, name: str = "primerl"):
        why = available()
        if why:
            raise SlurmUnavailable(why)
        self.root, self.nodes, self.name = Path(root).resolve(), [f"n{i + 1}" for i in range(nodes)], name
        self.cpus = cpus_per_node or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._procs: list[subprocess.Popen] = []

    def _write_conf(self) -> None:
        ctld, slurmd, *node_ports = _free_ports(2 + len(self.nodes))
        for sub in ("state", "log", *[f"spool-{n}" for n in self.nodes]):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        mem_mib = max(512, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2**20 // (2 * len(self.nodes)))
        lines = [
            f"ClusterName={self.name}", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld}",
            f"SlurmdPort={slurmd}", "SlurmUser=root", "AuthType=auth/none", "CredType=cred/none",
            f"StateSaveLocation={self.root}/state", f"SlurmdSpoolDir={self.root}/spool-%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid", f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root}/log/slurmctld.log", f"SlurmdLogFile={self.root}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "MailProg=/bin/true", "KillWait=10", "InactiveLimit=0",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus} RealMemory={mem_mib} State=UNKNOWN")
        lines.append(f"PartitionName=local Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 60) -> "LocalSlurm":
        self._write_conf()
        # -D: foreground, so these are our children and die with us; -i: ignore stale state.
        self._procs.append(subprocess.Popen([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=self.env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        for node in self.nodes:
            self._procs.append(subprocess.Popen([_bin("slurmd"), "-D", "-N", node, "-f", str(self.conf)], env=self.env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                start_new_session=True))
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self._run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s.rstrip("*") == "idle" for s in states.values()):
                return self
            if any(p.poll() is not None for p in self._procs):
                raise SlurmUnavailable(f"a Slurm daemon exited; see {self.root / 'log'}")
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after {timeout:.0f}s: {out!r}; see {self.root / 'log'}")

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([_bin(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True,
                              check=check, timeout=30)

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit; returns the job id."""
        out = subprocess.run([_bin("sbatch"), "--parsable", *args, str(script)], env={**self.env, **(env or {})},
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return int(out.strip().split(";")[0])

    def state(self, job: int) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED... ('GONE' once Slurm forgot it)."""
        out = self._run("scontrol", "show", "job", str(job), "-o", check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def wait(self, job: int, until, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.state(job)
            if until(state):
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout:.0f}s")

    def cancel(self, job: int, kill: bool = False) -> None:
        """scancel: SIGTERM to every step's tasks, SIGKILL after KillWait (10 s); `kill`: SIGKILL now."""
        self._run("scancel", *(["--signal=KILL", "--full"] if kill else []), str(job), check=False)

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._procs.clear()

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
