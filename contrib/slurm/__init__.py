"""Slurm templates: a trainer job (torchrun across nodes, FSDP2 + EP + CP) and an inference-fleet job
(one vLLM node per Slurm node), each node running `primerl-node join`. See contrib/slurm/render.py."""
