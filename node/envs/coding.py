"""An agentic coding task: the model writes a Python function, a sandboxed tool runs it against the
visible examples and replies, over several turns; hidden tests decide the reward.

Protocol (every character is in the char tokenizer's alphabet): the prompt states the function and
two examples. A model turn is code ending with `#run` (the stop string). The tool runs that code
plus the visible examples in the sandbox (node/envs/sandbox.py) and replies `#ok` (which ends the
episode) or `#fail:<first error line>`. Reward: the share of hidden tests that the last submitted
code passes, run in a fresh sandbox. The reward is a pure function of task and transcript, so a
validator recomputes it (it runs the same sandboxed tests).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from node.envs.base import Environment, Task
from node.envs.sandbox import SandboxLimits, run_python
from node.model.tokenizer import _CHARS

RUN = "#run"


@dataclass(frozen=True)
class Family:
    """A kind of function: a description with parameters, and a reference implementation."""

    name: str
    describe: str  # format string over the parameters
    reference: str  # Python source of f, format string over the parameters
    inputs: str  # 'int' or 'list'


FAMILIES = (
    Family("affine", "f(x) returns x*{a}+({b})", "def f(x):\n    return x*{a}+({b})\n", "int"),
    Family("mod", "f(x) returns the remainder of x divided by {a}", "def f(x):\n    return x-(x//{a})*{a}\n", "int"),
    Family("clip", "f(x) returns x but at most {a}", "def f(x):\n    return min(x, {a})\n", "int"),
    Family("sumlist", "f(xs) returns the sum of the list xs plus ({b})", "def f(xs):\n    return sum(xs)+({b})\n", "list"),
    Family("maxlist", "f(xs) returns the largest item of xs times {a}", "def f(xs):\n    return max(xs)*{a}\n", "list"),
)


def _inputs(rng: random.Random, kind: str, n: int) -> list:
    if kind == "int":
        return [rng.randint(-50, 99) for _ in range(n)]
    return [[rng.randint(-9, 20) for _ in range(rng.randint(1, 5))] for _ in range(n)]


def _expected(reference: str, xs: list) -> list:
    namespace: dict = {}
    exec(reference, namespace)  # our own reference source, never model text
    return [namespace["f"](x) for x in xs]


def _test_script(cases: list[tuple[object, object]]) -> str:
    """A script that imports the candidate and prints how many cases pass (each guarded)."""
    return ("import json\nfrom solution import f\npassed = 0\n"
            f"cases = json.loads({json.dumps(json.dumps(cases))})\n"
            "for x, want in cases:\n    try:\n        passed += f(x) == want\n    except Exception:\n        pass\n"
            "print('PASSED', passed, len(cases))\n")


def _clean(text: str, limit: int = 48) -> str:
    """A tool reply the char tokenizer can encode: unknown characters become '?'."""
    return "".join(c if c in _CHARS else "?" for c in text[:limit])


class Coding(Environment):
    name = "coding"
    max_turns = 3
    max_new_tokens = 160
    stop_strings = (RUN,)
    cheap_reward = False  # runs the hidden tests in a sandbox: the validator's verdict covers it

    def __init__(self, hidden_tests: int = 8, limits: SandboxLimits = SandboxLimits(cpu_seconds=2, wall_seconds=4.0,
                                                                                      memory_bytes=256 * 2**20)):
        self.hidden_tests = hidden_tests
        self.limits = limits

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        family = FAMILIES[rng.randrange(len(FAMILIES))]
        params = {"a": rng.randint(2, 9), "b": rng.randint(-9, 9)}
        reference = family.reference.format(**params)
        xs = _inputs(rng, family.inputs, 2 + self.hidden_tests)
        cases = list(zip(xs, _expected(reference, xs)))
        shown = " ".join(f"f({x})={y}." for x, y in cases[:2]).replace(" ", "")
        prompt = f"# {family.describe.format(**params)}. {shown}\n"
        return Task(f"coding-{seed}", prompt, reference, {"visible": cases[:2], "hidden": cases[2:],
                                                          "family": family.name})

    def _score(self, code: str, cases: list) -> tuple[int, str]:
        result = run_python(_test_script(cases), limits=self.limits, files={"solution.py": code})
        for line in result.stdout.splitlines():
            if line.startswith("PASSED "):
                return int(line.split()[1]), ""
        error = (result.stderr.strip().splitlines() or ["timed out" if result.timed_out else "no output"])[-1]
        return 0, error

    def respond(self, task: Task, transcript: str) -> str | None:
        code = last_code(transcript)
        if code is None:
            return None
        passed, error = self._score(code, task.data["visible"])
        if passed == len(task.data["visible"]):
            return None  # the visible examples pass: the episode ends and the hidden tests decide
        why = error or f"{passed} of {len(task.data['visible'])} examples pass"
        return f"\n#fail:{_clean(why)}\n"

    def reward(self, task: Task, transcript: str) -> float:
        code = last_code(transcript)
        if code is None:
            return 0.0
        passed, _ = self._score(code, task.data["hidden"])
        return passed / len(task.data["hidden"])


def last_code(transcript: str) -> str | None:
    """The code of the last model turn that ended with `#run` (tool replies start with '\\n#fail')."""
    if RUN not in transcript:
        return None
    body = transcript[: transcript.rindex(RUN)]
    if "#fail:" in body:
        body = body.split("#fail:")[-1].split("\n", 1)[-1] if "\n" in body.split("#fail:")[-1] else ""
    return body
