"""Beam search through a converted model against one full forward along every returned beam.

    python benchmarks/beam_check.py --model DIR --json OUT [--prompt-len 300] [--new-tokens 96] [--beams 3]

The prompt is the first ``--prompt-len`` tokens of the first validation block of the embedded
Wikipedia data, tokenised with the model's tokenizer. ``generate`` runs beam search and reports
each step's log-probability along each returned beam (``compute_transition_scores``); one full
forward over that beam's sequence gives the same log-probabilities when the cache continues each
beam from its own state. The file records the largest difference, in nats, per beam and overall.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    import rfkit  # noqa: F401  (registers the converted model classes)
    from transformers import AutoModelForCausalLM

    from rfkit.atomic import atomic_write_json
    from rfkit.data import TextDataModule
    from rfkit.provenance import stamp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--beams", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    data = TextDataModule(source="embedded:wikipedia-en", tokenizer=args.model, seq_len=args.prompt_len, batch_size=1)
    data.setup("fit")
    prompt = data.validation[:1]
    with torch.no_grad():
        out = model.generate(
            prompt, num_beams=args.beams, num_return_sequences=args.beams, max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True,
            length_penalty=0.0, pad_token_id=model.generation_config.eos_token_id,
        )  # fmt: skip
        steps = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
        worst = []
        for row, seq in enumerate(out.sequences):
            new = int((out.beam_indices[row] >= 0).sum())  # tokens this beam generated
            logp = model(seq[None, : args.prompt_len + new]).logits[0].float().log_softmax(-1)
            want = logp[args.prompt_len - 1 : args.prompt_len + new - 1].gather(-1, seq[args.prompt_len : args.prompt_len + new, None])[:, 0]
            worst.append(float((steps[row, :new] - want).abs().max()))
    result = {
        "model": args.model,
        "prompt_tokens": args.prompt_len,
        "new_tokens": args.new_tokens,
        "beams": args.beams,
        "max_abs_diff_nats_per_beam": worst,
        "max_abs_diff_nats": max(worst),
        "rfkit_module": str(Path(rfkit.__file__).parent),
    }
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_path, stamp(result, started=started))
    print(f"beam search vs full forward, {args.beams} beams, {args.new_tokens} new tokens after {args.prompt_len}: "
          f"largest difference {max(worst):.3g} nats (per beam {', '.join(f'{w:.3g}' for w in worst)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
