"""What a world of ranks shares, whoever leads it: joining and leaving it (`world`), the order channel
rank 0 leads the others by (`control`), and expert parallelism's all-to-alls (`experts`). The trainer
(node/rl/parallel) and the expert-parallel inference engine (node/engine/ep_world.py) both build on
these and import nothing from each other."""
