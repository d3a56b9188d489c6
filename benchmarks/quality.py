"""Quality benchmark: how close each conversion method gets to the original in the same CPU time.

    python benchmarks/quality.py [--config recipes/smollm2_mamba_b05.yaml] [--betas 0.25,0.5,0.75]
        [--methods baseline,transfer,transfer_kd,transfer_kd_lora] [--budget 180]
        [--val-blocks 16] [--output benchmarks/results/quality_smollm2]

The recipe's base model is profiled once (or the cached profile reused) and measured once on the
validation blocks. Then, for every beta and method, a fresh copy is converted from the same
profile and trained for the same wall-clock budget (``--budget`` seconds: capture, read-out and
training all count; perplexity evaluation does not):

- ``baseline``: the paper's recipe, random initialisation of the new blocks (output projection
  included) and next-token cross-entropy on the new blocks for the whole budget;
- ``transfer``: attention transfer for the whole budget, no end-to-end training;
- ``transfer_kd``: transfer for half the budget, then end-to-end distillation (CE + KL to the
  original, the teacher sharing modules) of the new blocks for the rest;
- ``transfer_kd_lora``: as ``transfer_kd``, with LoRA adapters (r 8) on the kept projections
  trained along with the new blocks, merged at the end;
- ``fa_transfer`` (not in the default list): ``init: from_attention``, then transfer only.

Writes ``quality.json`` and ``quality.md`` (PPL ratio, training tokens, seconds, parameters
added and removed) into the output directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

METHODS = ("baseline", "transfer", "transfer_kd", "transfer_kd_lora", "fa_transfer")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="recipes/smollm2_mamba_b05.yaml")
    p.add_argument("--betas", default="0.25,0.5,0.75")
    p.add_argument("--methods", default=",".join(METHODS[:4]))
    p.add_argument("--space", default="heads", choices=("heads", "output"), help="transfer loss space")
    p.add_argument("--budget", type=float, default=180.0, help="seconds of training per method and beta")
    p.add_argument("--val-blocks", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="end-to-end learning rate of the new blocks")
    p.add_argument("--lora-lr", type=float, default=5e-4)
    p.add_argument("--output", default="benchmarks/results/quality_smollm2")
    args = p.parse_args(argv)
    args.beta_list = [float(b) for b in args.betas.split(",")]
    args.method_list = args.methods.split(",")
    bad = [m for m in args.method_list if m not in METHODS]
    if bad or not all(0 < b <= 1 for b in args.beta_list) or args.budget <= 0:
        p.error(f"--methods must be from {', '.join(METHODS)}; --betas in (0, 1]; --budget > 0")
    return args


def end_to_end(model, train_blocks, batch_size, deadline, distill, lr, lora_lr, seed=0) -> int:
    """Train the new blocks (and LoRA adapters, if any) until ``deadline``; returns tokens seen."""
    from rfkit.training.distill import training_loss
    from rfkit.training.freeze import apply_freeze
    from rfkit.training.teacher import SharedTeacher

    apply_freeze(model, "pretrained")
    groups = [{"params": [p for n, p in model.named_parameters() if ".mixer." in n], "lr": lr}]
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    if adapters:
        groups.append({"params": adapters, "lr": lora_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    teacher = SharedTeacher(model) if distill is not None and distill.needs_teacher else None
    generator = torch.Generator().manual_seed(seed)
    model.train()
    tokens = 0
    while time.time() < deadline:
        rows = torch.randint(0, len(train_blocks), (batch_size,), generator=generator)
        batch = {"input_ids": train_blocks[rows]}
        loss, _ = training_loss(model, batch, distill, teacher)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens += batch["input_ids"].numel()
    model.eval()
    return tokens


def run_method(method, base, head_map, operator, datamodule, budget, args) -> dict:
    from rfkit.conversion.convert import convert, param_counts, parameter_delta
    from rfkit.models.lora import LoraSettings, apply_lora, merge_lora
    from rfkit.training.distill import DistillConfig
    from rfkit.training.transfer import TransferConfig, transfer

    if method == "baseline":
        operator = copy.copy(operator)
        operator.zero_init_output = False  # the paper's plain random initialisation
    model = copy.deepcopy(base)
    before = param_counts(model)
    model = convert(model, head_map, operator)
    added, removed = parameter_delta(before, model)
    started = time.time()
    deadline = started + budget
    row = {"method": method, "params_added": added, "params_removed": removed, "train_tokens": 0}
    if method == "fa_transfer":
        from rfkit.training.freeze import init_from_attention

        init_from_attention(model, operator)
    if method != "baseline":
        share = 0.5 if "kd" in method else 1.0
        config = TransferConfig(
            steps=100_000, samples=32, batch_size=8, seq_len=128, space=args.space, time_limit=budget * share
        )
        report = transfer(model, datamodule.calibration, config)
        row.update(
            transfer_mse_before=report["mean_mse_before"],
            transfer_mse_after=report["mean_mse_after"],
            transfer_steps=report["steps_run"],
            transfer_tokens=report["tokens_captured"],
        )
    if method in ("baseline", "transfer_kd", "transfer_kd_lora"):
        distill = None if method == "baseline" else DistillConfig(ce=1.0, kl=1.0)
        if method == "transfer_kd_lora":
            apply_lora(model, LoraSettings(r=8))
        row["train_tokens"] = end_to_end(
            model, datamodule.train, datamodule.batch_size, deadline, distill, args.lr, args.lora_lr
        )
        merge_lora(model)
    row["seconds"] = round(time.time() - started, 1)
    return row, model


def markdown(result: dict) -> str:
    lines = [
        f"Budget {result['budget_seconds']:.0f} s per method (wall clock, {result['threads']} threads), "
        f"{result['val_blocks']} validation blocks of {result['seq_len']} tokens; original PPL {result['ppl_original']:.3f}.",
        "",
        "| beta | method | PPL | PPL ratio | transfer rel. MSE (before -> after) | train tokens (e2e) | seconds | params +/- |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        mse = (
            f"{r['transfer_mse_before']:.3f} -> {r['transfer_mse_after']:.3f} ({r['transfer_steps']} steps)"
            if "transfer_mse_after" in r
            else "-"
        )
        lines.append(
            f"| {r['beta']:g} | {r['method']} | {r['ppl']:.2f} | {r['ppl_ratio']:.3f} | {mse} | "
            f"{r['train_tokens']:,} | {r['seconds']:.0f} | +{r['params_added']:,} / -{r['params_removed']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    run_started = time.time()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from rfkit.atomic import atomic_write_json, atomic_write_text
    from rfkit.config.loading import parse_recipe
    from rfkit.conversion.convert import load_base_model, profile_for
    from rfkit.conversion.headmap import HeadMap
    from rfkit.evals.perplexity import evaluate_perplexity
    from rfkit.models.layout import AttentionLayout

    torch.manual_seed(0)
    module, datamodule = parse_recipe(args.config, [])
    base = load_base_model(module.base_model, module.dtype_name, module.trust_remote_code)
    profile, data_info = profile_for(base, module.base_model, module.policy, datamodule, module.reuse_profile)
    layout = AttentionLayout.from_config(base.config)
    datamodule.setup("fit")
    val = datamodule.validation[: args.val_blocks]
    batches = [{"input_ids": val[i : i + datamodule.batch_size]} for i in range(0, len(val), datamodule.batch_size)]
    base.eval()
    ppl_original = evaluate_perplexity(base, batches, desc="perplexity (original)")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "recipe": args.config,
        "budget_seconds": args.budget,
        "threads": torch.get_num_threads(),
        "val_blocks": int(val.shape[0]),
        "seq_len": int(val.shape[1]),
        "ppl_original": ppl_original,
        "rows": [],
    }
    for beta in args.beta_list:
        policy = copy.copy(module.policy)
        policy.beta = beta
        head_map = HeadMap.build(module.base_model, layout, profile, policy.select(layout, profile), policy, data_info)
        for method in args.method_list:
            torch.manual_seed(0)
            row, model = run_method(method, base, head_map, module.operator, datamodule, args.budget, args)
            row["ppl"] = evaluate_perplexity(model, batches, desc=f"perplexity ({method}, beta {beta:g})")
            row.update(beta=beta, ppl_ratio=row["ppl"] / ppl_original, replaced_heads=head_map.replaced_heads)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            del model
            from rfkit.provenance import stamp

            stamp(result, run_started, result["command"], replace=True)
            atomic_write_json(out / "quality.json", result)  # partial results survive an interrupted run
            atomic_write_text(out / "quality.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
