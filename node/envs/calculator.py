"""A multi-turn, tool-using task: the model must call a calculator to multiply.

Protocol: the prompt is 'a*b?'. The model calls the tool by writing '<expr>' (a turn ends at '>');
the tool replies '=value;' (or '=error;'). Then the model writes the final answer and EOS.
Reward: 1.0 for the right final answer after at least one tool call, 0.5 for the right answer
without one, 0 otherwise; the tool accepts only digits and + - * (no eval of arbitrary text).
"""

from __future__ import annotations

import random
import re

from node.envs.base import Environment, Task

_CALL = re.compile(r"<([0-9+\-*]{1,32})>$")
_TERM = re.compile(r"\d+|[+\-*]")


def calculate(expr: str) -> int | None:
    """Evaluate digits with + - * and the usual precedence; None when malformed."""
    tokens = _TERM.findall(expr)
    if "".join(tokens) != expr or not tokens or not tokens[0].isdigit() or not tokens[-1].isdigit():
        return None
    terms, sign, product = [], 1, None
    expect_number = True
    op = "+"
    for tok in tokens:
        if expect_number != tok.isdigit():
            return None
        if tok.isdigit():
            n = int(tok)
            product = n if op in "+-" else product * n
            if op in "+-":
                sign = 1 if op == "+" else -1
        else:
            if tok in "+-":
                terms.append(sign * product)
            op = tok
        expect_number = not expect_number
    terms.append(sign * product)
    return sum(terms)


class Calculator(Environment):
    name = "calculator"
    max_turns = 3
    max_new_tokens = 12
    stop_strings = (">",)

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return Task(f"calculator-{seed}", f"{a}*{b}?", str(a * b), {"a": a, "b": b})

    def respond(self, task: Task, transcript: str) -> str | None:
        m = _CALL.search(transcript)
        if m is None:
            return None
        value = calculate(m.group(1))
        return "=error;" if value is None else f"={value};"

    def reward(self, task: Task, transcript: str) -> float:
        final = transcript.rsplit(";", 1)[-1]
        if final != task.answer:
            return 0.0
        return 1.0 if ";" in transcript else 0.5
