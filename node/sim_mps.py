"""NVIDIA's multi-process service (MPS) for the roles `sim --device cuda --mps` puts on GPUs.

Without it, processes on one GPU take turns: the driver gives each its own time slices, and a slice in which a role
launches only small kernels (the inference node's decode step of a 0.5B model) leaves most of the GPU idle while the
validator's and the trainer's work waits for its turn. Through MPS the roles' kernels share the GPU at once. One
control daemon serves the sim's roles (its pipe directory in each member's environment); it starts before any role
and is told to quit after the last one stopped.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    """The multi-process service could not be started here (no control program, or it failed)."""


class Mps:
    """One MPS control daemon of this sim's own (its pipe and log directories under a short /tmp path: the pipe's
    socket path must stay under the kernel's 108 bytes), so a daemon the host already runs is left alone."""

    def __init__(self, root: Path, control: str):
        self.root, self.control = root, control
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
        """What each role's process needs in its environment to reach this daemon."""

    @classmethod
    def start(cls) -> "Mps":
        control = shutil.which(CONTROL)
        if control is None:
            raise MpsUnavailable(f"sim --mps: {CONTROL} is not on PATH (NVIDIA's driver utilities are not installed)")
        mps = cls(Path(tempfile.mkdtemp(prefix="primerl-mps-")), control)
        for d in ("pipe", "log"):
            (mps.root / d).mkdir()
        try:
            subprocess.run([control, "-d"], env={**os.environ, **mps.env}, check=True, timeout=30,
                           capture_output=True, text=True)
        except (OSError, subprocess.SubprocessError) as exc:
            shutil.rmtree(mps.root, ignore_errors=True)
            detail = getattr(exc, "stderr", None) or exc
            raise MpsUnavailable(f"sim --mps: {CONTROL} -d failed: {str(detail).strip()[:300]}") from exc
        log.info("MPS control daemon started (%s)", mps.env["CUDA_MPS_PIPE_DIRECTORY"])
        return mps

    def stop(self, log_to: Path | None = None) -> None:
        """Tell the daemon to quit (its server ends once no client is left), copy its log to `log_to` and remove
        its directories."""
        try:
            subprocess.run([self.control], input="quit\n", env={**os.environ, **self.env}, timeout=30,
                           capture_output=True, text=True)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("MPS control daemon not told to quit: %s", exc)
        if log_to is not None:
            shutil.copytree(self.root / "log", log_to, dirs_exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
