"""HashHop: follow a chain of random hashes through a shuffled list of assignments (the paper's h_gq).

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

Scoring: :func:`parse_chain` reads a generated completion back into ``[h0, h1, ...]``;
:func:`score` is the longest correct prefix *after* h0 (h0 is given in the prompt and does not
count) divided by ``hops``; h_gq is the mean over samples, in [0, 1].

Commands:

    rfkit data hashhop --n N --out FILE.jsonl [--hops 16] [--hash-len 8] [--chars 6144] [--seed 0]
    rfkit eval hashhop --model DIR|RECIPE [--original] [--samples N] [--data FILE.jsonl] [--hops 16]
                       [--hash-len 8] [--chars 6144] [--seed 0] [--batch-size 1] [--max-new-tokens N]
                       [--device cpu|cuda] [--json OUT]

Fine-tuning (the paper's appendix B): :class:`HashHopDataModule` trains on generated samples
(loss on the completion only) while calibration and validation stay on the parent's Wikipedia
blocks; see ``recipes/smollm2_hashhop_b05.yaml``.
"""

from __future__ import annotations

import json
import logging
import random
import re
import string
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from rfkit.data import TextDataModule, _is_int
from rfkit.evals.common import (
    EvalError,
    add_model_arguments,
    check_model_arguments,
    greedy_generate,
    write_json,
)
from rfkit.hub import EMBEDDED_DATA, SourceError

log = logging.getLogger(__name__)

ALPHABET = string.ascii_letters  # a-z and A-Z: 52 letters
QUESTION = "Follow the chain of assignments that starts at {first}: write each hash it passes through, in order, until the quoted value."
DEFAULTS = {"hops": 16, "hash_len": 8, "chars": 6144}
# a sample never uses more than this fraction of the 52**hash_len possible hashes
MAX_HASH_SPACE_FRACTION = 0.25
IGNORE = -100


# --------------------------------------------------------------------------------------------
# generator
# --------------------------------------------------------------------------------------------


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
    if not _is_int(hops) or hops < 1:
        raise ValueError(f"hops must be an integer >= 1, got {hops!r}")
    if not _is_int(chars) or chars < 1:
        raise ValueError(f"chars must be an integer >= 1, got {chars!r}")
    problem = hash_len_problem(hash_len, hops, chars) if _is_int(hash_len) else "must be an integer"
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


# --------------------------------------------------------------------------------------------
# scoring
# --------------------------------------------------------------------------------------------

_ITEM = re.compile(r"\s*(['\"`]?)([A-Za-z]+)(['\"`]?)")
_SEP = re.compile(r"\s*=")


def parse_chain(text: str, first: str) -> list[str]:
    """The chain a generated completion predicts: ``[first, h1, h2, ...]``.

    Reads ``h1 = h2 = ... = 'hN'`` from the start of ``text`` (after an optional leading ``=``),
    ignoring whitespace (newlines included) and quote marks (``'``, ``"`` or a backtick) around a
    hash. Stops after a quoted hash (the end of a chain), at the first piece that is not a
    run of letters, or where no ``=`` follows; whatever trails is ignored. If the model repeats
    ``first`` as its first item, that repetition is dropped.
    """
    out = [first]
    pos = 0
    lead = _SEP.match(text, pos)
    if lead:
        pos = lead.end()
    while True:
        item = _ITEM.match(text, pos)
        if not item:
            break
        out.append(item.group(2))
        pos = item.end()
        if item.group(1) or item.group(3):
            break
        sep = _SEP.match(text, pos)
        if not sep:
            break
        pos = sep.end()
    if len(out) > 1 and out[1] == first:
        del out[1]
    return out


def score(pred: list[str], target: list[str]) -> float:
    """Longest correct prefix of ``pred`` after h0, divided by the number of hops.

    Both lists start with h0 (given in the prompt, so it does not count); a perfect chain
    scores 1.0, a wrong first hop 0.0, and hashes predicted beyond the end are ignored.
    """
    hops = len(target) - 1
    if hops < 1:
        raise ValueError("target needs h0 and at least one hop")
    correct = 0
    for i in range(1, len(target)):
        if i >= len(pred) or pred[i] != target[i]:
            break
        correct += 1
    return correct / hops


def completion_budget(tokenizer, samples: list[dict], margin: float = 0.25, extra: int = 8) -> int:
    """Tokens to generate: the longest target completion in tokens, plus 25% and 8 tokens."""
    longest = max(len(tokenizer(s["completion"], add_special_tokens=False)["input_ids"]) for s in samples)
    return int(longest * (1 + margin)) + extra


def evaluate_hashhop(model, tokenizer, samples: list[dict], batch_size: int = 1, max_new_tokens: int | None = None) -> dict:
    """Greedy-decode each sample's prompt and score the predicted chains.

    Returns ``{"h_gq", "n", "max_new_tokens", "samples": [{"index", "prediction", "target",
    "score", "text"}, ...]}``, ``text`` being the raw generated completion.
    """
    from tqdm.auto import tqdm

    if not samples:
        raise ValueError("no samples to evaluate")
    if max_new_tokens is None:
        max_new_tokens = completion_budget(tokenizer, samples)
    with tqdm(total=len(samples), desc="hashhop", unit="sample") as bar:
        texts = greedy_generate(model, tokenizer, [s["prompt"] for s in samples], max_new_tokens, batch_size, bar)
    rows = []
    for i, (s, text) in enumerate(zip(samples, texts)):
        target = list(s["chain"])
        pred = parse_chain(text, target[0])
        rows.append({"index": s.get("index", i), "prediction": pred, "target": target, "score": score(pred, target), "text": text})
    h_gq = sum(r["score"] for r in rows) / len(rows)
    return {"h_gq": h_gq, "n": len(rows), "max_new_tokens": max_new_tokens, "samples": rows}


# --------------------------------------------------------------------------------------------
# `rfkit data hashhop`
# --------------------------------------------------------------------------------------------


def _add_sample_arguments(parser) -> None:
    parser.add_argument("--hops", type=int, default=DEFAULTS["hops"], help="links in the queried chain (default 16)")
    parser.add_argument("--hash-len", type=int, default=DEFAULTS["hash_len"], help="letters per hash (default 8)")
    parser.add_argument("--chars", type=int, default=DEFAULTS["chars"], help="target prompt length in characters (default 6144)")
    parser.add_argument("--seed", type=int, default=0, help="sample i is drawn from a generator seeded by (seed, i)")


def _check_sample_arguments(args) -> None:
    if args.hops < 1:
        raise EvalError(f"--hops: must be >= 1 (links in the queried chain), got {args.hops}")
    if args.chars < 1:
        raise EvalError(f"--chars: must be >= 1 (target prompt length in characters), got {args.chars}")
    problem = hash_len_problem(args.hash_len, args.hops, args.chars)
    if problem:
        raise EvalError(f"--hash-len: {problem}")


def add_data_arguments(parser) -> None:
    """``--n N --out FILE.jsonl [--hops --hash-len --chars --seed]``."""
    parser.add_argument("--n", type=int, required=True, help="number of samples")
    parser.add_argument("--out", required=True, help="JSONL file to write (one sample per line)")
    _add_sample_arguments(parser)


def validate_data(args) -> None:
    """Every check of ``rfkit data hashhop`` (raises :class:`EvalError`)."""
    if args.n < 1:
        raise EvalError(f"--n: must be >= 1 (number of samples), got {args.n}")
    _check_sample_arguments(args)
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


# --------------------------------------------------------------------------------------------
# `rfkit eval hashhop`
# --------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """``--model --original --device --json`` plus the sample and decoding options."""
    add_model_arguments(parser)
    parser.add_argument("--samples", type=int, default=None, help="number of samples (default: all of --data, else 20)")
    parser.add_argument("--data", default=None, help="JSONL samples written by `rfkit data hashhop` (default: generate them; --hops/--hash-len/--chars/--seed then do not apply)")
    _add_sample_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (left-padded)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens to generate (default: longest target completion + 25%% + 8)"
    )


def _tokenizer_for(spec: str):
    from rfkit.config.loading import base_model_name, load_tokenizer

    path = Path(spec)
    try:
        return load_tokenizer(path if path.is_dir() else None, base_model_name(spec))
    except (OSError, ValueError) as e:
        raise EvalError(f"--model: cannot load a tokenizer for '{spec}': {' '.join(str(e).split())}") from None


def validate(args) -> None:
    """Checks that load no weights: counts, the data file, the model spec, and that the longest
    prompt plus the generated tokens fit the model's context (the tokenizer is loaded for that).
    Sets ``args.hh_samples``, ``args.max_new_tokens`` and ``args.prompt_tokens``."""
    from rfkit.config.loading import (
        ModelSpecError,
        check_lengths_fit,
        max_context,
        model_config,
    )

    if args.samples is not None and args.samples < 1:
        raise EvalError(f"--samples: must be >= 1, got {args.samples}")
    if args.batch_size < 1:
        raise EvalError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if args.data is not None:
        samples = read_samples(args.data)
        if args.samples is not None:
            if args.samples > len(samples):
                raise EvalError(f"--samples: {args.data} holds only {len(samples)} samples, asked for {args.samples}")
            samples = samples[: args.samples]
        flag = "--data"
    else:
        _check_sample_arguments(args)
        kw = {"hops": args.hops, "hash_len": args.hash_len, "chars": args.chars}
        samples = generate_samples(args.samples or 20, seed=args.seed, **kw)
        flag = "--chars"
    check_model_arguments(args)
    tokenizer = _tokenizer_for(args.model)
    prompt_tokens = max(len(tokenizer(s["prompt"])["input_ids"]) for s in samples)
    if args.max_new_tokens is None:
        args.max_new_tokens = completion_budget(tokenizer, samples)
    try:
        check_lengths_fit([prompt_tokens], model_config(args.model), flag, extra=args.max_new_tokens)
    except ModelSpecError:
        limit = max_context(model_config(args.model))
        room = limit - args.max_new_tokens
        if flag == "--chars":
            where = f"a prompt of {args.chars} characters is up to {prompt_tokens} tokens"
            fix = f"use --chars up to about {max(room, 0) * args.chars // prompt_tokens}"
        else:
            where = f"the longest prompt in {args.data} is {prompt_tokens} tokens"
            fix = "write shorter samples with `rfkit data hashhop --chars`"
        raise EvalError(
            f"{flag}: {where}, plus {args.max_new_tokens} generated, beyond the model's context "
            f"(max_position_embeddings {limit}); {fix}"
        ) from None
    args.hh_samples = samples
    args.prompt_tokens = prompt_tokens


def run(args) -> int:
    """Load the model, generate, score, print one summary line and write the JSON."""
    from rfkit.config.loading import load_model

    loaded = load_model(args.model, args.original, args.torch_device)
    start = time.time()
    result = evaluate_hashhop(loaded.model, loaded.tokenizer, args.hh_samples, args.batch_size, args.max_new_tokens)
    wall = time.time() - start
    settings = {
        "data": args.data,
        "hops": sorted({len(s["chain"]) - 1 for s in args.hh_samples}),
        "hash_len": None if args.data else args.hash_len,
        "chars": None if args.data else args.chars,
        "seed": None if args.data else args.seed,
        "batch_size": args.batch_size,
        "prompt_tokens_max": args.prompt_tokens,
        "device": str(args.torch_device),
        "wall_seconds": round(wall, 2),
    }
    out = {
        "h_gq": result["h_gq"],
        "model": loaded.name,
        "base_model": loaded.base_model,
        "converted": loaded.converted,
        "original": bool(args.original),
        "notes": loaded.notes,
        "n": result["n"],
        "max_new_tokens": result["max_new_tokens"],
        **settings,
        "samples": result["samples"],
    }
    write_json(args.json_out, out)
    sys.stdout.write(f"hashhop: h_gq {result['h_gq']:.4f} over {result['n']} samples, model {loaded.name} ({wall:.1f} s)\n")
    return 0


# --------------------------------------------------------------------------------------------
# fine-tuning data
# --------------------------------------------------------------------------------------------


class _Tokenized(Dataset):
    """Pre-tokenised samples: ``(ids, prompt_len)`` pairs."""

    def __init__(self, rows: list[tuple[list[int], int]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.rows[i]


class _Collate:
    """Right-pads ``(ids, prompt_len)`` rows to the longest in the batch."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for r, (ids, prompt_len) in enumerate(rows):
            n = len(ids)
            input_ids[r, :n] = torch.tensor(ids)
            attention_mask[r, :n] = 1
            labels[r, prompt_len:n] = torch.tensor(ids[prompt_len:])
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class HashHopDataModule(TextDataModule):
    """Fine-tuning on generated HashHop samples (the paper's appendix B); calibration and
    validation stay on the parent's packed text blocks.

    * ``calibration_dataloader()``, ``val_dataloader()``, ``fingerprint()`` and the
      ``calibration``/``validation`` tensors are the parent's (Wikipedia by default): heads are
      profiled on general text, and the fit's perplexity and cache numbers stay comparable
      with the plain recipe (the head profile cache is shared with it, too).
    * ``train_dataloader()`` yields HashHop batches: ``input_ids`` = tokens(prompt) +
      tokens(completion) + EOS, ``labels`` = -100 on the prompt and the padding and the token
      ids elsewhere (the model learns to write the chain and stop), ``attention_mask``; right-
      padded to the longest sample in the batch. Shuffled with a generator seeded by ``seed``.
    * ``hashhop_val_dataloader()`` yields held-out HashHop batches in the same format, for a
      completion loss outside the fit (``val_dataloader()`` stays on text).

    Args (on top of :class:`~rfkit.data.TextDataModule`'s):
        hops: Links in each queried chain.
        hash_len: Letters per hash.
        chars: Target prompt length in characters.
        train_samples: Number of training samples (split ``train`` of the generator).
        val_samples: Number of held-out samples for ``hashhop_val_dataloader`` (split
            ``validation``).
        seed: Seed of the samples and of the training shuffle (the text split does not use it).
    """

    def __init__(
        self,
        source: str = EMBEDDED_DATA,
        tokenizer: str | None = None,
        seq_len: int = 512,
        batch_size: int = 4,
        calibration_samples: int = 64,
        val_blocks: int = 64,
        train_blocks: int | None = None,
        split: tuple[float, float] | None = None,
        text_field: str = "text",
        hf_split: str = "train",
        hf_max_documents: int | None = 50000,
        num_workers: int = 0,
        seed: int = 0,
        hops: int = 16,
        hash_len: int = 8,
        chars: int = 6144,
        train_samples: int = 512,
        val_samples: int = 32,
    ):
        # set before the parent's __init__, which calls check()
        self.hops = hops
        self.hash_len = hash_len
        self.chars = chars
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.hashhop_train: list[tuple[list[int], int]] | None = None
        self.hashhop_validation: list[tuple[list[int], int]] | None = None
        super().__init__(
            source=source,
            tokenizer=tokenizer,
            seq_len=seq_len,
            batch_size=batch_size,
            calibration_samples=calibration_samples,
            val_blocks=val_blocks,
            train_blocks=train_blocks,
            split=split,
            text_field=text_field,
            hf_split=hf_split,
            hf_max_documents=hf_max_documents,
            num_workers=num_workers,
            seed=seed,
        )

    def check(self) -> None:
        """The parent's checks plus ``data.hops``, ``data.hash_len``, ``data.chars``,
        ``data.train_samples`` and ``data.val_samples``.

        Raises:
            SourceError: one line naming the field and what is allowed.
        """
        super().check()
        for field in ("hops", "chars", "train_samples", "val_samples"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise SourceError(f"data.{field}: must be an integer >= 1, got {value!r}")
        if not _is_int(self.hash_len):
            raise SourceError(f"data.hash_len: must be an integer >= 2, got {self.hash_len!r}")
        problem = hash_len_problem(self.hash_len, self.hops, self.chars)
        if problem:
            raise SourceError(f"data.hash_len: {problem.replace('--chars', 'data.chars').replace('--hops', 'data.hops')}")

    def hashhop_settings(self) -> dict[str, Any]:
        return {
            "hops": self.hops,
            "hash_len": self.hash_len,
            "chars": self.chars,
            "train_samples": self.train_samples,
            "val_samples": self.val_samples,
            "seed": self.seed,
        }

    def _encode(self, samples: list[dict]) -> list[tuple[list[int], int]]:
        from tqdm.auto import tqdm

        tok = self.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        rows = []
        for s in tqdm(samples, desc="tokenising hashhop", unit="sample", leave=False):
            prompt = tok(s["prompt"])["input_ids"]  # as greedy_generate tokenises it
            completion = tok(s["completion"], add_special_tokens=False)["input_ids"]
            rows.append((prompt + completion + ([eos] if eos is not None else []), len(prompt)))
        return rows

    def setup(self, stage: str | None = None) -> None:
        """The parent's text blocks, then the HashHop train and validation samples (generated
        and tokenised once). Idempotent."""
        super().setup(stage)
        if self.hashhop_train is not None:
            return
        kw = {"hops": self.hops, "hash_len": self.hash_len, "chars": self.chars}
        self.hashhop_train = self._encode(generate_samples(self.train_samples, self.seed, "train", **kw))
        self.hashhop_validation = self._encode(generate_samples(self.val_samples, self.seed, "validation", **kw))
        if self.train_samples < self.batch_size:
            log.warning(
                "data: only %d HashHop training samples for batch_size %d; with drop_last the training loader is empty",
                self.train_samples, self.batch_size,
            )

    def _pad_id(self) -> int:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return 0 if pad is None else int(pad)

    def _hashhop_loader(self, rows, shuffle: bool) -> DataLoader:
        dataset = _Tokenized(rows)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self.train_sampler(dataset) if shuffle else None,
            drop_last=shuffle,
            collate_fn=_Collate(self._pad_id()),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """HashHop training batches (``input_ids``, ``attention_mask``, ``labels``), shuffled
        with a generator seeded by ``seed``; the incomplete last batch is dropped."""
        self.setup()
        return self._hashhop_loader(self.hashhop_train, shuffle=True)

    def hashhop_val_dataloader(self) -> DataLoader:
        """Held-out HashHop batches in fixed order (same format as training)."""
        self.setup()
        return self._hashhop_loader(self.hashhop_validation, shuffle=False)

    def describe(self) -> dict[str, Any]:
        """The parent's provenance plus the HashHop settings and token counts."""
        info = super().describe()
        train_tokens = [len(ids) for ids, _ in self.hashhop_train]
        info["hashhop"] = {
            **self.hashhop_settings(),
            "train_tokens": sum(train_tokens),
            "train_completion_tokens": sum(len(ids) - p for ids, p in self.hashhop_train),
            "max_sample_tokens": max(train_tokens + [len(ids) for ids, _ in self.hashhop_validation]),
        }
        return info
