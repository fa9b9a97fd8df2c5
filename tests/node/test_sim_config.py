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


def test_the_audit_names_a_member_not_seen_alive_near_the_end_and_excuses_only_a_late_restart_or_kill(tmp_path,
                                                                                                      monkeypatch):
    """The end-of-run audit (`membership_at_end`), by the last time a membership view counted each member alive:
    members leave when the run ends, so those counted alive in its last `RECENT_S` (or after) were alive at its end,
    and one last counted alive long before is named (a member a restarted coordinator lists as "unhealthy" is not
    counted alive: `look`); after a restart too close to the end it is reported as not rejoined instead; a member
    SIGKILLed just before the end is excused, one killed long before had time to join again."""
    import node.sim as sim
    from node.sim import RECENT_S, all_alive, look, membership_at_end
    from node.sim_procs import Proc

    keys = {**_keys(), "relay": NodeKey.from_seed(b"relay".ljust(32, b"."))}
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "log.txt").write_text("")
    procs = {n: Proc(n, ["x"], tmp_path / f"{n}.log") for n in keys}
    view = {keys["trainer"].peer_id: "alive", keys["validator"].peer_id: "unhealthy", keys["relay"].peer_id: "alive"}
    members = {k.peer_id for k in keys.values()}
    assert not all_alive(members, view) and members.issubset(view)
    assert all_alive(members, {p: "alive" for p in members})

    class Net:  # what `look` reads and writes of a sim's Network
        run_toml = {"status_port": 0}
        view_at, alive_seen = (0.0, {}), {}

    net = Net()
    monkeypatch.setattr(sim, "_membership_view", lambda port: view)
    look(net)
    assert set(net.alive_seen) == {keys["trainer"].peer_id, keys["relay"].peer_id} and net.view_at[1] == view

    end = 80.0
    seen = {keys["trainer"].peer_id: end - RECENT_S + 3, keys["relay"].peer_id: end + 5,
            keys["validator"].peer_id: end - RECENT_S - 30}
    judged = membership_at_end(tmp_path, keys, [], (end + 15, {}), procs, end, seen)
    assert judged["honest_not_alive_at_end"] == ["validator"]
    late = membership_at_end(tmp_path, keys, [], (end + 15, {}), procs, end, seen, restarted_before_end=True)
    assert late["honest_not_alive_at_end"] == [] and late["honest_not_rejoined_before_end"] == ["validator"]
    procs["validator"].events = [(end - 8, "kill"), (end - 7, "start")]
    assert membership_at_end(tmp_path, keys, [], (end + 15, {}), procs, end, seen)["honest_not_alive_at_end"] == []
    procs["validator"].events = [(end - 30, "kill"), (end - 29, "start")]
    assert membership_at_end(tmp_path, keys, [], (end + 15, {}), procs, end, seen)["honest_not_alive_at_end"] == \
        ["validator"]
