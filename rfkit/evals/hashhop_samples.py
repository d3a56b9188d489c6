"""HashHop: follow a chain of random hashes through a shuffled list of assignments (the paper's h_gq).

This module makes the samples (``rfkit data hashhop`` writes them as JSONL); scoring and
``rfkit eval hashhop`` are :mod:`rfkit.evals.hashhop`, fine-tuning on generated samples
:mod:`rfkit.evals.hashhop_finetune`.

After magicproduct/hash-hop, written from its description. One sample:

* hashes are random strings of ``hash_len`` letters (a-z, A-Z), all distinct within a sample;
* the queried chain has ``hops`` links ``h0 = h1``, ``h1 = h2``, ..., ``h{hops-1} = 'h{hops}'``;
  the last link of every chain is written with its value in single quotes;
* distractor chains of the same length (the last one shorter when that lands closer to the
  target) fill the prompt up to about ``chars`` characters; all lines are shuffled together;
* the prompt is the lines, a blank line, one question line, and the completion start
  ``h0 =`` (no trailing space, so that the completion's first hash keeps its leading space,
  as a BPE tokenizer splits it in running text);
* the completion (chain-of-thought target) lists the whole chain: `` h1 = h2 = ... = 'h{hops}'``.

    rfkit data hashhop --n N --out FILE.jsonl [--hops 16] [--hash-len 8] [--chars 6144] [--seed 0]
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

from rfkit.evals.common import EvalError
from rfkit.validate import is_int, positive_int

ALPHABET = string.ascii_letters  # a-z and A-Z: 52 letters
QUESTION = "Follow the chain of assignments that starts at {first}: write each hash it passes through, in order, until the quoted value."
DEFAULTS = {"hops": 16, "hash_len": 8, "chars": 6144}
# a sample never uses more than this fraction of the 52**hash_len possible hashes
MAX_HASH_SPACE_FRACTION = 0.25


# -------------------------------------------------------------------------------------------- generator
def _line(a: str, b: str, last: bool) -> str:
    return f"{a} = '{b}'" if last else f"{a} = {b}"


def _question(first: str) -> str:
    return f"\n\n{QUESTION.format(first=first)}\n{first} ="


def format_completion(chain: list[str]) -> str:
    """The target completion of ``chain`` = [h0, ..., hN]: `` h1 = h2 = ... = 'hN'``."""
    if len(chain) < 2:
        raise ValueError("a chain needs at least two hashes")
    return " " + " = ".join(chain[1:-1] + [f"'{chain[-1]}'"])


def hashes_needed(hash_len: int, hops: int, chars: int) -> int:
    """An upper bound on the distinct hashes one sample draws (the queried chain plus the
    distractors that fill ``chars`` characters; every line holds at least one new hash)."""
    per_line = 2 * hash_len + 4  # "a = b\n", the shortest line
    return (hops + 1) + (hops + 1) * (max(chars, 0) // (per_line * hops) + 2)


def hash_len_problem(hash_len: int, hops: int, chars: int) -> str | None:
    """Why ``hash_len`` gives too few distinct hashes for the sample size, or None."""
    if hash_len < 2:
        return f"must be >= 2 (52**{hash_len} letters give too few distinct hashes), got {hash_len}"
    need = hashes_needed(hash_len, hops, chars)
    if need > MAX_HASH_SPACE_FRACTION * len(ALPHABET) ** hash_len:
        return (
            f"{hash_len} letters give {len(ALPHABET) ** hash_len} hashes, too few for the ~{need} distinct ones "
            "a sample of this --hops/--chars needs; use a longer hash or fewer --chars"
        )
    return None


def _draw(rng: random.Random, hash_len: int, used: set[str]) -> str:
    while True:
        h = "".join(rng.choice(ALPHABET) for _ in range(hash_len))
        if h not in used:
            used.add(h)
            return h


def _chain(rng: random.Random, links: int, hash_len: int, used: set[str]) -> list[str]:
    return [_draw(rng, hash_len, used) for _ in range(links + 1)]


def _chain_lines(chain: list[str]) -> list[str]:
    n = len(chain) - 1
    return [_line(chain[i], chain[i + 1], i == n - 1) for i in range(n)]


def make_sample(rng: random.Random, hash_len: int = 8, hops: int = 16, chars: int = 6144) -> dict[str, Any]:
    """One HashHop sample drawn from ``rng``.

    Returns a dict with ``prompt`` (shuffled lines, question, ``h0 =``), ``completion`` (the
    target `` h1 = ... = 'h{hops}'``), ``chain`` ([h0, ..., h{hops}]), ``hops``, ``hash_len``,
    ``chars`` (the target prompt length) and ``lines`` (number of assignment lines).

    The prompt comes within about one line (``2 * hash_len + 6`` characters) of ``chars``,
    unless the queried chain and question alone are longer.
    """
    positive_int("hops", hops, error=ValueError, message="{field} must be an integer >= {minimum}, got {value!r}")
    positive_int("chars", chars, error=ValueError, message="{field} must be an integer >= {minimum}, got {value!r}")
    problem = hash_len_problem(hash_len, hops, chars) if is_int(hash_len) else "must be an integer"
    if problem:
        raise ValueError(f"hash_len {problem}")
    used: set[str] = set()
    chain = _chain(rng, hops, hash_len, used)
    lines = _chain_lines(chain)
    fixed = len(_question(chain[0]))
    size = sum(len(x) + 1 for x in lines) - 1  # lines joined by newlines
    plain = 2 * hash_len + 4  # "a = b" plus its newline
    # full distractor chains while they fit, then one shorter chain for the remainder
    while True:
        room = chars - fixed - size
        links = min(hops, (room - 2) // plain)  # the quoted last line is 2 characters longer
        if links < 1:
            break
        distractor = _chain_lines(_chain(rng, links, hash_len, used))
        lines.extend(distractor)
        size += sum(len(x) + 1 for x in distractor)
    rng.shuffle(lines)
    prompt = "\n".join(lines) + _question(chain[0])
    return {
        "prompt": prompt,
        "completion": format_completion(chain),
        "chain": chain,
        "hops": hops,
        "hash_len": hash_len,
        "chars": chars,
        "lines": len(lines),
    }


def sample_rng(seed: int, index: int, split: str = "test") -> random.Random:
    """The generator of sample ``index`` of ``split`` under ``seed``: samples are independent,
    so sample i does not depend on how many samples are drawn, and splits never share a stream."""
    return random.Random(f"hashhop:{split}:{seed}:{index}")


def generate_samples(n: int, seed: int = 0, split: str = "test", **kw) -> list[dict[str, Any]]:
    """``n`` samples (see :func:`make_sample`; ``kw``: ``hash_len``, ``hops``, ``chars``), each
    with its ``seed``, ``split`` and ``index``. Deterministic given (n, seed, split, kw).

    ``rfkit eval hashhop`` and ``rfkit data hashhop`` use split ``test``;
    :class:`HashHopDataModule` uses ``train`` and ``validation``, so fine-tuning never sees the
    evaluation samples.
    """
    out = []
    for i in range(n):
        sample = make_sample(sample_rng(seed, i, split), **kw)
        sample.update(seed=seed, split=split, index=i)
        out.append(sample)
    return out


# -------------------------------------------------------------------------------------------- `rfkit data hashhop`
def add_sample_arguments(parser) -> None:
    """``--hops --hash-len --chars --seed``: how samples are generated."""
    parser.add_argument("--hops", type=int, default=DEFAULTS["hops"], help="links in the queried chain (default 16)")
    parser.add_argument("--hash-len", type=int, default=DEFAULTS["hash_len"], help="letters per hash (default 8)")
    parser.add_argument("--chars", type=int, default=DEFAULTS["chars"], help="target prompt length in characters (default 6144)")
    parser.add_argument("--seed", type=int, default=0, help="sample i is drawn from a generator seeded by (seed, i)")


def check_sample_arguments(args) -> None:
    """The checks of :func:`add_sample_arguments`'s flags (raises :class:`EvalError`)."""
    positive_int("--hops", args.hops, error=EvalError, message="{field}: must be >= {minimum} (links in the queried chain), got {value}")
    positive_int(
        "--chars", args.chars, error=EvalError, message="{field}: must be >= {minimum} (target prompt length in characters), got {value}"
    )
    problem = hash_len_problem(args.hash_len, args.hops, args.chars)
    if problem:
        raise EvalError(f"--hash-len: {problem}")


def add_data_arguments(parser) -> None:
    """``--n N --out FILE.jsonl [--hops --hash-len --chars --seed]``."""
    parser.add_argument("--n", type=int, required=True, help="number of samples")
    parser.add_argument("--out", required=True, help="JSONL file to write (one sample per line)")
    add_sample_arguments(parser)


def validate_data(args) -> None:
    """Every check of ``rfkit data hashhop`` (raises :class:`EvalError`)."""
    positive_int("--n", args.n, error=EvalError, message="{field}: must be >= {minimum} (number of samples), got {value}")
    check_sample_arguments(args)
    parent = Path(args.out).expanduser().resolve().parent
    if not parent.is_dir():
        raise EvalError(f"--out: directory '{parent}' does not exist")
    if Path(args.out).is_dir():
        raise EvalError(f"--out: '{args.out}' is a directory; give a .jsonl file path")


def run_data(args) -> int:
    """Generate the samples and write them atomically as JSONL."""
    from tqdm.auto import tqdm

    from rfkit.atomic import atomic_write

    kw = {"hops": args.hops, "hash_len": args.hash_len, "chars": args.chars}
    samples = []
    for i in tqdm(range(args.n), desc="hashhop samples", unit="sample"):
        sample = make_sample(sample_rng(args.seed, i), **kw)
        sample.update(seed=args.seed, split="test", index=i)
        samples.append(sample)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)

    atomic_write(Path(args.out).expanduser(), write)
    print(f"hashhop: {args.n} samples ({args.hops} hops, {args.hash_len}-letter hashes, ~{args.chars} chars) -> {args.out}")
    return 0


def read_samples(path: str, flag: str = "--data") -> list[dict]:
    """Samples from a JSONL file written by ``rfkit data hashhop`` (each checked for shape)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise EvalError(f"{flag}: file '{path}' does not exist")
    samples = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalError(f"{flag}: {p.name} line {lineno} is not valid JSON ({' '.join(str(e).split())})") from None
            ok = (
                isinstance(obj, dict)
                and isinstance(obj.get("prompt"), str)
                and isinstance(obj.get("completion"), str)
                and isinstance(obj.get("chain"), list)
                and len(obj["chain"]) >= 2
                and all(isinstance(h, str) and h for h in obj["chain"])
            )
            if not ok:
                raise EvalError(
                    f"{flag}: {p.name} line {lineno} is not a HashHop sample "
                    "(needs prompt, completion and a chain of at least two hashes; write it with `rfkit data hashhop`)"
                )
            samples.append(obj)
    if not samples:
        raise EvalError(f"{flag}: {p.name} holds no samples")
    return samples
