"""Greedy decoding of a converted model with its layers that keep no head rotating inside the
compiled C step (the default) against the same layers handing the step heads rotated by the
rotary matrix (the path before): the same tokens, and how far the logits move.

    python benchmarks/rotation_agreement.py --model runs/b075_speedmodel --context 2048 \
        --tokens 64 --output benchmarks/results/decode_rotation/agreement.json

Both runs decode the same prompt (Wikipedia summaries from the embedded data, ``--context``
tokens) in one process; every step's logits are compared.
"""

from __future__ import annotations

import argparse
import time

import torch


@torch.no_grad()
def greedy(model, ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` greedy steps after a prefill of ``ids``: the tokens and every step's logits."""
    from rfkit.models.cache import cache_kwargs, output_cache

    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, logits, chosen = output_cache(out), [out.logits[:, -1]], []
    for _ in range(tokens):
        chosen.append(logits[-1].argmax(-1, keepdim=True))
        out = model(input_ids=chosen[-1], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1])
    return torch.cat(chosen, 1), torch.stack(logits, 1)


def agreement(model, ids: torch.Tensor, tokens: int) -> dict:
    """Decode ``ids`` greedily for ``tokens`` steps twice, the layers without kept heads rotating
    in the step and then through the rotary matrix; what differs (logits compared while the two
    token sequences agree). The layers are left as they were."""
    from rfkit.models.modeling import RecurFormerAttention

    layers = [m for m in model.modules() if isinstance(m, RecurFormerAttention)]
    rotating = [m for m in layers if m._mixer_rotates]
    runs = {}
    try:
        for name, rotate in (("in_step", True), ("matrix", False)):
            for m in rotating:
                m._mixer_rotates = rotate
            runs[name] = greedy(model, ids, tokens)
    finally:
        for m in rotating:
            m._mixer_rotates = True
    (tokens_a, logits_a), (tokens_b, logits_b) = runs["in_step"], runs["matrix"]
    same = (tokens_a == tokens_b).all(0)
    first_diff = None if bool(same.all()) else int((~same).nonzero()[0, 0])
    steps = tokens + 1 if first_diff is None else first_diff + 1
    diff = (logits_a[:, :steps] - logits_b[:, :steps]).abs()
    return {
        "context": int(ids.shape[1]),
        "tokens": tokens,
        "layers_rotating_in_step": len(rotating),
        "converted_layers": len(layers),
        "tokens_identical": first_diff is None,
        "first_different_token": first_diff,
        "max_abs_logit_difference": float(diff.max()),
        "max_logit": float(logits_b[:, :steps].abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a converted model directory")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args()

    from rfkit.atomic import atomic_write_json
    from rfkit.config.loading import ModelSpec
    from rfkit.data.sources import load_documents
    from rfkit.provenance import stamp

    started = time.time()
    spec = ModelSpec(args.model, require_converted=True)
    model = spec.converted("cpu").eval()  # the converted model only: the original is not compared
    tokenizer = spec.tokenizer()
    texts = []
    for doc in load_documents():  # enough documents for the prompt (a token is under 8 characters)
        texts.append(doc.text)
        if sum(map(len, texts)) > 8 * args.context:
            break
    text = "\n\n".join(texts)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.context]
    result = {"kind": "rotation_agreement", "model": args.model, **agreement(model, ids, args.tokens)}
    command = f"python benchmarks/rotation_agreement.py --model {args.model} --context {args.context} --tokens {args.tokens} --output {args.output}"
    atomic_write_json(args.output, stamp(result, started, command))
    print(result)


if __name__ == "__main__":
    main()
