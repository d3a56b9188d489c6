"""Do the window mixers' three inference paths give the same text on a real converted model?

    python benchmarks/paths_agree.py --model runs/smollm2_b05/lightning_logs/version_0/model
        [--lengths 300,1200] [--new-tokens 32] [--output FILE.json]

Greedy ``generate`` from prompts of Wikipedia text (the last 400 summaries of the embedded data,
joined) through: the general rank-masked path (``WindowAttention.fast = False``), the PyTorch
step and tiled prefill (``use_kernel = False``) and the compiled CPU kernels (the default).
Reports whether the generated tokens are identical and the largest difference of the prompt's
last-position logits between each path and the general one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    run_started = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="300,1200")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rfkit  # noqa: F401  (registers the converted classes)
    from rfkit.atomic import atomic_write_json
    from rfkit.data.sources import load_documents
    from rfkit.models.window import WindowAttention

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    text = "\n\n".join(doc.text for doc in load_documents("embedded:wikipedia-en")[-400:])
    ids = tok(text, return_tensors="pt").input_ids
    paths = {"general": dict(fast=False, use_kernel=False), "pytorch": dict(fast=True, use_kernel=False),
             "compiled": dict(fast=True, use_kernel=True)}  # fmt: skip
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = ids[:, :length]
        row = {"prompt_tokens": length}
        tokens, logits = {}, {}
        for name, flags in paths.items():
            for key, value in flags.items():
                setattr(WindowAttention, key, value)
            with torch.no_grad():
                logits[name] = model(prompt).logits[0, -1]
                out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            tokens[name] = out[0, length:].tolist()
        row["identical_tokens"] = all(t == tokens["general"] for t in tokens.values())
        row["max_logit_diff"] = {name: float((logits[name] - logits["general"]).abs().max()) for name in paths}
        row["text"] = tok.decode(tokens["compiled"])
        rows.append(row)
    WindowAttention.fast, WindowAttention.use_kernel = True, True
    result = {"model": args.model, "new_tokens": args.new_tokens, "rows": rows,
              "command": "python benchmarks/paths_agree.py " + " ".join(argv if argv is not None else sys.argv[1:])}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.output:
        from rfkit.provenance import stamp

        stamp(result, run_started, result["command"])
        atomic_write_json(args.output, result)
    return 0 if all(r["identical_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
