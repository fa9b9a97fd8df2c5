"""Where `sim --device cuda` puts each role on this host's GPUs (the coordinator and relay stay on the CPU).

With G GPUs: the trainer on GPU 0; the inference nodes on GPUs 1..G-1 in turn; the validator on the
last GPU (it shares with inference nodes: it recomputes in batched prefills, a fraction of their
decode time). With one GPU every role shares it. Each role is its own process and picks its GPU with
`join --device cuda:I`, exactly as on separate machines; only the placement is decided here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """The `--device` of each role (`inference` is a list: one per inference node)."""

    trainer: str
    validator: str
    inference: tuple[str, ...]

    def inference_memory_share(self, i: int) -> float:
        """The KV share of free GPU memory for inference node i: what is left to it after the other roles
        on its GPU start (the trainer's optimizer states and the validator's versions grow after it
        plans), split between the inference nodes there."""
        device = self.inference[i]
        nodes = sum(d == device for d in self.inference)
        others = (self.trainer == device) + (self.validator == device)
        return round(0.9 / nodes if not others else 0.3 / nodes, 3)

    def describe(self) -> str:
        nodes = ", ".join(f"inference-{i} {d}" for i, d in enumerate(self.inference))
        return f"trainer {self.trainer}, validator {self.validator}, {nodes}"


def place(device: str, inference_nodes: int, gpus: int | None = None) -> Placement:
    """`device` "cpu": every role on the CPU; "cuda": spread over `gpus` (None: every visible GPU)."""
    if device == "cpu":
        return Placement("cpu", "cpu", ("cpu",) * inference_nodes)
    if device != "cuda":
        raise ValueError(f"sim --device {device!r}: expected cpu or cuda (roles are placed on the GPUs by the sim)")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if gpus < 1:
        raise ValueError("sim --device cuda: no CUDA device on this machine")
    serving = list(range(1, gpus)) or [0]
    return Placement("cuda:0", f"cuda:{gpus - 1}",
                     tuple(f"cuda:{serving[i % len(serving)]}" for i in range(inference_nodes)))
