"""The Slurm templates render for a 28-node H200 layout and a 2-node one, as valid bash whose
process counts agree with the layout; layouts that cannot cover their GPUs are refused."""

from __future__ import annotations

import re
import subprocess

import pytest

from contrib.slurm.render import GLM5_LIKE_28_NODES, TWO_NODES, ClusterLayout, render


@pytest.mark.parametrize("layout", [GLM5_LIKE_28_NODES, TWO_NODES], ids=["28xh200", "2node"])
def test_templates_render_to_valid_bash_matching_the_layout(tmp_path, layout):
    trainer, inference = render(layout, tmp_path)
    for path in (trainer, inference):
        text = path.read_text()
        assert "$" + "{" not in text  # every placeholder filled
        subprocess.run(["bash", "-n", str(path)], check=True)
    t = trainer.read_text()
    assert f"#SBATCH --nodes={layout.trainer_nodes}" in t
    nnodes = int(re.search(r"--nnodes=(\d+)", t).group(1))
    nproc = int(re.search(r"--nproc-per-node=(\d+)", t).group(1))
    dp, cp = int(re.search(r"--dp (\d+)", t).group(1)), int(re.search(r"--cp (\d+)", t).group(1))
    assert nnodes * nproc == dp * cp  # the torchrun world is exactly the parallel layout
    i = inference.read_text()
    assert f"#SBATCH --nodes={layout.inference_nodes}" in i and "join --role inference --engine vllm" in i
    assert layout.trainer_nodes + layout.inference_nodes == (28 if layout is GLM5_LIKE_28_NODES else 2)


def test_layouts_that_do_not_cover_their_gpus_are_refused():
    with pytest.raises(ValueError, match="dp\\*cp"):
        ClusterLayout(name="bad", trainer_nodes=2, dp=8, cp=1)
    with pytest.raises(ValueError, match="vllm_dp"):
        ClusterLayout(name="bad", trainer_nodes=1, dp=8, vllm_dp=4, vllm_tp=1)
