"""A sim's config becomes the run.toml its coordinator launches with: every key the sim sets, none lost."""

from __future__ import annotations

from node.run_config import RunConfig
from node.sim_config import SimConfig
from node.sim_network import write_run_toml
from protocol.identity import NodeKey


def _keys() -> dict[str, NodeKey]:
    return {name: NodeKey.from_seed(name.encode().ljust(32, b".")) for name in ("trainer", "validator")}


def test_the_sims_run_toml_loads_as_the_run_the_sim_describes(tmp_path):
    cfg = SimConfig(task="addition", seed=3, batch_groups=4, group_size=2, max_off_policy_steps=0, steps=7,
                    fp8="experts", vllm_nodes=1, recipe={"lr": 2e-3}, run={"dead_after_missed": 9})
    keys = _keys()
    write_run_toml(tmp_path, cfg, keys, origin=18470, relay_port=18471)
    run = RunConfig.load(tmp_path / "run.toml")
    assert (run.task, run.batch_groups, run.group_size, run.max_off_policy_steps) == ("addition", 4, 2, 0)
    assert (run.recipe.steps, run.recipe.seed, run.recipe.lr) == (7, 3, 2e-3)
    assert run.model.fp8 == "experts" and run.engines == ["builtin", "vllm"] and run.dead_after_missed == 9
    assert run.shardcast_sources == ["http://127.0.0.1:18470", "http://127.0.0.1:18471"]
    assert run.trainer == keys["trainer"].peer_id and run.validators == [keys["validator"].peer_id]
    assert run.run_id == "sim-addition-3"


def test_a_default_sim_runs_the_default_run(tmp_path):
    write_run_toml(tmp_path, SimConfig(), _keys(), origin=1, relay_port=2)
    run, default = RunConfig.load(tmp_path / "run.toml"), RunConfig.model_fields
    assert (run.task, run.batch_groups, run.group_size) == \
        (default["task"].default, default["batch_groups"].default, default["group_size"].default)
    assert run.model.fp8 == "off" and run.engines == ["builtin"]


def test_the_audit_counts_a_listed_but_unhealthy_member_as_not_alive_and_excuses_only_a_late_restart(tmp_path):
    """The end-of-run audit (`membership_at_end`): a member the coordinator's view lists but calls "unhealthy" is
    not alive; after a restart too close to the end the same member is reported as not rejoined instead; a member
    killed just before the end is excused; judged by the last time a view counted each alive, members that left
    as the run ended are alive at its end; a member alive in the view is never named."""
    from node.sim import all_alive, membership_at_end
    from node.sim_procs import Proc

    keys = {**_keys(), "relay": NodeKey.from_seed(b"relay".ljust(32, b"."))}
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "log.txt").write_text("")
    procs = {n: Proc(n, ["x"], tmp_path / f"{n}.log") for n in keys}
    view = {keys["trainer"].peer_id: "alive", keys["validator"].peer_id: "unhealthy", keys["relay"].peer_id: "alive"}
    members = {k.peer_id for k in keys.values()}
    assert not all_alive(members, view) and members.issubset(view)
    assert all_alive(members, {p: "alive" for p in members})
    judged = membership_at_end(tmp_path, keys, [], (100.0, view), procs)
    assert judged["honest_not_alive_at_end"] == ["validator"]
    late = membership_at_end(tmp_path, keys, [], (100.0, view), procs, restarted_before_end=True)
    assert late["honest_not_alive_at_end"] == [] and late["honest_not_rejoined_before_end"] == ["validator"]
    # a member SIGKILLed 8 s before the run ended, the last view 15 s after the end: restarting, excused; one
    # SIGKILLed 30 s before the end had time to join again: named
    procs["validator"].events = [(72.0, "kill"), (73.0, "start")]
    assert membership_at_end(tmp_path, keys, [], (95.0, view), procs, ended_at=80.0)["honest_not_alive_at_end"] == []
    procs["validator"].events = [(50.0, "kill"), (51.0, "start")]
    assert membership_at_end(tmp_path, keys, [], (95.0, view), procs,
                             ended_at=80.0)["honest_not_alive_at_end"] == ["validator"]
    # what the sim judges by: the last time a view counted each alive. Members leave when the run ends, so a view
    # read after it lacks them all: those counted alive shortly before the end were alive at it
    procs["validator"].events = []
    seen = {keys["trainer"].peer_id: 77.0, keys["relay"].peer_id: 85.0, keys["validator"].peer_id: 40.0}
    assert membership_at_end(tmp_path, keys, [], (95.0, {}), procs, ended_at=80.0,
                             alive_seen=seen)["honest_not_alive_at_end"] == ["validator"]
