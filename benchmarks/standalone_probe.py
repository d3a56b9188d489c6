"""What a colleague without rfkit gets from a saved model folder: run in a process where ``import rfkit``
fails (``standalone_check.py`` blocks it), with torch, transformers and safetensors only.

    python standalone_probe.py JOB.json

``JOB.json``: ``{"out": "result.json", "folders": [{"path": DIR, "inputs": "inputs.pt", "tag": "x"}]}``;
``inputs.pt`` holds ``ids`` (token ids for logits and generation), optionally ``blocks`` and
``batch_size`` (validation blocks for a perplexity) and ``prompt`` (text for a pipeline). For each
folder it writes ``<tag>.pt`` beside the result (logits; greedy, beam and sampled generations) and
records the classes transformers built, the pipeline's text and the perplexity.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def perplexity(model, blocks: torch.Tensor, batch_size: int) -> float:
    """exp(summed next-token NLL / tokens): float32 log-softmax, float64 sums (rfkit's metric)."""
    nll, tokens = torch.tensor(0.0, dtype=torch.float64), 0
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start : start + batch_size]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        targets = ids[:, 1:]
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").double()
        tokens += targets.numel()
    return float(torch.exp(nll / tokens))


def outputs(model, ids: torch.Tensor) -> dict:
    """What the checks compare, however the model was loaded: logits, and greedy, beam-search and
    sampled (seeded) generations."""
    with torch.no_grad():
        found = {"logits": model(ids).logits}
        found["greedy"] = model.generate(ids, max_new_tokens=12, do_sample=False)
        found["beams"] = model.generate(ids[:1], max_new_tokens=12, num_beams=3, do_sample=False)
        torch.manual_seed(0)
        found["sampled"] = model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20)
    return found


def probe(folder: dict, out_dir: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline

    path = folder["path"]
    inputs = torch.load(folder["inputs"])
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    model.generation_config.eos_token_id = None  # random tiny models may pick eos: keep going
    model.generation_config.pad_token_id = 0
    ids = inputs["ids"]
    found = {"config_class": type(config).__name__, "model_class": type(model).__name__, "model_module": type(model).__module__}
    tensors = outputs(model, ids)
    with torch.no_grad():
        if "blocks" in inputs:
            found["perplexity"] = perplexity(model, inputs["blocks"], int(inputs["batch_size"]))
    torch.save(tensors, out_dir / f"{folder['tag']}.pt")
    if "prompt" in inputs:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        found["pipeline"] = generator(inputs["prompt"], max_new_tokens=8, do_sample=False)[0]["generated_text"]
        found["pipeline_by_path"] = pipeline("text-generation", model=path, trust_remote_code=True)(
            inputs["prompt"], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0]["generated_text"]
    return found


def main(job_path: str) -> int:
    try:
        import rfkit  # noqa: F401
    except ImportError as err:
        blocked = str(err)
    else:
        raise SystemExit("rfkit imported: this probe must run where rfkit cannot be imported")
    job = json.loads(Path(job_path).read_text())
    out = Path(job["out"])
    result = {"rfkit_import_error": blocked, "folders": {}}
    for folder in job["folders"]:
        result["folders"][folder["tag"]] = probe(folder, out.parent)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
