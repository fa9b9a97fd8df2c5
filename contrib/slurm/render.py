"""Render the Slurm batch scripts for a cluster layout.

Invariants the rendered scripts keep: the trainer's world is exactly trainer_nodes x gpus_per_node
processes and its dp x cp (ep borrowed from dp) covers it; every inference node serves one vLLM
instance whose data x tensor parallel degree covers that node's GPUs; every node joins the same run
through the same bootstrap peer. `python -m contrib.slurm.render --layout 28xh200 --out DIR`.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from string import Template

from pydantic import BaseModel, Field, model_validator

HERE = Path(__file__).parent


class ClusterLayout(BaseModel):
    name: str
    """Job-name prefix."""
    partition: str = "h200"
    """Slurm partition."""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs on each node."""
    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the trainer job (one torchrun agent each)."""
    inference_nodes: int = Field(1, ge=1)
    """Nodes of the inference fleet (one vLLM server each)."""
    dp: int = Field(1, ge=1)
    """Trainer data-parallel (FSDP) degree."""
    ep: int = Field(1, ge=1)
    """Trainer expert-parallel degree (taken from dp)."""
    cp: int = Field(1, ge=1)
    """Trainer context-parallel degree."""
    vllm_dp: int = Field(8, ge=1)
    """vLLM data-parallel replicas per inference node."""
    vllm_tp: int = Field(1, ge=1)
    """vLLM tensor-parallel degree per replica."""
    vllm_ep: bool = True
    """vLLM expert parallelism across the node's GPUs."""
    quantization: str = "fp8"
    """vLLM weight quantisation on inference nodes."""
    all2all_backend: str = "deepep_low_latency"
    """vLLM all-to-all for expert parallelism."""
    model: str = "/models/base"
    """Shared path of the base checkpoint."""
    run_spec: str = "/runs/run.json"
    """Signed run spec from `primerl-node coordinator launch`."""
    bootstrap: str = "/ip4/10.0.0.1/tcp/4001/p2p/COORDINATOR_PEER_ID"
    """Multiaddr of the coordinator (bootstrap peer)."""
    time_limit: str = "7-00:00:00"
    """Slurm wall-time limit."""

    @model_validator(mode="after")
    def _check(self) -> "ClusterLayout":
        world = self.trainer_nodes * self.gpus_per_node
        if self.dp * self.cp != world:
            raise ValueError(f"trainer dp*cp = {self.dp * self.cp} must equal its {world} GPUs")
        if self.dp % self.ep:
            raise ValueError("ep must divide dp")
        if self.vllm_dp * self.vllm_tp != self.gpus_per_node:
            raise ValueError("vllm_dp * vllm_tp must equal gpus_per_node")
        return self


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
    values["vllm_ep_flag"] = "--vllm-expert-parallel" if layout.vllm_ep else ""
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
