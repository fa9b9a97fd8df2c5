"""The inference node's groups in flight, one per lease: a stale lease cancelled and re-granted to the
same node while its first copy still runs in the engine (seen in a sim: the node died on a KeyError when
the two copies shared episode ids) plays as two groups, each whole, each with its own grant."""

import pytest
import torch

from node.engine import Engine, SamplingParams
from node.envs import get_env
from node.envs.rollout import Episodes
from node.model import CausalLM, CharTokenizer, ModelConfig
from node.roles.leased_groups import LeasedGroups
from protocol.messages import LeaseGrant


def engine(tok: CharTokenizer) -> Engine:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      model_type="qwen3", max_position_embeddings=256)
    return Engine(CausalLM(cfg), max_batch=8, eos_id=-1, decode=tok.decode)


def test_a_regrant_of_a_work_id_still_in_flight_is_its_own_group():
    tok, env = CharTokenizer(), get_env("reverse")
    eng = engine(tok)
    groups = LeasedGroups(Episodes(eng, env, tok), group_size=3, temperature=1.0)
    old = LeaseGrant(work_id=41, holder="12D3KooWA", policy_version=4, task_index=2, seed=7, deadline=1e12)
    groups.admit(old, env.sample_task(old.task_index))
    groups.episodes.step()  # the first copy is mid-flight when the re-grant arrives
    regrant = old.model_copy(update={"policy_version": 6})
    groups.admit(regrant, env.sample_task(regrant.task_index))
    whole = []
    for _ in range(10_000):
        if not eng.has_work():
            break
        whole += groups.finished(groups.episodes.step())
    assert [g.policy_version for g, _ in whole] == [4, 6] and len(groups) == 0  # both whole, the first first
    for _, members in whole:
        assert len(members) == 3 and all(r.reward is not None for r in members)
    # the same seeds and task: the re-grant's rollouts are those of the first copy, token for token
    assert [r.completion_ids for r in whole[0][1]] == [r.completion_ids for r in whole[1][1]]


def test_an_episode_id_already_in_flight_is_refused():
    tok, env = CharTokenizer(), get_env("reverse")
    episodes = Episodes(engine(tok), env, tok)
    episodes.add("e", env.sample_task(0), SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="already in flight"):
        episodes.add("e", env.sample_task(0), SamplingParams(temperature=0.0))
    assert len(episodes) == 1
