"""A deterministic synthetic instruction-following dataset, shipped as code so the demo needs no
download.

Six templated tasks over a ten-letter alphabet and single digits ("Reverse: abc" -> "cba", "Add 2
and 3" -> "5", ...). Answers follow from the prompt by simple rules, and prompts are a handful of
tokens, so a tiny transformer trained for a minute on a CPU learns the answer format and part of the
rules: its loss falls clearly, which is the point of a demonstration run.
"""

import random
from collections.abc import Iterator

LETTERS = "abcdefghij"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"Reverse: {word}", word[::-1]


def _uppercase(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"Uppercase: {word}", word.upper()


def _repeat_twice(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"Repeat twice: {word}", f"{word} {word}"


def _next_letter(rng: random.Random) -> tuple[str, str]:
    index = rng.randrange(len(LETTERS) - 1)
    return f"Next letter after {LETTERS[index]}", LETTERS[index + 1]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 4), rng.randint(0, 4)
    return f"Add {a} and {b}", str(a + b)


def _sort(rng: random.Random) -> tuple[str, str]:
    letters = rng.sample(LETTERS, rng.randint(3, 4))
    return f"Sort: {' '.join(letters)}", " ".join(sorted(letters))


TASKS = (_reverse, _uppercase, _repeat_twice, _next_letter, _add, _sort)


def iter_examples(n: int, seed: int) -> Iterator[dict]:
    """``n`` ``{"prompt", "response"}`` records drawn from the templated tasks, one at a time (no
    list held).

    Raises:
        ValueError: If ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"number of generated examples must be >= 0, got {n}")
    rng = random.Random(seed)
    for _ in range(n):
        prompt, response = rng.choice(TASKS)(rng)
        yield {"prompt": prompt, "response": response}


def generate_examples(n: int, seed: int) -> list[dict]:
    """``n`` ``{"prompt", "response"}`` records drawn from the templated tasks; same (n, seed), same
    list.

    Raises:
        ValueError: If ``n`` is negative.
    """
    return list(iter_examples(n, seed))
