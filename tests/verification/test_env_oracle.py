"""The validator's task oracle (`node.replay.env_oracle`): a prompt tokenized once per task is the prompt the
environment's task tokenizes to each time, and a caller's copy is its own."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.envs import get_env  # noqa: E402
from node.replay import env_oracle  # noqa: E402


def test_a_tasks_prompt_tokenized_once_is_the_prompt_its_task_tokenizes_to():
    prompt_ids, _ = env_oracle(R.TOK)
    for seed in list(range(50)) + list(range(50)):  # each seed twice: the second from the cache
        want = get_env(R.ENV).sample_task(seed).prompt_ids(R.TOK)
        got = prompt_ids(R.ENV, seed)
        assert got == want and isinstance(got, list)
        got.append(-1)  # a caller's edit stays in its copy
        assert prompt_ids(R.ENV, seed) == want
