"""Render the Slurm batch scripts for a cluster layout.

Invariants the rendered scripts keep: the trainer's world is exactly trainer_nodes x procs per node
(GPUs, or CPU ranks on a CPU test cluster) and its dp x cp (ep borrowed from dp) covers it; every
vLLM inference node serves one instance whose data x tensor parallel degree covers that node's GPUs;
every node joins the same run through the same bootstrap peer, with its own key and state directory.
`python -m contrib.slurm.render --layout 28xh200 --out DIR` (flags below override layout fields).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from string import Template
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from shardcast import DEFAULT_PORT

HERE = Path(__file__).parent


class ClusterLayout(BaseModel):
    name: str
    """Job-name prefix."""
    partition: str = "h200"
    """Slurm partition."""
    gpus_per_node: int = Field(8, ge=0)
    """GPUs on each node (0: CPU nodes, e.g. a test cluster; then `procs_per_node` trainer ranks each)."""
    cpu_procs_per_node: int = Field(1, ge=1)
    """Trainer ranks per node when gpus_per_node is 0 (gloo)."""
    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the trainer job (one torchrun agent each)."""
    inference_nodes: int = Field(1, ge=1)
    """Nodes of the inference fleet (one `join --role inference` each)."""
    dp: int = Field(1, ge=1)
    """Trainer data-parallel (FSDP) degree."""
    ep: int = Field(1, ge=1)
    """Trainer expert-parallel degree (taken from dp)."""
    cp: int = Field(1, ge=1)
    """Trainer context-parallel degree."""
    engine: Literal["vllm", "builtin"] = "vllm"
    """Inference engine on the fleet: vLLM on GPU nodes, the built-in one on CPU test clusters."""
    vllm_dp: int = Field(8, ge=1)
    """vLLM data-parallel replicas per inference node."""
    vllm_tp: int = Field(1, ge=1)
    """vLLM tensor-parallel degree per replica."""
    vllm_ep: bool = True
    """vLLM expert parallelism across the node's GPUs."""
    all2all_backend: str = "deepep_low_latency"
    """vLLM all-to-all for expert parallelism."""
    spec: str = "/shared/run/spec.json"
    """The run's signed spec (`primerl-node coordinator launch` writes STATE/spec.json), on a shared path."""
    bootstrap: str = "/ip4/10.0.0.1/tcp/4001/p2p/COORDINATOR_PEER_ID"
    """Multiaddr of the coordinator (bootstrap peer)."""
    state_dir: str = "/scratch/primerl"
    """Per-node state (shards, checkpoints, metrics): node-local disk is best."""
    key_dir: str = "/shared/run/keys"
    """Node keys (created on first start, 0600); inference nodes' are named by index in the job."""
    log_dir: str = "."
    """Where Slurm writes each job's output."""
    shardcast_port: int = Field(DEFAULT_PORT, ge=1, le=65535)
    """Trainer's shard server port (must be in the run spec's shardcast_sources)."""
    bind_host: str = "0.0.0.0"
    """Address the trainer's shard server and libp2p host listen on (inference nodes must reach it)."""
    rdzv_port: int = Field(29500, ge=1, le=65535)
    """torchrun's c10d rendezvous port on the trainer job's first node."""
    time_limit: str = "7-00:00:00"
    """Slurm wall-time limit."""

    @property
    def procs_per_node(self) -> int:
        return self.gpus_per_node or self.cpu_procs_per_node

    @model_validator(mode="after")
    def _check(self) -> "ClusterLayout":
        world = self.trainer_nodes * self.procs_per_node
        if self.dp * self.cp != world:
            raise ValueError(f"trainer dp*cp = {self.dp * self.cp} must equal its {world} ranks")
        if self.dp % self.ep:
            raise ValueError("ep must divide dp")
        if self.engine == "vllm" and self.gpus_per_node and self.vllm_dp * self.vllm_tp != self.gpus_per_node:
            raise ValueError("vllm_dp * vllm_tp must equal gpus_per_node")
        return self

    def engine_flags(self) -> list[str]:
        """`join --vllm KEY=VALUE` settings (contrib/vllm/settings.py VLLMSettings) for a vLLM fleet."""
        if self.engine != "vllm":
            return []
        # no dtype or quantization: the run's spec sets them (contrib/vllm/node_engine.SPEC_OWNED)
        opts = {"data_parallel": self.vllm_dp, "tensor_parallel": self.vllm_tp, "expert_parallel": str(self.vllm_ep).lower()}
        if self.vllm_ep:
            opts["all2all_backend"] = self.all2all_backend
        return [f"--vllm {k}={v}" for k, v in opts.items()]


GLM5_LIKE_28_NODES = ClusterLayout(
    name="glm5-like", trainer_nodes=16, inference_nodes=12, dp=64, ep=16, cp=2, vllm_dp=8, vllm_tp=1)
"""28 H200 nodes (224 GPUs), shaped like the published GLM-5 RL run's size; the 16/12 split
between training and inference is our choice, not a published figure."""

TWO_NODES = ClusterLayout(name="two-node", trainer_nodes=1, inference_nodes=1, dp=8, ep=8, cp=1,
                          vllm_dp=8, vllm_tp=1)
"""The smallest real split: one trainer node, one inference node."""


def render(layout: ClusterLayout, out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    values = {k: shlex.quote(str(v)) if isinstance(v, str) else v for k, v in layout.model_dump().items()}
    values["procs_per_node"] = layout.procs_per_node
    values["gpus_line"] = (f"#SBATCH --gpus-per-node={layout.gpus_per_node}" if layout.gpus_per_node
                           else "# CPU nodes: no GPUs requested")
    values["engine_flags"] = " ".join(layout.engine_flags())
    written = []
    for name in ("trainer.sbatch", "inference.sbatch"):
        text = Template((HERE / f"{name}.tmpl").read_text()).substitute(values)
        path = out_dir / f"{layout.name}-{name}"
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render Slurm scripts for a layout.")
    parser.add_argument("--layout", choices=["28xh200", "2node"], default="2node")
    parser.add_argument("--out", default="slurm-jobs")
    args = parser.parse_args(argv)
    layout = GLM5_LIKE_28_NODES if args.layout == "28xh200" else TWO_NODES
    for path in render(layout, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
