"""Perplexity on the held-out (validation) documents, as packed blocks or per-document sliding windows.

    rfkit eval ppl --model DIR|RECIPE [--original] [--source embedded:wikipedia-en]
                   [--mode blocks|sliding] [--block-size 512] [--stride 256]
                   [--max-documents N] [--min-tokens N] [--val-blocks N] [--split CAL VAL]
                   [--json OUT]

The held-out documents are the validation split of ``rfkit.data``: documents are assigned to
calibration / validation / train by a hash of their title (``data.split`` fractions), so the
same documents are held out whatever the model.

``--mode blocks`` evaluates the packed validation blocks exactly as training validation does
(``TextDataModule.val_dataloader()`` through ``rfkit.evals.perplexity.evaluate_perplexity``: the
validation documents joined with EOS and cut into blocks of ``--block-size`` tokens, the first
``--val-blocks`` of them), so the number agrees with ``ppl_original`` / ``ppl_converted`` in the
summary of ``rfkit fit`` for the same data settings.

``--mode sliding`` evaluates each validation document on its own (documents are never joined):
a window of ``--block-size`` tokens moves by ``--stride`` tokens; every token but the
document's first is scored exactly once, and after the first window each token has at least
``block_size - stride`` tokens of preceding context. A document that fits in one window is a
single forward pass. Documents with fewer than ``--min-tokens`` tokens are skipped.

Data settings not given on the command line (``--source``, ``--block-size``, ``--val-blocks``,
``--split``, and the text field) come from the recipe's ``data`` section, or from the ``data``
record of a converted directory's ``head_map.json``, else the ``TextDataModule`` defaults
(``embedded:wikipedia-en``, 512 tokens, 64 validation blocks, the source's default split:
0.05/0.05).

Long documents: ``--source embedded:shakespeare`` (39 works of Shakespeare, 23,000 to 55,000
tokens each) has a default split of its own, 0.10/0.15, which holds out 6 works (about 230,000
tokens). When ``--source`` switches to it from the recipe's or head map's source, the recorded
split and validation block count (chosen for that other source) are replaced by its defaults:
split 0.10/0.15 and 64 blocks, unless ``--split`` / ``--val-blocks`` are given. So
``rfkit eval ppl --model DIR --source embedded:shakespeare --block-size 2048`` scores 64 blocks
from 4 of the held-out works, and ``--block-size 8192`` all 28 blocks of the 6 works.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from pathlib import Path

import torch

from rfkit.evals.common import (
    EvalError,
    add_model_arguments,
    add_to_card,
    check_model_arguments,
    model_spec,
    positive_int,
    write_json,
)

MODES = ("blocks", "sliding")


# ----------------------------------------------------------------------------- the metric
@torch.no_grad()
def sliding_window_nll(model, ids, block_size: int, stride: int) -> tuple[float, int]:
    """Summed next-token NLL of one token sequence with a strided sliding window.

    Windows start at ``0, stride, 2*stride, ...`` and hold up to ``block_size`` tokens; each
    window scores only the tokens after the previous window's end, so every token is scored
    once. The first window scores all its tokens except the first (it has no context). With
    ``stride == block_size`` this is plain blockwise evaluation: each block loses its first
    token. Returns ``(nll_sum, scored_tokens)``; the sum is accumulated in float64.
    """
    from rfkit.training.losses import summed_nll

    if not 0 < stride <= block_size:
        raise ValueError(f"stride must be in [1, block_size], got stride {stride}, block_size {block_size}")
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    length = ids.numel()
    total, count = 0.0, 0
    scored_until = 0  # tokens [0, scored_until) are already scored (or are the first token)
    for begin in range(0, max(length - 1, 0), stride):
        end = min(begin + block_size, length)
        window = ids[begin:end].unsqueeze(0).to(device)
        labels = window.clone()
        labels[:, : scored_until - begin] = -100  # context only, scored by an earlier window
        nll, n = summed_nll(model(input_ids=window, use_cache=False).logits, window, labels)
        total += float(nll.double())
        count += n
        scored_until = end
        if end == length:
            break
    return total, count


# ----------------------------------------------------------------------------- data settings
def data_settings(args) -> dict:
    """Source, tokenizer, block size, validation blocks, split and text field to evaluate with:
    the flags, else the recipe's / head map's data settings, else the TextDataModule defaults."""
    from rfkit.data import DEFAULT_SPLIT, TextDataModule, default_split, source_kind
    from rfkit.hub import is_embedded, looks_like_path

    defaults = {
        name: p.default
        for name, p in inspect.signature(TextDataModule.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    found: dict = {}
    spec = model_spec(args)
    path = spec.path
    if spec.kind == "recipe":
        _, datamodule = spec.recipe
        found = {
            "source": datamodule.source,
            "tokenizer": datamodule.tokenizer_name,
            "seq_len": datamodule.seq_len,
            "val_blocks": datamodule.val_blocks,
            "split": list(datamodule.split),
            "text_field": datamodule.text_field,
            "hf_split": datamodule.hf_split,
            "hf_max_documents": datamodule.hf_max_documents,
        }
    elif spec.head_map is not None:
        head_map = spec.head_map
        recorded = dict(head_map.data or {})
        found = {k: recorded[k] for k in ("source", "seq_len", "split") if recorded.get(k) is not None}
        if isinstance(recorded.get("blocks"), dict) and recorded["blocks"].get("validation"):
            found["val_blocks"] = recorded["blocks"]["validation"]
        if recorded.get("text_field") and source_kind(str(found.get("source", ""))) != "embedded":
            found["text_field"] = recorded["text_field"]  # describe() reports "extract" for embedded data
        # the tokenizer name the run used (same blocks cache), else the one saved with the model
        tokenizer = recorded.get("tokenizer") or head_map.model
        if not is_embedded(tokenizer) and looks_like_path(tokenizer) and not Path(tokenizer).exists():
            tokenizer = str(path) if (path / "tokenizer_config.json").exists() else head_map.model
        found["tokenizer"] = tokenizer
    else:
        found = {"tokenizer": str(path)}
    settings = {
        "source": defaults["source"],
        "seq_len": defaults["seq_len"],
        "val_blocks": defaults["val_blocks"],
        "split": None,  # the source's default, below
        "text_field": defaults["text_field"],
        "hf_split": defaults["hf_split"],
        "hf_max_documents": defaults["hf_max_documents"],
    }
    settings.update(found)
    if args.source is not None and args.source != settings["source"]:
        settings["source"] = args.source
        if default_split(args.source) != DEFAULT_SPLIT:
            # long documents: the recorded split and block count were chosen for the recorded source
            settings.update(split=None, val_blocks=defaults["val_blocks"])
    if settings["split"] is None:
        settings["split"] = list(default_split(settings["source"]))
    if args.split is not None:
        settings["split"] = list(args.split)
    if args.block_size is not None:
        settings["seq_len"] = args.block_size
    if args.val_blocks is not None:
        settings["val_blocks"] = args.val_blocks
    return settings


def make_datamodule(settings: dict, batch_size: int):
    """The TextDataModule whose validation split is evaluated (its checks raise SourceError)."""
    from rfkit.data import TextDataModule

    return TextDataModule(
        source=settings["source"],
        tokenizer=settings["tokenizer"],
        seq_len=settings["seq_len"],
        batch_size=batch_size,
        val_blocks=settings["val_blocks"],
        split=tuple(settings["split"]),
        text_field=settings["text_field"],
        hf_split=settings["hf_split"],
        hf_max_documents=settings["hf_max_documents"],
    )


# ----------------------------------------------------------------------------- evaluations
def evaluate_blocks(model, datamodule) -> dict:
    """Perplexity over the packed validation blocks, as ``rfkit fit`` measures it."""
    from rfkit.evals.perplexity import evaluate_perplexity

    loader = datamodule.val_dataloader()
    ppl = evaluate_perplexity(model, loader, desc="perplexity (blocks)")
    blocks = int(datamodule.validation.shape[0])
    return {
        "ppl": ppl,
        "tokens": blocks * (datamodule.seq_len - 1),
        "blocks": blocks,
        "documents": int(datamodule.describe()["documents"]["validation"]),
    }


def evaluate_sliding(
    model, tokenizer, texts: list[str], block_size: int, stride: int, min_tokens: int = 2, progress: bool = True
) -> dict:
    """Per-document sliding-window perplexity over ``texts`` (see :func:`sliding_window_nll`)."""
    from tqdm.auto import tqdm

    nll, tokens, documents, slid, skipped = 0.0, 0, 0, 0, 0
    for text in tqdm(texts, desc="perplexity (sliding)", unit="doc", disable=not progress):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < max(min_tokens, 2):
            skipped += 1
            continue
        doc_nll, doc_tokens = sliding_window_nll(model, ids, block_size, stride)
        nll += doc_nll
        tokens += doc_tokens
        documents += 1
        slid += len(ids) > block_size
    if tokens == 0:
        raise EvalError(
            f"--min-tokens: no held-out document has at least {max(min_tokens, 2)} tokens ({skipped} skipped); "
            "lower --min-tokens or use another --source"
        )
    return {
        "ppl": math.exp(nll / tokens),
        "nll_sum": nll,
        "tokens": tokens,
        "documents": documents,
        "documents_longer_than_window": slid,
        "documents_skipped": skipped,
    }


def heldout_texts(settings: dict, max_documents: int | None) -> list[str]:
    """The validation documents' texts, in split order, at most ``max_documents``."""
    from rfkit.data import load_documents, split_documents

    docs = load_documents(settings["source"], settings["text_field"], settings["hf_split"], settings["hf_max_documents"])
    held_out = split_documents(docs, settings["split"])["validation"]
    if not held_out:
        raise EvalError(f"--source: '{settings['source']}' has no validation documents; give a larger corpus")
    return [doc.text for doc in held_out[:max_documents]]


# ----------------------------------------------------------------------------- command
def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--source", default=None, help="text source (default: the recipe's / head map's data source, else embedded:wikipedia-en)"
    )
    parser.add_argument("--mode", choices=MODES, default="blocks", help="packed validation blocks, or per-document sliding windows")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per block / window (default: the data's seq_len, else 512)")
    parser.add_argument("--stride", type=int, default=256, help="sliding mode: tokens the window moves by (<= block size)")
    parser.add_argument("--max-documents", type=int, default=None, help="sliding mode: evaluate at most this many held-out documents")
    parser.add_argument("--min-tokens", type=int, default=2, help="sliding mode: skip documents with fewer tokens")
    parser.add_argument("--val-blocks", type=int, default=None, help="blocks mode: validation blocks (default: the data's val_blocks, else 64)")
    parser.add_argument(
        "--split", type=float, nargs=2, metavar=("CAL", "VAL"), default=None,
        help="calibration and validation fractions of the documents (default: the data's split, else the source's default)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=4, help="blocks mode: blocks per forward")


def validate(args) -> None:
    """Flag checks, then the model checks (no weights) and the data settings."""
    for name in ("block_size", "val_blocks", "max_documents"):
        if getattr(args, name) is not None:
            positive_int(args, name, minimum=2 if name == "block_size" else 1)
    positive_int(args, "stride")
    positive_int(args, "min_tokens", minimum=0)
    positive_int(args, "batch_size")
    if args.split is not None and not (all(0 < x < 1 for x in args.split) and sum(args.split) < 1):
        raise EvalError(f"--split: fractions must each be > 0 and sum to < 1 (the rest is train), got {args.split}")
    if args.block_size is not None and args.stride > args.block_size and args.mode == "sliding":
        raise EvalError(f"--stride: must be <= --block-size ({args.block_size}), got {args.stride}")
    check_model_arguments(args)
    args.settings = data_settings(args)
    block = args.settings["seq_len"]
    if args.mode == "sliding" and args.stride > block:
        raise EvalError(f"--stride: must be <= the block size ({block}), got {args.stride}")
    from rfkit.config.loading import check_lengths_fit

    check_lengths_fit([block], args.model_spec.config(), "--block-size")
    args.datamodule = make_datamodule(args.settings, args.batch_size)  # checks the source and fields


def run(args) -> int:
    from rfkit.config.loading import load_model

    loaded = load_model(args.model_spec, args.original, args.torch_device)
    args.model_spec.share(args.datamodule)  # its tokenizer is the base model's: resolved once
    start = time.perf_counter()
    settings = dict(args.settings)
    if args.mode == "blocks":
        result = evaluate_blocks(loaded.model, args.datamodule)
        settings.update(batch_size=args.batch_size)
    else:
        texts = heldout_texts(settings, args.max_documents)
        result = evaluate_sliding(
            loaded.model, loaded.tokenizer, texts, settings["seq_len"], args.stride, args.min_tokens
        )
        settings.update(stride=args.stride, max_documents=args.max_documents, min_tokens=args.min_tokens)
    settings = {"block_size": settings.pop("seq_len"), **settings}
    if args.mode == "sliding":
        settings.pop("val_blocks")
    result = {
        "task": "ppl",
        "model": loaded.name,
        "base_model": loaded.base_model,
        "converted": loaded.converted,
        "notes": loaded.notes,
        "mode": args.mode,
        **result,
        "settings": settings,
        "device": str(args.torch_device),
        "wall_seconds": round(time.perf_counter() - start, 2),
    }
    extra = f", {result['blocks']} blocks" if args.mode == "blocks" else ""
    print(
        f"perplexity ({args.mode}) of {loaded.name}: {result['ppl']:.4f} over {result['tokens']} tokens, "
        f"{result['documents']} documents{extra}"
    )
    write_json(args.json_out, result, getattr(args, "command_line", None))
    shown = {k: v for k, v in settings.items() if k not in ("batch_size", "text_field", "hf_split", "hf_max_documents")}
    what = f"{result['blocks']} blocks" if args.mode == "blocks" else f"stride {args.stride}"
    add_to_card(
        args, "ppl " + json.dumps({"mode": args.mode, **shown}, sort_keys=True, default=str),
        f"Perplexity, {settings['source']}, {args.mode} of {settings['block_size']:,} tokens ({what})",
        {"perplexity": result["ppl"]}, {"perplexity": ".3f"},
    )  # fmt: skip
    return 0
