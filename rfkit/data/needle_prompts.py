"""The needle prompts: the passkey test's template and the needle shapes of ``rfkit eval needles``.

Data, not evaluation: ``rfkit eval passkey``, ``rfkit eval context`` and ``rfkit eval needles``
(:mod:`rfkit.evals`) ask these prompts of a model, and the state audit of ``rfkit fit``
(:mod:`rfkit.training.state_audit`) writes the same shapes from the *train* split of their
filler to calibrate on. The layout of each prompt is described in :mod:`rfkit.evals.passkey`
(the passkey test) and :mod:`rfkit.evals.needles` (the shapes).
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

from rfkit.errors import RFKitError


class PromptError(RFKitError):
    """A prompt length that cannot hold its template, or a filler without enough sentences; one
    line for the user."""


INSTRUCTION = (
    "Somewhere in the long passage below, a pass key is hidden among sentences that do not matter. "
    "Find the pass key and keep it in mind: you will be asked for it at the end."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# the filler is laid down sentence by sentence (repeating the five), so prompts land within a
# sentence of the target length
FILLER_SENTENCES = [part + "." for part in FILLER[:-1].split(". ")]
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
NEW_TOKENS = 8


def compose(sentences: int, depth: float, key: int) -> str:
    """The prompt with ``sentences`` filler sentences (the filler repeated, cut after that many
    sentences) and the needle after ``round(depth * sentences)`` of them."""
    filler = [FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(sentences)]
    at = round(depth * sentences)
    parts = [INSTRUCTION, *filler[:at], NEEDLE.format(key=key), *filler[at:]]
    return " ".join(parts) + "\n" + QUESTION


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` as ``greedy_generate`` encodes it (special tokens included)."""
    return len(tokenizer(text)["input_ids"])


def build_prompt(tokenizer, length: int, depth: float, key: int) -> tuple[str, int]:
    """The longest prompt of at most ``length`` tokens: ``(text, tokens)``.

    Raises:
        PromptError: ``length`` cannot hold even the template without filler.
    """
    return longest_prompt(tokenizer, length, lambda n: compose(n, depth, key))


def longest_prompt(tokenizer, length: int, make, what: str = "the passkey template") -> tuple[str, int]:
    """``make(n)`` (a prompt with ``n`` filler sentences) for the largest ``n`` whose prompt is at
    most ``length`` tokens: ``(text, tokens)``. Shared by every needle test
    (the needle shapes below).

    Raises:
        PromptError: ``length`` cannot hold even ``make(0)``.
    """
    def size(n: int) -> int:
        return count_tokens(tokenizer, make(n))

    smallest = size(0)
    if smallest > length:
        raise PromptError(
            f"--lengths: {length} tokens cannot hold {what} ({smallest} tokens without filler); "
            f"give lengths of at least {smallest}"
        )
    low, high = 0, 8  # size(low) <= length; find high with size(high) > length
    while size(high) <= length:
        low, high = high, high * 2
    while high - low > 1:  # the most filler sentences that fit
        mid = (low + high) // 2
        if size(mid) <= length:
            low = mid
        else:
            high = mid
    text = make(low)
    return text, count_tokens(tokenizer, text)


def template_tokens(tokenizer) -> int:
    """Tokens of the template with no filler (the shortest possible prompt)."""
    return max(count_tokens(tokenizer, compose(0, d, k)) for d in (0.0, 1.0) for k in (10000, 99999))


def trial_key(seed: int, length: int, depth: float, trial: int) -> int:
    """The 5-digit key of one trial, fixed by (seed, length, depth, trial) alone."""
    return random.Random(f"passkey:{seed}:{length}:{depth!r}:{trial}").randint(10000, 99999)



# ----------------------------------------------------------------------------- needle shapes
@dataclass(frozen=True)
class Shape:
    """One kind of needle test: its filler, its key and how many needles it hides."""

    name: str
    about: str
    filler: str | None = None  # None: the passkey filler repeated; else the source whose held-out sentences fill
    digits: int = 5
    needles: int = 1
    new_tokens: int = NEW_TOKENS
    question: str | None = None  # one-needle shapes: None asks the passkey test's question (multi asks MULTI_QUESTION)


# After encyclopaedic text SmolLM2 continues "The pass key is" with a definition ("a device
# used to ...", the original 0 of 6 at 2,048 tokens, with the key the sentence before); asked
# for "the number" it quotes the key (6 of 6 on the same prompts).
PROSE_QUESTION = "What is the pass key? The pass key is the number"


SHAPES = {
    shape.name: shape
    for shape in (
        Shape("passkey", "the passkey test: one 5-digit key in the repeated filler"),
        Shape(
            "prose", "one 5-digit key in held-out Wikipedia summaries, asked for as a number",
            filler="embedded:wikipedia-en", question=PROSE_QUESTION,
        ),
        Shape("plays", "one 5-digit key in held-out Shakespeare", filler="embedded:shakespeare"),
        Shape("long", "one 20-digit key in the repeated filler", digits=20, new_tokens=24),
        Shape("multi", "three 5-digit keys for three doors; the question asks for one", needles=3),
    )
}
DEFAULT_SHAPES = ",".join(SHAPES)
ALLOWED = ", ".join(SHAPES)
COLOURS = ("red", "green", "blue")
MULTI_INSTRUCTION = (
    "Several pass keys are hidden in the long passage below, one for each door. "
    "Find them and keep them in mind: you will be asked for one of them at the end."
)
MULTI_NEEDLE = "The pass key of the {colour} door is {key}. Remember it. {key} is the pass key of the {colour} door."
MULTI_QUESTION = "What is the pass key of the {colour} door? The pass key of the {colour} door is"


@functools.lru_cache(maxsize=4)
def filler_sentences(source: str, split: str = "validation") -> tuple[str, ...]:
    """The sentences of ``source``'s ``split`` documents (rfkit's own split: ``validation`` is
    never trained on; ``train`` serves calibration, :mod:`rfkit.training.state_audit`),
    whitespace made single, without digits, of 4 to 60 words."""
    from rfkit.data.documents import split_documents
    from rfkit.data.embedded import default_split
    from rfkit.data.sources import load_documents

    docs = split_documents(load_documents(source), default_split(source))[split]
    sentences = []
    for doc in docs:
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.text.split())):
            if 4 <= len(sentence.split()) <= 60 and not re.search(r"\d", sentence):
                sentences.append(sentence)
    if len(sentences) < 50:
        raise PromptError(f"--shapes: '{source}' holds {len(sentences)} usable {split} sentences; the filler needs at least 50")
    return tuple(sentences)


def held_out_sentences(source: str) -> tuple[str, ...]:
    """:func:`filler_sentences` of the validation split: the evaluations' filler."""
    return filler_sentences(source, "validation")


def insert(instruction: str, filler: list[str], needles: list[tuple[float, str]], question: str) -> str:
    """``instruction``, the filler with each ``(depth, needle)`` after ``round(depth * len(filler))``
    of its sentences (in the order given where two fall together), then the question on its own
    line: :func:`compose`'s layout for any number of needles."""
    n = len(filler)
    at = sorted((round(depth * n), i) for i, (depth, _) in enumerate(needles))
    parts, done = [instruction], 0
    for where, i in at:
        parts += filler[done:where]
        parts.append(needles[i][1])
        done = where
    parts += filler[done:]
    return " ".join(parts) + "\n" + question


def trial(shape: Shape, tokenizer, length: int, depth: float, seed: int, index: int, split: str = "validation") -> dict:
    """One prompt of at most ``length`` tokens: ``{"text", "prompt_tokens", "key", "keys"}``
    (``keys``: every needle's key, the asked one first). Fixed by (shape, seed, length, depth,
    index) alone, so every model sees the same prompt. A running-text filler reads ``split``'s
    sentences (``train``: calibration prompts, never the evaluation's)."""
    if shape.name == "passkey":  # the passkey test's own key and prompt
        key = trial_key(seed, length, depth, index)
        text, tokens = build_prompt(tokenizer, length, depth, key)
        return {"text": text, "prompt_tokens": tokens, "key": key, "keys": [key]}
    # another split draws other keys too (the evaluation's own prompts are unchanged)
    tag = "" if split == "validation" else f":{split}"
    rng = random.Random(f"needles:{shape.name}:{seed}:{length}:{depth!r}:{index}{tag}")
    keys: list[int] = []
    while len(keys) < shape.needles:  # distinct keys of exactly shape.digits digits
        key = rng.randint(10 ** (shape.digits - 1), 10**shape.digits - 1)
        if key not in keys:
            keys.append(key)
    if shape.filler is None:
        sentences, start = FILLER_SENTENCES, 0
    else:
        sentences = filler_sentences(shape.filler, split)
        start = rng.randrange(len(sentences))
    if shape.needles == 1:
        instruction, question = INSTRUCTION, shape.question or QUESTION
        needles = [(depth, NEEDLE.format(key=keys[0]))]
    else:
        first = rng.randrange(len(COLOURS))
        colours = [COLOURS[(first + i) % len(COLOURS)] for i in range(shape.needles)]
        instruction, question = MULTI_INSTRUCTION, MULTI_QUESTION.format(colour=colours[0])
        needles = [
            ((depth + i / shape.needles) % 1.0 if i else depth, MULTI_NEEDLE.format(colour=colours[i], key=keys[i]))
            for i in range(shape.needles)
        ]

    def make(n: int) -> str:
        return insert(instruction, [sentences[(start + i) % len(sentences)] for i in range(n)], needles, question)

    text, tokens = longest_prompt(tokenizer, length, make, f"the {shape.name} template")
    return {"text": text, "prompt_tokens": tokens, "key": keys[0], "keys": keys}


def prompts(tokenizer, shapes: list[Shape], lengths: list[int], depths: list[float], trials: int, seed: int, split: str = "validation") -> list[dict]:
    """Every prompt of the run, each a record (``shape``, ``length``, ``depth``, ``trial``, keys,
    text); the prompt of ``length`` is at most ``length - shape.new_tokens`` tokens. Running-text
    fillers read ``split``'s sentences."""
    records = []
    for shape in shapes:
        for length in lengths:
            for depth in depths:
                for index in range(trials):
                    made = trial(shape, tokenizer, length - shape.new_tokens, depth, seed, index, split)
                    records.append({"shape": shape.name, "length": length, "depth": depth, "trial": index, **made})
    return records
