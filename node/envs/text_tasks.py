"""Tasks for a pretrained chat model: prompts are chat messages, rewards score decoded text.

`reverse-text` follows prime-rl's definition (its `reverse_text` environment, read, not copied):
reverse a short text character by character, answer inside <reversed_text> tags, reward = the
longest-common-subsequence ratio (difflib's `SequenceMatcher.ratio`) between the answer and the
exact reversal. prime-rl draws its texts from a Hugging Face data set; here they are drawn offline
from a fixed word list with the task's seed. Differences, on purpose: a completion without the tags
is scored as a whole (a 135M model rarely writes the tags before training, and a zero for every
sample gives GRPO no signal).

`reverse-text-long`: the same task on texts whose length is heavy-tailed (Pareto: most a few words,
some a hundred and more), each with a completion budget that grows with its text (up to 1,024 tokens):
the long-tailed lengths of RL workloads, where a batch waits on its longest rollouts.

`arithmetic`: a two-operand integer question ("What is 47 + 38?"); reward 1.0 when the last integer
in the completion equals the answer, else 0. Both tasks are pure functions of (seed, text), so a
validator recomputes rewards exactly.
"""

from __future__ import annotations

import random
import re
from difflib import SequenceMatcher

from node.envs.base import Environment, Task

WORDS = (
    "apple river stone light green house music paper water happy small bright cloud dream window "
    "garden silver orange little summer winter yellow coffee simple number yesterday mountain purple "
    "forest animal people friend family market planet rocket spring rabbit tiger candle basket pencil "
    "school doctor bottle button castle dragon engine flower guitar island jungle kitten ladder mirror "
    "needle ocean pillow puzzle rainbow shadow spider sugar tunnel violin wallet zebra the and of red "
    "blue cat dog sun moon star tree book fish bird road door hand ship rain snow wind fire gold milk"
).split()
_TAG = re.compile(r"<reversed_text>\s*(.*?)\s*(?:</reversed_text>|$)", re.S)
_INT = re.compile(r"-?\d[\d,]*")


def lcs_ratio(a: str, b: str) -> float:
    """Longest-common-subsequence similarity in [0, 1] (difflib's ratio: 2 * matches / total length)."""
    return SequenceMatcher(None, a, b).ratio()


class ReverseText(Environment):
    """Reverse a short text character by character; reward = LCS ratio to the exact reversal."""

    name = "reverse-text"
    system_prompt = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."

    def __init__(self, min_words: int = 1, max_words: int = 3, max_new_tokens: int = 32):
        self.min_words, self.max_words = min_words, max_words
        self.max_new_tokens = max_new_tokens

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(self.min_words, self.max_words)))
        return Task(f"reverse-text-{seed}", text, text[::-1], {"text": text}, system=self.system_prompt)

    def reward(self, task: Task, transcript: str) -> float:
        m = _TAG.search(transcript)
        answer = m.group(1) if m else transcript.strip()
        return lcs_ratio(answer, task.answer)


class LongReverseText(ReverseText):
    """`reverse-text` with heavy-tailed text lengths and a budget per task (`new_tokens`)."""

    name = "reverse-text-long"

    def __init__(self, alpha: float = 1.2, max_words: int = 170, max_new_tokens: int = 1024):
        super().__init__(1, max_words, max_new_tokens)
        self.alpha = alpha

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        n = min(self.max_words, int(2 * rng.paretovariate(self.alpha)))
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, n)))
        return Task(f"reverse-text-long-{seed}", text, text[::-1], {"text": text}, system=self.system_prompt)

    def new_tokens(self, task: Task) -> int:
        # reversed words split into about one token per 1-2 characters: the text's length in characters
        # (plus the tags) is room enough for the answer, and the budget grows with the task
        return min(self.max_new_tokens, 32 + len(task.answer))


class Arithmetic(Environment):
    """'What is 47 + 38?' (+, -, x on 1-2 digit numbers); reward 1.0 when the final integer is right."""

    name = "arithmetic"
    system_prompt = "Solve the arithmetic problem. End your reply with the final answer as a number."

    def __init__(self, max_value: int = 99, max_new_tokens: int = 48):
        self.max_value = max_value
        self.max_new_tokens = max_new_tokens

    def sample_task(self, seed: int) -> Task:
        rng = random.Random(seed)
        a, b = rng.randint(1, self.max_value), rng.randint(1, self.max_value)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        shown = {"+": "+", "-": "-", "*": "*"}[op]
        return Task(f"arithmetic-{seed}", f"What is {a} {shown} {b}?", str(value), {"a": a, "b": b, "op": op},
                    system=self.system_prompt)

    def reward(self, task: Task, transcript: str) -> float:
        numbers = _INT.findall(transcript)
        return 1.0 if numbers and numbers[-1].replace(",", "") == task.answer else 0.0
