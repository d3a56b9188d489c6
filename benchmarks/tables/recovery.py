"""Recovery at high beta: what each training lever buys at beta 0.75, the state-off ablation at
every beta, and the Mamba block started from the attention it replaces against the paper's random
start. One sweep (``levers_smollm2/sweep.json``) measures every trained model on the same blocks;
each fit's own summary gives its Wikipedia blocks' perplexity and wall time.
Used by docs/comparing.md and docs/mamba_recipe.md."""

from __future__ import annotations

import re

from . import load, table
from .front import passkey_cells
from .trained import short

SWEEP = "levers_smollm2/sweep.json"
B09_SWEEP = "trained_smollm2_b09/sweep.json"  # the beta 0.9 fit, on the same blocks (same sweep arguments)
LENGTHS = ("2048", "8192")

# (run directory under runs/, what differs from smollm2_b075, the fit's summary, its passkey result)
LEVERS = (
    ("smollm2_b075_sl", "none: `recipes/smollm2_b075.yaml` as first shipped (decay horizon 128, 2,048-token blocks, 48 steps, no LoRA)", "fit_smollm2_b075_sl/summary.json", "passkey_smollm2_b075_sl.json"),
    ("lever_b075_decay1024", "decay horizon 1,024 tokens (`--model.operator.init_args.decay_horizon 1024`)", "levers_smollm2/fit_decay1024.json", "levers_smollm2/passkey_decay1024.json"),
    ("lever_b075_lora", "LoRA r 8 on the kept projections (`--model.lora.r 8 --model.lora.alpha 8`)", "levers_smollm2/fit_lora.json", "levers_smollm2/passkey_lora.json"),
    ("lever_b075_long4096", "4,096-token long blocks (`--data.long_seq_len 4096 --model.transfer.long_seq_len 4096`)", "levers_smollm2/fit_long4096.json", "levers_smollm2/passkey_long4096.json"),
    ("lever_b075_state32", "twice the state, a shorter window, the same bytes (`--model.operator.init_args.feature_dim 32 --model.operator.init_args.window 40`)", "levers_smollm2_state32/fit_state32.json", "levers_smollm2_state32/passkey_state32.json"),
)
# a lever fitted after the main sweep, scored by its own sweep with the same arguments (the same blocks)
LATER = {"lever_b075_state32": "levers_smollm2_state32/sweep.json"}
PASSKEY_ORIGINAL = "passkey_smollm2_b075_original.json"  # the same keys, the model before conversion
# (run directory, beta label) of the state-off table; beta 0.9 comes from B09_SWEEP
STATE_OFF = (("smollm2_b05", "0.5, `smollm2_b05` (make demo)"), ("smollm2_b075_sl", "0.75, `smollm2_b075` as first shipped"))
B09_RUN = ("smollm2_b09_sl", "0.9, `smollm2_b075` at beta 0.9")

# the Mamba rows: (run directory, label, fit summary). The new rows' perplexity and state-off rows
# come from one sweep on the recipe's own 32 validation blocks (the blocks every fit here scores);
# the paper's row is its fit's own score on those blocks
MAMBA_SWEEP = "mamba_attn_smollm2/sweep.json"
MAMBA = (
    ("smollm2_mamba_b05", "the paper's Mamba block, random start (`recipes/smollm2_mamba_b05.yaml`)", "trained_smollm2/mamba_b05/summary.json"),
    ("mamba_attn_b05", "S6 started from attention, no window, learned skip: `hybrid_mamba(sink=0, window=1, state_dim=38, window_gain=true)`", "mamba_attn_smollm2/fit_mamba_attn.json"),
    ("mamba_attn_win_b05", "S6 started from attention, exact sink 4 + window 8: `hybrid_mamba(sink=4, window=8, state_dim=16)`", "mamba_attn_smollm2/fit_mamba_attn_win.json"),
)


def _run_rows(sweep: dict, run: str, name: str = SWEEP) -> tuple[dict, dict]:
    """The trained row of the model under ``runs/<run>/`` and its state-off row."""
    rows = [r for r in sweep["rows"] if r.get("trained") and f"runs/{run}/" in r.get("model", "")]
    on = [r for r in rows if not r["operator"].endswith("state off")]
    off = [r for r in rows if r["operator"].endswith("state off")]
    if len(on) != 1 or len(off) > 1:
        raise KeyError(f"{name}: expected one trained row of runs/{run}/, found {len(on)}")
    return on[0], (off[0] if off else {})


def _lengths(row: dict) -> str:
    return " / ".join(_cells(_ratios(row)[1:])) if row else "-"


def _minutes(fit: dict) -> str:
    return f"{fit['wall_seconds'] / 60:.1f} min"


@table("recovery_levers_b075")
def recovery_levers_b075() -> str:
    sweep = load(SWEEP)
    free = next(r for r in sweep["rows"] if not r.get("trained"))
    lines = [
        "| lever (beta 0.75, measured-loss ranking, bf16) | Wikipedia 512 | long documents 2,048 / 8,192 | state off, 2,048 / 8,192 | passkey 1,024 / 2,048 / 4,096 | fit |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run, label, fit_file, passkey in LEVERS:
        on, off = _run_rows(load(LATER[run]), run, LATER[run]) if run in LATER else _run_rows(sweep, run)
        keys = passkey_cells(load(passkey))
        lines.append(f"| {label} | {on['ppl_ratio']:.3f} | {_lengths(on)} | {_lengths(off)} | {keys} | {_minutes(load(fit_file))} |")
    name = short(free["operator"])
    lines.append(f"| training-free {name}, the same heads, the same bytes | {free['ppl_ratio']:.3f} | {_lengths(free)} | - | - | none |")
    lines.append(f"| the original | 1.000 | 1.000 / 1.000 | - | {passkey_cells(load(PASSKEY_ORIGINAL))} | - |")
    return "\n".join(lines)


@table("recovery_state_off")
def recovery_state_off() -> str:
    sweep, b09 = load(SWEEP), load(B09_SWEEP)
    lines = [
        "| beta, recipe | Wikipedia 512, state on / off | long documents 2,048, on / off | 8,192, on / off |",
        "|---|---:|---:|---:|",
    ]
    for source, (run, label) in [(sweep, s) for s in STATE_OFF] + [(b09, B09_RUN)]:
        on, off = _run_rows(source, run, B09_SWEEP if source is b09 else SWEEP)
        cells = [f"{on['ppl_ratio']:.3f} / {off['ppl_ratio']:.3f}"]
        cells += [f"{on['long_ppl_ratio'][f'shakespeare@{n}']:.3f} / {off['long_ppl_ratio'][f'shakespeare@{n}']:.3f}" for n in LENGTHS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@table("mamba_from_attention")
def mamba_from_attention() -> str:
    sweep = load(MAMBA_SWEEP)
    lines = [
        "| beta 0.5, float32, the Mamba recipe's training | Wikipedia 512 | the same, state off | constant bytes per replaced KV group | transfer, relative MSE after | fit |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run, label, fit_file in MAMBA:
        fit = load(fit_file)
        groups = fit["replaced_heads"] // 3  # SmolLM2: 3 query heads per KV group
        state = fit["cache_state_bytes_converted"] / groups
        if any(f"runs/{run}/" in r.get("model", "") for r in sweep["rows"]):
            on, off = _run_rows(sweep, run, MAMBA_SWEEP)
            ratio, off_ratio = f"{on['ppl_ratio']:.3f}", f"{off['ppl_ratio']:.3f}"
        else:
            ratio, off_ratio = f"{fit['ppl_ratio']:.3f}", "-"
        mse = fit["transfer"]["mean_mse_after"]
        lines.append(f"| {label} | {ratio} | {off_ratio} | {state:,.0f} | {mse:.3f} | {_minutes(fit)} |")
    free = next(r for r in sweep["rows"] if not r.get("trained"))
    free_state = free["state_bytes"] / (free["replaced_heads"] // 3)
    name = short(free["operator"])
    lines.append(f"| training-free {name}, the same heads | {free['ppl_ratio']:.3f} | - | {free_state:,.0f} | - | none |")
    return "\n".join(lines)


# the levers together, at beta 0.75 and 0.9: one sweep with the lever sweep's arguments scores the
# new models and the LoRA control (the original with the same adapters and training)
COMBINED = "levers_smollm2_combined"
LONG = "`--data.long_seq_len 4096 --model.transfer.long_seq_len 4096`"
# (run directory, beta, what differs from the beta's recipe, fit summary, passkey result, sweep)
TOGETHER = (
    ("smollm2_b075_sl", "0.75", "none: `recipes/smollm2_b075.yaml` as first shipped (2,048-token blocks, 48 steps)", "fit_smollm2_b075_sl/summary.json", "passkey_smollm2_b075_sl.json", SWEEP),
    ("lever_b075_long4096", "0.75", f"4,096-token blocks ({LONG})", "levers_smollm2/fit_long4096.json", "levers_smollm2/passkey_long4096.json", SWEEP),
    ("lever_b075_lora_long4096", "0.75", "4,096-token blocks and LoRA r 8 (`--model.lora.r 8 --model.lora.alpha 8`)", f"{COMBINED}/fit_b075_lora_long4096.json", f"{COMBINED}/passkey_b075_lora_long4096.json", f"{COMBINED}/sweep.json"),
    ("smollm2_b09_sl", "0.9", "2,048-token blocks, 48 steps: `recipes/smollm2_b09.yaml` as first shipped", "fit_smollm2_b09_sl/summary.json", f"{COMBINED}/passkey_b09_sl.json", B09_SWEEP),
    ("lever_b09_long4096", "0.9", "4,096-token blocks, 48 steps: `recipes/smollm2_b09.yaml` before 72 steps", f"{COMBINED}/fit_b09_long4096.json", f"{COMBINED}/passkey_b09_long4096.json", f"{COMBINED}/sweep.json"),
    ("lever_b09_lora_long4096", "0.9", "4,096-token blocks and LoRA r 8", f"{COMBINED}/fit_b09_lora_long4096.json", f"{COMBINED}/passkey_b09_lora_long4096.json", f"{COMBINED}/sweep.json"),
)
CONTROL_RUN = ("lever_b0_lora_long4096", f"{COMBINED}/fit_b0_lora_long4096.json", f"{COMBINED}/passkey_b0_lora_long4096.json")


def _ratios(row: dict) -> list[float]:
    """Wikipedia 512, then each long length: the row's perplexity ratios to the original."""
    return [row["ppl_ratio"]] + [row["long_ppl_ratio"][f"shakespeare@{n}"] for n in LENGTHS]


def _cells(ratios: list[float]) -> list[str]:
    return [f"{r:.3f}" for r in ratios]


def _lever_line(entry: tuple, extra=lambda on: []) -> str:
    """One trained lever's row: ``(run, beta, label, fit summary, passkey result, sweep)``, its
    ratios, state-off ratios and passkeys, then ``extra(row)``'s cells, then the fit's time."""
    run, beta, label, fit_file, passkey, sweep_file = entry
    on, off = _run_rows(load(sweep_file), run, sweep_file)
    cells = _cells(_ratios(on))
    middle = [cells[0], " / ".join(cells[1:]), _lengths(off), passkey_cells(load(passkey)), *extra(on)]
    return f"| {beta} | {label} | " + " | ".join(middle) + f" | {_minutes(load(fit_file))} |"


def _free_lines(sweep: dict, blanks: int) -> list[str]:
    """The training-free row of each beta (0.75, 0.9) of ``sweep``, ``blanks`` empty cells after its ratios."""
    lines = []
    for beta in ("0.75", "0.9"):
        free = next(r for r in sweep["rows"] if not r.get("trained") and f"{r['beta']:g}" == beta)
        cells = _cells(_ratios(free))
        empty = " | ".join(["-"] * blanks)
        lines.append(f"| {beta} | training-free {short(free['operator'])}, the same heads, the same bytes | {cells[0]} | {' / '.join(cells[1:])} | {empty} | none |")
    return lines


@table("recovery_levers_together")
def recovery_levers_together() -> str:
    """The levers together at beta 0.75 and 0.9, the training-free rows of each beta and the LoRA
    control; the last column divides a LoRA row by the control (the original with the same
    adapters and training), which is what the conversion itself costs once the adapters are there."""
    combined = load(f"{COMBINED}/sweep.json")
    control = [r for r in combined["rows"] if r.get("trained") and f"runs/{CONTROL_RUN[0]}/" in r.get("model", "")]
    if len(control) != 1:
        raise KeyError(f"{COMBINED}/sweep.json: expected one trained row of runs/{CONTROL_RUN[0]}/")
    adapted = _ratios(control[0])
    lines = [
        "| beta | lever (measured-loss ranking, bf16) | Wikipedia 512 | long documents 2,048 / 8,192 | state off, 2,048 / 8,192 | passkey 1,024 / 2,048 / 4,096 | against the adapted original: Wikipedia / 2,048 / 8,192 | fit |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in TOGETHER:
        lora = "lora" in entry[0]
        lines.append(_lever_line(entry, lambda on: [" / ".join(_cells([c / a for c, a in zip(_ratios(on), adapted)])) if lora else "-"]))
    lines += _free_lines(combined, 3)
    run, fit_file, passkey = CONTROL_RUN
    lines.append(f"| 0 | the LoRA control: the original with the same adapters and training (`--model.policy.init_args.beta 0`) | {_cells(adapted)[0]} | {' / '.join(_cells(adapted)[1:])} | - | {passkey_cells(load(passkey))} | 1.000 / 1.000 / 1.000 | {_minutes(load(fit_file))} |")
    lines.append(f"| 0 | the original | 1.000 | 1.000 / 1.000 | - | {passkey_cells(load(PASSKEY_ORIGINAL))} | - | - |")
    return "\n".join(lines)


def _same_original(sweeps: dict) -> None:
    """Every sweep (name -> sweep) measured the same original as the first: the same blocks, so
    their rows compare."""
    (first, reference), *others = sweeps.items()
    for name, sweep in others:
        if sweep["original"] != reference["original"]:
            raise ValueError(f"{name}: its original differs from {first}'s; the rows would not compare")


# planted recall (data.long_recall) and more steps: one more sweep with the lever sweep's
# arguments scores the new models; its original must equal the lever sweeps' (the same blocks)
RECALL = "levers_smollm2_recall"
RECALL_FLAGS = "`--data.long_recall 8 --model.distill.recall 1`"
STEPS_FLAGS = "`--trainer.max_steps 72 --model.lr_scheduler.init_args.T_max 72`"
RECALL_ROWS = (
    TOGETHER[0],
    ("lever_b075_recall8", "0.75", f"planted recall, 8 records in each long block ({RECALL_FLAGS})", f"{RECALL}/fit_b075_recall8.json", f"{RECALL}/passkey_b075_recall8.json", f"{RECALL}/sweep.json"),
    TOGETHER[1],
    ("lever_b075_long4096_steps72", "0.75", f"4,096-token blocks and 72 steps instead of 48: `recipes/smollm2_b075.yaml` until it shifted positions ({STEPS_FLAGS})", f"{RECALL}/fit_b075_long4096_steps72.json", f"{RECALL}/passkey_b075_long4096_steps72.json", f"{RECALL}/sweep.json"),
    TOGETHER[4],
    ("lever_b09_long4096_steps72", "0.9", f"72 steps instead of 48: `recipes/smollm2_b09.yaml` until it ranked on the plays ({STEPS_FLAGS})", f"{RECALL}/fit_b09_steps72.json", f"{RECALL}/passkey_b09_steps72.json", f"{RECALL}/sweep.json"),
)


@table("recovery_recall_steps")
def recovery_recall_steps() -> str:
    """Planted recall at beta 0.75 and more steps at 0.75 and 0.9, each beside the row it changes, the training-free rows and the original's passkeys."""
    sweep = load(f"{RECALL}/sweep.json")
    _same_original({f"{RECALL}/sweep.json": sweep, **{f: load(f) for f in (SWEEP, f"{COMBINED}/sweep.json")}})
    lines = [
        "| beta | lever (measured-loss ranking, bf16) | Wikipedia 512 | long documents 2,048 / 8,192 | state off, 2,048 / 8,192 | passkey 1,024 / 2,048 / 4,096 | fit |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [_lever_line(entry) for entry in RECALL_ROWS]
    lines += _free_lines(sweep, 2)
    lines.append(f"| 0 | the original | 1.000 | 1.000 / 1.000 | - | {passkey_cells(load(PASSKEY_ORIGINAL))} | - |")
    return "\n".join(lines)


# which heads stay when a tenth do, ranked on the plays and on planted records: one more sweep with
# the lever sweep's arguments scores the beta 0.9 fit ranked on the plays and the record-aware
# ranking training-free; the plays ranking's training-free rows are policies_smollm2_long's, and
# every training-free ranking's passkeys come from the recipe files beside the sweep
RANK = "levers_smollm2_playrank"
JITTER = "levers_smollm2_jitter"
B075_JITTER = "levers_smollm2_b075_jitter"
DECAY512 = "levers_smollm2_b09_decay512"
JITTER8K = "levers_smollm2_b09_jitter8192"
J8K_DECAY512 = "levers_smollm2_b09_j8192_decay512"
PLAYS_FLAGS = "`--model.policy.init_args.long_source embedded:shakespeare --model.policy.init_args.long_seq_len 2048 --model.policy.init_args.blocks 2`"
RANK_ROWS = (
    (*RECALL_ROWS[3][:2], "72 steps, 4,096-token blocks, heads ranked on Wikipedia: `recipes/smollm2_b075.yaml` before", *RECALL_ROWS[3][3:]),
    ("b075_jitter", "0.75", "the same, positions shifted by up to 4,096 in training (`--model.position_jitter 4096`): `recipes/smollm2_b075.yaml` until it shifted only the long blocks", f"{B075_JITTER}/fit_b075_jitter.json", f"{B075_JITTER}/passkey_b075_jitter.json", f"{B075_JITTER}/sweep.json"),
    (*RECALL_ROWS[5][:2], "72 steps, 4,096-token blocks, heads ranked on Wikipedia: `recipes/smollm2_b09.yaml` before", *RECALL_ROWS[5][3:]),
    ("b09_playrank", "0.9", f"the same, heads ranked by loss measured on 2 x 2,048 play tokens ({PLAYS_FLAGS})", f"{RANK}/fit_b09_playrank.json", f"{RANK}/passkey_b09_playrank.json", f"{RANK}/sweep.json"),
    ("b09_playrank_jitter", "0.9", "the same, positions shifted by up to 4,096 in training (`--model.position_jitter 4096`): `recipes/smollm2_b09.yaml` until it shifted only the long blocks", f"{JITTER}/fit_b09_playrank_jitter.json", f"{JITTER}/passkey_b09_playrank_jitter.json", f"{JITTER}/sweep.json"),
    ("b09_jitter_decay512", "0.9", "the recipe now with the state's decay horizon starting at 512 tokens instead of 128 (`--model.operator.init_args.decay_horizon 512`; the training loss in one rowwise pass)", f"{DECAY512}/fit_b09_decay512.json", f"{DECAY512}/passkey_b09_decay512.json", f"{DECAY512}/sweep.json"),
    ("b09_jitter8192", "0.9", "the recipe now with shifts of up to 8,192 instead of 4,096 (`--model.position_jitter 8192`: a 512-token batch then moves by up to 7,680, a 4,096-token block still by up to 4,096, the model's context being 8,192)", f"{JITTER8K}/fit_b09_jitter8192.json", f"{JITTER8K}/passkey_b09_jitter8192.json", f"{JITTER8K}/sweep.json"),
    ("b09_j8192_decay512", "0.9", "both: shifts of up to 8,192 and the decay horizon starting at 512 (`--model.position_jitter 8192 --model.operator.init_args.decay_horizon 512`)", f"{J8K_DECAY512}/fit_b09_j8192_decay512.json", f"{J8K_DECAY512}/passkey_b09_j8192_decay512.json", f"{J8K_DECAY512}/sweep.json"),
)
# (ranking, the sweep holding its training-free rows, the tag of its passkey files)
FREE_RANKINGS = (
    ("loss measured on 8 x 512 Wikipedia tokens (the recipes' ranking)", f"{RECALL}/sweep.json", "wiki"),
    ("loss measured on 2 x 2,048 play tokens", "policies_smollm2_long/sweep.json", "plays"),
    ("loss measured on the same play blocks with 8 planted records each (text + 0.1 x answer increase)", f"{RANK}/sweep.json", "recall"),
)


@table("recovery_ranking")
def recovery_ranking() -> str:
    """The beta 0.9 recipe against the same fit ranked on the plays, and three training-free
    rankings at each beta with their passkeys; every sweep must have measured the same original."""
    sweeps = {f: load(f) for f in dict.fromkeys([s for _l, s, _t in FREE_RANKINGS] + [e[5] for e in RANK_ROWS])}  # in order
    _same_original({SWEEP: load(SWEEP), **sweeps})
    lines = [
        "| beta | model (bf16) | Wikipedia 512 | long documents 2,048 / 8,192 | state off, 2,048 / 8,192 | passkey 1,024 / 2,048 / 4,096 | fit |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [_lever_line(entry) for entry in RANK_ROWS]
    for beta, tag in (("0.75", "b075"), ("0.9", "b09")):
        for label, sweep_file, kind in FREE_RANKINGS:
            free = [r for r in sweeps[sweep_file]["rows"] if not r.get("trained") and f"{r['beta']:g}" == beta]
            if len(free) != 1:
                raise KeyError(f"{sweep_file}: expected one training-free row at beta {beta}, found {len(free)}")
            cells = _cells(_ratios(free[0]))
            keys = passkey_cells(load(f"{RANK}/passkey_free_{tag}_{kind}.json"))
            lines.append(f"| {beta} | training-free {short(free[0]['operator'])}, heads ranked by {label} | {cells[0]} | {' / '.join(cells[1:])} | - | {keys} | none |")
    lines.append(f"| 0 | the original | 1.000 | 1.000 / 1.000 | - | {passkey_cells(load(PASSKEY_ORIGINAL))} | - |")
    return "\n".join(lines)


# beta 0.9 with only the long blocks shifted (model.position_jitter_batches: long), fitted and
# measured on an Intel Xeon with AMX: its bf16 original reads slightly differently from the AMD
# EPYC's (the other tables), so these rows stand with their own sweeps' original and training-free row
def _long_row(run: str, folder: str, label: str, fit: str) -> tuple:
    """A beta 0.9 row of ``levers_smollm2_<folder>/``: its fit summary, passkey and sweep."""
    base = f"levers_smollm2_{folder}"
    return (run, "0.9", label, f"{base}/{fit}", f"{base}/passkey.json", f"{base}/sweep.json")


_SHIFT_LONG = "the recipe with only its 4,096-token blocks shifted (the Wikipedia batches stay at positions 0..511)"
LONG_JITTER_ROWS = (
    *(_long_row(f"b09_longjitter_d{h}", f"b09_longjitter_d{h}", f"{_SHIFT_LONG} and the decay horizon starting at {h} (`--model.position_jitter_batches long --model.operator.init_args.decay_horizon {h}`)", f"fit_b09_longjitter_d{h}.json") for h in (512, 1024)),
    _long_row("b09_lj8192_d2048", "b09_longjitter8192_d2048", "the recipe with only its 4,096-token blocks shifted, by up to 8,192, and the decay horizon starting at 2048 (`--model.position_jitter_batches long --model.position_jitter 8192 --model.operator.init_args.decay_horizon 2048`)", "fit_b09_lj8192_d2048.json"),
    _long_row("b09_rank8k", "b09_rank8k", "the recipe with its heads ranked by loss measured on one 8,192-token play block instead of two of 2,048 (`--model.policy.init_args.long_seq_len 8192 --model.policy.init_args.blocks 1`)", "fit_b09_rank8k.json"),
    _long_row("b09_rank2k8k", "b09_rank2k8k", "the recipe with its heads ranked on both lengths, two 2,048-token play blocks and one of 8,192, each group's two increases summed after dividing each by that length's mean (`--model.policy.init_args.long_seq_len '[2048, 8192]' --model.policy.init_args.blocks '[2, 1]'`: `recipes/smollm2_b09.yaml` now)", "fit_b09_rank2k8k.json"),
    ("b09_rank2k8k_seed1", "0.9", "the same with `--seed_everything 1`", "trained_smollm2_b09_rank2k8k/fit_b09_rank2k8k_seed1.json", "trained_smollm2_b09_rank2k8k/passkey_seed1.json", "trained_smollm2_b09_rank2k8k/sweep.json"),
    _long_row("b09_long8k", "b09_long8k", "the recipe trained on 12 blocks of 8,192 play tokens instead of 24 of 4,096, unshifted, the decay horizon starting at 1024, transfer's long blocks 2,048 tokens (`--model.operator.init_args.decay_horizon 1024 --model.position_jitter 0 --data.long_seq_len 8192 --data.long_every 4 --trainer.max_steps 60 --model.lr_scheduler.init_args.T_max 60 --model.transfer.long_seq_len 2048`)", "fit_b09_long8k.json"),
)  # fmt: skip


@table("recovery_long_jitter")
def recovery_long_jitter() -> str:
    """Beta 0.9 with only the long blocks shifted, beside the training-free model on the same heads
    and bytes from the same sweep (every sweep must have measured the same original)."""
    return _long_table(LONG_JITTER_ROWS, "0.9")


# beta 0.75 on the same AMX machine: the recipe as it was (every batch shifted) and with only the
# long blocks shifted, two seeds, in sweeps with the same arguments
B075_AMX, B075_LONG = "trained_smollm2_b075_amx", "trained_smollm2_b075_longjitter"
B075_RANK = "levers_smollm2_b075_rank2k8k"  # seed 0 alone: its second seed was lost with its machine
B075_LONG_ROWS = (
    ("b075_amx", "0.75", "every batch shifted by up to 4,096: `recipes/smollm2_b075.yaml` before (`--model.position_jitter_batches all`)", f"{B075_AMX}/fit_b075_recipe.json", f"{B075_AMX}/passkey.json", f"{B075_AMX}/sweep.json"),
    ("b075_longjitter", "0.75", "only the 4,096-token play blocks shifted, the Wikipedia batches at positions 0..511, heads ranked on 8 x 512 Wikipedia tokens: `recipes/smollm2_b075.yaml` before (`--model.position_jitter_batches long`)", f"{B075_LONG}/fit_b075_longjitter.json", f"{B075_LONG}/passkey.json", f"{B075_LONG}/sweep.json"),
    ("b075_longjitter_seed1", "0.75", "the same with `--seed_everything 1`", f"{B075_LONG}/fit_b075_longjitter_seed1.json", f"{B075_LONG}/passkey_seed1.json", f"{B075_LONG}/sweep.json"),
    ("b075_rank2k8k", "0.75", "the same, heads ranked on both play lengths as `smollm2_b09` ranks them, two 2,048-token blocks and one of 8,192 (`--model.policy.init_args.long_source embedded:shakespeare --model.policy.init_args.long_seq_len '[2048, 8192]' --model.policy.init_args.blocks '[2, 1]'`): `recipes/smollm2_b075.yaml` now", f"{B075_RANK}/fit_b075_rank2k8k.json", f"{B075_RANK}/passkey.json", f"{B075_RANK}/sweep.json"),
)  # fmt: skip


@table("recovery_long_jitter_b075")
def recovery_long_jitter_b075() -> str:
    """Beta 0.75 with every batch or only the long blocks shifted, and ranked on both play
    lengths, on the AMX machine."""
    return _long_table(B075_LONG_ROWS, "0.75")


_RANKINGS = {"RecencyRatioPolicy": "by the recency ratio", "streamed_loss": "by loss measured on 8 x 512 Wikipedia tokens"}


def _ranked(policy: str) -> str:
    """How a sweep's policy label ranks the heads, in words."""
    length = re.search(r"long_seq_len=(?:\[([\d, ]+)\]|(\d+))", policy)
    if not length:
        return _RANKINGS.get(policy, f"by {policy}")
    sizes = [f"{int(n):,}" for n in (length.group(1) or length.group(2)).split(",")]
    both = " (each length's increases over their mean, summed)" if len(sizes) > 1 else ""
    return f"by loss measured on {' and '.join(sizes)}-token blocks{both}"


def _long_table(rows: tuple, beta: str) -> str:
    """The trained rows (``_lever_line`` entries) and one training-free row per ranking the sweeps
    scored (from the first sweep that scored it); every sweep must have measured the same original."""
    sweeps = {entry[5]: load(entry[5]) for entry in rows}
    _same_original(sweeps)
    machine = load(rows[0][3])["provenance"].get("machine", "machine not recorded")
    lines = [
        f"| beta | model (bf16, {machine}) | Wikipedia 512 | long documents 2,048 / 8,192 | state off, 2,048 / 8,192 | passkey 1,024 / 2,048 / 4,096 | fit |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [_lever_line(entry) for entry in rows]
    free = {}
    for entry in rows:
        for r in sweeps[entry[5]]["rows"]:
            if not r.get("trained"):
                free.setdefault(r["policy"], r)
    for policy, row in free.items():
        cells = _cells(_ratios(row))
        lines.append(f"| {beta} | training-free {short(row['operator'])}, heads ranked {_ranked(policy)}, the same bytes | {cells[0]} | {' / '.join(cells[1:])} | - | - | none |")
    return "\n".join(lines)
