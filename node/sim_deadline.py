"""When a `primerl-node sim` run ends, and how long it should take (said before it starts).

A run ends `STOP_AFTER_TARGET` steps after the reward target, after its steps, or when it gives up:
by default the limit follows the work (a start-up allowance plus a per-step allowance, raised to the
measured pace, and an early end only when no step finishes for a while); `--timeout` makes it a
hard limit.
"""

from __future__ import annotations

import os

from node.sim_report import REWARD_TARGET

VLLM_START_S = 300.0
"""How long the sim waits for a vLLM node's server to come up (DESIGN.md: 30-55 s on a 2-core machine)."""
STOP_AFTER_TARGET = 10
"""`sim` (and `make run`) ends this many steps after the 5-step mean reward first reaches REWARD_TARGET."""
START_ALLOWANCE_S = 180.0
"""Time the timeout allows for start-up (processes, joins, the trainer's warm-up) and shutdown."""
STEP_ALLOWANCE_S = 6.0
"""Time the timeout allows per trainer step (64 groups x 8 samples, 4 inference nodes, churn, a cheater):
measured on cpu-2core 2.0 s/step up to the target (step 261 at 532 s) and 2.8 s/step over 500 steps on
a quiet machine, 4.5 s/step on a loaded one (step 334 at 1,500 s); 6 s leaves a third of margin."""
MEASURED = {"machine": "cpu-2core", "load": "1.5-6.5, the sim's own processes only", "target_step": 164,
            "target_s": 370, "run_steps": 175, "run_s": 408}
"""The last measured `make run` (benchmarks/results/sim-make-run-s10-quiet-cpu-2core.json, session 10, at
509cfc9), quoted in the start-up estimate: 3.7 CPU-s per step over the run (inference nodes 1.6, validator
0.9, trainer 0.6, coordinator 0.5, relay 0.1), 2.4 s between steps. Before: session 7 at load 5-25 reached
step 189 after 1,622 s at 7.6 CPU-s per step; issue 28 was filed on step 184 after 2,448 s."""
MEASURED_LOADED = {"load": "~30", "target_step": 227, "target_s": 3176}
"""The same on a machine shared with other jobs (benchmarks/results/sim-make-run-cpu-2core-loaded.json)."""
PROGRESS_EVERY = 25
"""Steps between progress lines (rate so far, time left at most)."""
STALL_S = 600.0
"""The run gives up when no trainer step finishes for this long (after start-up): a coordinator
restart and re-joins take well under a minute, a step under heavy load tens of seconds."""
PACE_AFTER_STEPS = 10
"""Steps after which the limit follows the measured pace."""
PACE_MARGIN = 1.5
"""The limit allows the remaining steps this many times the pace measured so far."""
COORDINATOR_KILL_STEP = 40
"""With --churn the coordinator is SIGKILLed once, at a third of the steps but no later than this step,
so a run that stops at the reward target still sees the restart: `make run` reached it at step 79 once
(session 10, fresh clone) and ended at step 89, before the step-100 kill then in force."""


class Deadline:
    """When a sim gives up. `limit` seconds; with `follow`, the limit rises to the measured pace
    (elapsed + remaining steps x pace x PACE_MARGIN, once PACE_AFTER_STEPS are done) and the run ends
    early when no step finishes for STALL_S (START_ALLOWANCE_S more before the first)."""

    def __init__(self, steps: int, limit: float, follow: bool = True):
        self.steps, self.limit, self.follow = steps, limit, follow
        self.seen, self.seen_at = 0, 0.0

    def check(self, done_steps: int, elapsed: float) -> str | None:
        """None while the run may go on, else why it ends ("timeout" or "stalled")."""
        if done_steps > self.seen:
            self.seen, self.seen_at = done_steps, elapsed
            if self.follow and done_steps >= PACE_AFTER_STEPS:
                pace = elapsed / done_steps
                self.limit = max(self.limit, elapsed + (self.steps - done_steps) * pace * PACE_MARGIN)
        elif self.follow and elapsed - self.seen_at > STALL_S + (START_ALLOWANCE_S if done_steps == 0 else 0):
            return "stalled"
        return "timeout" if elapsed > self.limit else None


def timeout_for(steps: int, vllm_nodes: int = 0) -> float:
    """How long a sim of `steps` steps may run: start-up + a per-step allowance (+ vLLM's start)."""
    return START_ALLOWANCE_S + steps * STEP_ALLOWANCE_S + (VLLM_START_S if vllm_nodes else 0.0)


def plan(steps: int, stop_after_target: int | None, timeout_s: float, load: tuple[float, int] | None = None) -> str:
    """What the run will do and how long it should take, said before it starts. `load`: (load average,
    cores) of this machine now (default: measured here); a busy machine is named, as it takes longer."""
    m = MEASURED
    if load is None:
        load = (os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0, os.cpu_count() or 1)
    busy = (f" This machine is busy (load average {load[0]:.0f} on {load[1]} cores): expect several times that, "
            f"e.g. the {MEASURED_LOADED['target_step']}-step run at load {MEASURED_LOADED['load']} took "
            f"{MEASURED_LOADED['target_s'] / 60:.0f} min to the target." if load[0] > 2 * load[1] else "")
    until = (f"until {stop_after_target} steps after the 5-step mean reward reaches {REWARD_TARGET} (at most {steps} "
             f"steps)" if stop_after_target is not None else f"for {steps} steps")
    pace = m["run_s"] / m["run_steps"]
    est = (m["target_s"] + stop_after_target * pace
           if stop_after_target is not None and steps >= m["target_step"] else pace * steps)
    return (f"sim: trains {until}. Measured with the defaults on {m['machine']} (load {m['load']}): target at step "
            f"{m['target_step']} ({m['target_s'] / 60:.0f} min), {m['run_steps']} steps in {m['run_s'] / 60:.0f} min; "
            f"expect about {est / 60:.0f} min here, more while other jobs share the machine (progress lines say how "
            f"it goes).{busy} "
            f"It gives up "
            f"after {timeout_s / 60:.0f} min ({START_ALLOWANCE_S:.0f} s + {STEP_ALLOWANCE_S:.0f} s per step), later "
            f"if its measured pace needs it, or when no step finishes for {STALL_S / 60:.0f} min.")
