"""A recipe fitted on several seeds beside the default recipe's fit, each model evaluated, and every
seed checked against the lines its beta must meet (issue 49): one command, resumable, for a machine
that is lent for an afternoon.

    python benchmarks/seed_lines.py --recipe recipes/smollm2_b09.yaml --seeds 0,1,2 \\
        --output benchmarks/results/seed_lines/b09_48steps \\
        -- --trainer.max_steps 48 --model.lr_scheduler.init_args.T_max 48

Everything after ``--`` is added to the recipe's fits (never to the default recipe's). The steps,
in this order, each one ``rfkit`` command in a fresh interpreter, its output in a log under
``--runs`` (default ``runs/seed_lines/<output folder name>``: the models stay out of the results):

0. ``rfkit profile`` of the recipe and of the default recipe (with the overrides' ``--model.*`` /
   ``--data.*`` flags), untimed: a fit's first run on a machine also fills the profile cache that
   later fits read, and the fit-time line compares fits that read it warm;
1. the default recipe's fit (``--reference``, ``recipes/smollm2_b05.yaml``; ``none`` skips it and
   the fit-time line): fit times compare only side by side, on one machine in one session; with
   ``--reference-after`` it is fitted again right after the last seed's fit, and every seed's time
   is compared with the mean of the two (this 2-core machine's speed moves within a session: the
   default fit took 5.5 and 7.2 min two hours apart on 2026-12-02);
2. per seed: ``rfkit fit --config RECIPE --seed_everything SEED ...`` -> ``seed<N>/fit_summary.json``;
3. per seed: ``rfkit eval context`` on long documents of 2,048 and 8,192 tokens (16,384 of each),
   with the model's state off and the training-free baseline at the same bytes on the same heads
   -> ``seed<N>/context/context.json``;
4. per seed: ``rfkit eval needles`` (five needle shapes at 2,048 and 4,096 tokens, the original and
   the training-free model on the same prompts) -> ``seed<N>/needles/needles.json``; after the
   first seed both evaluations reuse the original's and the training-free model's results
   (:mod:`rfkit.evals.references`: the same prompts, weights and heads);

``--context-args`` and ``--needles-args`` add to those two commands' flags (a flag given again
wins), e.g. ``--needles-args "--lengths 2048"``.
5. with ``--speed``, once, on the first seed's model: ``rfkit bench speed`` at 2,048 and 8,192
   tokens (the architecture, not the seed, sets the speed) -> ``speed/speed.json``.

A step whose result file exists is not run again: after a crash or the end of a session the same
command carries on where it stopped (a fit cut short starts again from its first step). Then
``lines.json`` and ``lines.md``: per seed, every line with its value and whether it is met
(:data:`LINES`; the Wikipedia line reads the fit's own validation perplexity). ``--check`` only
writes those from the files there. ``--dry-run`` prints the commands still to run.

Exit code 0 when every step ran (whether the lines are met is in ``lines.md``), 1 when a step
failed (its log named), 2 for bad input, before anything runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tables import load
from tables.front import SHIPPED_B075, SHIPPED_B09, load_default_fits, needle_counts, training_free_name
from tables.lines import markdown

from rfkit.atomic import atomic_write_json, atomic_write_text
from rfkit.provenance import command_line, stamp

REFERENCE = "recipes/smollm2_b05.yaml"
# the evaluations as the shipped seeds ran them (later flags of --context-args / --needles-args win)
CONTEXT_ARGS = ["--lengths", "2048,8192", "--tokens", "16384", "--no-passkey", "--no-record"]
NEEDLES_ARGS = ["--no-state-off", "--no-record"]
FIT_TIME = 2.0  # a fit may take at most twice the default recipe's, side by side


@dataclass(frozen=True)
class Lines:
    """What a beta must meet (issue 49's "Done when"): perplexity ratios to the original, at most."""

    wikipedia: float
    long: dict[str, float]
    passkey_up_to: int | None = None  # passkeys found as often as by the original up to this length
    decode: dict[str, float] = field(default_factory=dict)  # decode speed-up at least, batch 1


LINES = {
    0.75: Lines(
        wikipedia=1.02, long={"2048": 1.08, "8192": 1.15}, passkey_up_to=4096, decode={"2048": 1.3, "8192": 1.9}
    ),
    0.9: Lines(wikipedia=1.05, long={"2048": 1.15, "8192": 1.25}),
}


SHIPPED = {"b075": SHIPPED_B075, "b09": SHIPPED_B09}  # the seeds behind the README's tables
# the decode speed beside them, one file per machine and dtype: the recipe's head map and operator
# converted without training (the weights change neither bytes nor speed), docs/comparing.md
# "Decode speed at beta 0.75"; the speed lines are met or missed machine by machine
SHIPPED_SPEED = {
    0.75: (
        ("shipped/b075/speed/speed.json", "the recipe's architecture, untrained, float32"),
        ("shipped/b075/speed_bf16_epyc/speed.json", "the recipe's architecture, untrained, bf16"),
        ("shipped/b075/speed_bytes/bf16.json", "the recipe's architecture, untrained, bf16, a second machine"),
    )
}


class InputError(Exception):
    """Bad input: one line, exit code 2."""


# -- the lines -------------------------------------------------------------------------------
def _line(name: str, value: str, ok: bool) -> dict:
    return {"line": name, "value": value, "ok": bool(ok)}


def check_seed(
    beta: float,
    fit: dict,
    context: dict,
    needles: dict,
    reference: dict | None,
    ppl: dict | None = None,
    free: dict | None = None,
    free_ppl: dict | None = None,
) -> list[dict]:
    """Every line one seed must meet, from its fit's ``summary.json``, its ``rfkit eval context``
    and ``rfkit eval needles`` results and the default recipe's fit beside it (None: no fit-time
    line). ``ppl``: an ``rfkit eval ppl`` of the model when what is checked was made from the fit's
    model after it (benchmarks/sharpen.py), else the fit's own Wikipedia figure. ``free``: a context
    result on the same blocks whose training-free row is read when ``context`` has none (run with
    ``--baseline none``). ``free_ppl``: ``rfkit eval ppl`` of the training-free model on the fit's
    Wikipedia blocks (adds that line). Lines that hold at every beta: below the training-free model
    at every length, none of its needles missed, the fit at most :data:`FIT_TIME` times the default's."""
    lines = []
    limits = LINES.get(beta)
    wiki = (ppl["ppl"] if ppl else fit["ppl_converted"]) / fit["ppl_original"]
    if limits:
        lines.append(_line(f"Wikipedia <= {limits.wikipedia}", f"{wiki:.3f}", wiki <= limits.wikipedia))
    if free_ppl is not None:
        tf = free_ppl["ppl"] / fit["ppl_original"]
        lines.append(_line("Wikipedia below training-free", f"{wiki:.3f} vs {tf:.3f}", wiki < tf))
    rows = context["rows"]
    if free is None or any(n.endswith(", training-free") for n in rows):
        free = context
    if not any(n.endswith(", training-free") for n in free["rows"]):
        raise ValueError("the context result has no training-free row (rfkit eval context ran with --baseline none)")
    if free["rows"]["original"]["ppl"] != rows["original"]["ppl"]:
        raise ValueError("the training-free row was measured on other blocks than the model's")
    free_row = free["rows"][training_free_name(free["rows"])]
    for n in context["lengths"]:
        got = rows["converted"]["ppl_ratio"][str(n)]
        if limits and str(n) in limits.long:
            lines.append(
                _line(f"long documents {n} <= {limits.long[str(n)]}", f"{got:.3f}", got <= limits.long[str(n)])
            )
        tf = free_row["ppl_ratio"][str(n)]
        lines.append(_line(f"long documents {n} below training-free", f"{got:.3f} vs {tf:.3f}", got < tf))
    if limits and limits.passkey_up_to:
        found, original = (
            needle_counts(needles, "converted")["passkeys"],
            needle_counts(needles, "original")["passkeys"],
        )
        for n in sorted(k for k in original if k <= limits.passkey_up_to):
            (got, of), (want, _) = found[n], original[n]
            lines.append(_line(f"passkeys at {n} as the original's", f"{got} vs {want} of {of}", got >= want))
    counts = needle_counts(needles, "converted")
    lines.append(
        _line(
            "needles the training-free model finds, missed",
            f"{counts['missed']} of {counts['free_found']}",
            counts["missed"] == 0,
        )
    )
    if reference is not None:
        lines.append(fit_time_line(fit, reference))
    return lines


def fit_time_line(fit: dict, reference: dict | list[dict]) -> dict:
    """The fit-time line: the fit's wall time against the default recipe's fit, or against the
    mean of its fits before and after the seeds' (a list: the machine's speed moves within a
    session, and a seed fitted between two reference fits is compared with both)."""
    references = reference if isinstance(reference, (list, tuple)) else [reference]
    times = [r["wall_seconds"] for r in references]
    ratio = fit["wall_seconds"] / (sum(times) / len(times))
    against = " / ".join(f"{t / 60:.1f}" for t in times) + " min"
    if len(times) > 1:  # and the ratio to each, for the reader who trusts one of them more
        against += ", their mean; " + " / ".join(f"{fit['wall_seconds'] / t:.2f}x" for t in times) + " each"
    value = f"{ratio:.2f}x ({fit['wall_seconds'] / 60:.1f} vs {against})"
    return _line(f"fit <= {FIT_TIME:g}x the default's", value, ratio <= FIT_TIME)


def check_speed(beta: float, speed: dict) -> list[dict]:
    """The decode lines of ``beta`` (if any) from an ``rfkit bench speed`` result, batch 1; the
    value names the row's bytes ratio where the result has one (the most a step bound by memory
    traffic can gain: a line above it needs a step bound by compute)."""
    limits = LINES.get(beta)
    rows = {str(r["context"]): r for r in speed["rows"] if r.get("batch", 1) == 1}
    out = []
    for n, least in (limits.decode if limits else {}).items():
        if n in rows:
            got = rows[n]["decode_ratio"]
            ceiling = f" (bytes ratio {rows[n]['bytes_ratio']:.2f}x)" if "bytes_ratio" in rows[n] else ""
            out.append(_line(f"decode at {n} >= {least}x", f"{got:.2f}x{ceiling}", got >= least))
    return out


# -- the steps -------------------------------------------------------------------------------
@dataclass
class Step:
    name: str
    args: list[str]  # after ``rfkit``
    result: Path  # exists once the step has run
    fit_root: Path | None = None  # a fit: its summary.json is copied to ``result``
    seed: int | None = None  # whose model an evaluation reads


def plan(opts) -> list[Step]:
    """Every step of the run in order, done or not."""
    out, runs, steps = Path(opts.output), Path(opts.runs), []
    # a fit's first run on a machine also fills the profile cache (the default recipe's recency
    # profile took 72 s of a 9.2 min fit, the cached read 0.01 s): `rfkit profile` fills it first,
    # untimed, so every fit the lines compare reads it warm
    steps.append(_warm("recipe", opts.recipe, _model_and_data(opts.overrides), runs / "seed_profile"))
    if opts.reference != "none":
        steps.append(_warm("reference", opts.reference, [], runs / "reference"))
        steps.append(_reference_fit("reference fit", "reference", opts))
    for n, seed in enumerate(opts.seeds, 1):
        root, here = runs / f"seed{seed}", out / f"seed{seed}"
        fit = [
            "fit",
            "--config",
            opts.recipe,
            "--seed_everything",
            str(seed),
            "--trainer.default_root_dir",
            str(root),
            *opts.overrides,
        ]
        steps.append(Step(f"seed {seed}: fit", fit, here / "fit_summary.json", root))
        if n == len(opts.seeds) and opts.reference_after:  # right after the last seed's fit
            steps.append(_reference_fit("reference fit, after", "reference_after", opts))
        context = ["eval", "context", *CONTEXT_ARGS, *shlex.split(opts.context_args), "--output", str(here / "context")]
        steps.append(Step(f"seed {seed}: context", context, here / "context" / "context.json", seed=seed))
        needles = ["eval", "needles", *NEEDLES_ARGS, *shlex.split(opts.needles_args), "--output", str(here / "needles")]
        steps.append(Step(f"seed {seed}: needles", needles, here / "needles" / "needles.json", seed=seed))
    if opts.speed:
        speed = out / "speed" / "speed.json"
        bench = ["bench", "speed", "--contexts", "2048,8192", "--runs", "5", "--no-record", "--json", str(speed)]
        steps.append(Step("speed", bench, speed, seed=opts.seeds[0]))
    return steps


def _reference_fit(name: str, folder: str, opts) -> Step:
    """The default recipe's fit under ``--runs``/``folder``, its summary in ``--output``/``folder``."""
    root = Path(opts.runs) / folder
    fit = ["fit", "--config", opts.reference, "--trainer.default_root_dir", str(root)]
    return Step(name, fit, Path(opts.output) / folder / "fit_summary.json", root)


def _warm(name: str, recipe: str, overrides: list[str], root: Path) -> Step:
    """``rfkit profile`` of ``recipe``: the head selection a fit of it makes, cached for that fit."""
    head_map = root / "head_map.json"
    return Step(f"{name} profile", ["profile", "--config", recipe, *overrides, "--output", str(head_map)], head_map)


def _model_and_data(overrides: list[str]) -> list[str]:
    """The ``--model.*`` and ``--data.*`` flags of ``overrides`` with their values: what
    ``rfkit profile`` takes and what the selection can depend on."""
    kept, keep = [], False
    for arg in overrides:
        if arg.startswith("--"):
            keep = arg.startswith(("--model.", "--data."))
        if keep:
            kept.append(arg)
    return kept


def model_of(step: Step, opts) -> str | None:
    """The model an evaluation step reads: the saved model of its seed's fit (None before it ran)."""
    if step.seed is None:
        return None
    summary = Path(opts.output) / f"seed{step.seed}" / "fit_summary.json"
    return json.loads(summary.read_text())["model_dir"] if summary.is_file() else None


def command(step: Step, opts) -> list[str]:
    """The step's command line; an evaluation's model is named once its seed's fit has run."""
    if step.seed is None:
        args = step.args
    else:
        model = model_of(step, opts) or f"<the model of seed {step.seed}'s fit>"
        args = [*step.args[:2], "--model", model, *step.args[2:]]
    return [sys.executable, "-m", "rfkit.cli", *args]


def _run(cmd: list[str], log: Path) -> int:
    """``cmd`` in a fresh interpreter, its output added to ``log``; the exit code."""
    with open(log, "a") as f:
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)


def run_step(step: Step, opts) -> float:
    """Run one step with its output in a log; a fit's new ``summary.json`` is copied to its result."""
    logs = Path(opts.runs) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / (step.name.replace(":", "").replace(" ", "_") + ".log")
    before = set(step.fit_root.glob("lightning_logs/version_*/summary.json")) if step.fit_root else set()
    if step.seed is not None and model_of(step, opts) is None:
        raise RuntimeError(f"{step.name}: seed {step.seed}'s fit has no summary under {opts.output}")
    cmd = command(step, opts)
    log.write_text(shlex.join(cmd) + "\n")
    started = time.monotonic()
    rc = _run(cmd, log)
    seconds = time.monotonic() - started
    if rc != 0:
        raise RuntimeError(f"{step.name}: exit code {rc} after {seconds:.0f} s; see {log}")
    if step.fit_root is not None:
        new = sorted(set(step.fit_root.glob("lightning_logs/version_*/summary.json")) - before)
        if not new:
            raise RuntimeError(f"{step.name}: the fit wrote no summary.json under {step.fit_root}; see {log}")
        atomic_write_text(step.result, new[-1].read_text())
    elif not step.result.is_file():
        raise RuntimeError(f"{step.name}: ran but wrote no {step.result}; see {log}")
    return seconds


def _read(path: Path) -> dict:
    if not path.is_file():
        raise InputError(f"--check: {path} is missing; run without --check to make it")
    return json.loads(path.read_text())


def _speed(beta: float, result: dict, model: str) -> dict:
    """The decode lines of an ``rfkit bench speed`` result, named with its model and machine."""
    return {
        "model": f"{model}, {result['provenance'].get('machine', 'machine unknown')}",
        "lines": check_speed(beta, result),
    }


def _seed_result(seed: int, lines: list[dict]) -> dict:
    return {"seed": seed, "lines": lines, "all_met": all(x["ok"] for x in lines)}


def check(opts) -> dict:
    """``lines.json`` and ``lines.md`` from the result files under ``--output`` (or, with
    ``--shipped``, from the files the README's table of that recipe reads)."""
    out = Path(opts.output)
    speeds: list[dict] = []
    if opts.shipped:
        spec = SHIPPED[opts.shipped]
        free = load(spec.free_context)
        beta, recipe, seeds = spec.beta, spec.recipe, []
        free_ppl = load(spec.free_ppl)
        for s in spec.seeds:
            ppl = load(s.ppl) if s.ppl else None
            lines = check_seed(
                beta, load(s.fit), load(s.context), load(s.needles), load_default_fits(s), ppl, free, free_ppl
            )
            seeds.append(_seed_result(s.seed, lines))
        speeds = [_speed(beta, load(name), note) for name, note in SHIPPED_SPEED.get(spec.beta, ())]
    else:
        reference = None if opts.reference == "none" else _read(out / "reference" / "fit_summary.json")
        if opts.reference_after:
            reference = [reference, _read(out / "reference_after" / "fit_summary.json")]
        free_ppl = _read(Path(opts.free_ppl)) if opts.free_ppl else None
        recipe, seeds, beta = opts.recipe, [], None
        for seed in opts.seeds:
            here = out / f"seed{seed}"
            context = _read(here / "context" / "context.json")
            beta = context["beta"]
            fit, needles = _read(here / "fit_summary.json"), _read(here / "needles" / "needles.json")
            seeds.append(_seed_result(seed, check_seed(beta, fit, context, needles, reference, free_ppl=free_ppl)))
        if opts.speed:
            speeds = [_speed(beta, _read(out / "speed" / "speed.json"), f"seed {opts.seeds[0]}'s model")]
    result = {
        "kind": "seed_lines", "recipe": recipe, "beta": beta, "overrides": shlex.join(opts.overrides),
        "reference": opts.reference, "shipped": opts.shipped, "seeds": seeds, "speed": speeds,
        "all_met": all(s["all_met"] for s in seeds) and all(x["ok"] for sp in speeds for x in sp["lines"]),
    }  # fmt: skip
    stamp(result, command=command_line([__file__, *opts.argv]))
    atomic_write_json(out / "lines.json", result)
    atomic_write_text(out / "lines.md", markdown(result))
    return result


# -- the command line ------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (main)
        raise InputError(message)


def parse(argv: list[str]):
    argv, given = list(argv), list(argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = _Parser(prog="python benchmarks/seed_lines.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", help="the recipe fitted on every seed")
    p.add_argument("--seeds", default="0,1,2", help="comma separated (default 0,1,2)")
    p.add_argument("--output", required=True, help="folder of the result files, lines.json and lines.md")
    p.add_argument("--runs", default=None, help="folder of the models and logs (default runs/seed_lines/<output name>)")
    p.add_argument(
        "--reference",
        default=REFERENCE,
        help=f"the default recipe fitted beside them (default {REFERENCE}); none: no fit-time line",
    )
    p.add_argument(
        "--reference-after",
        action="store_true",
        help="fit the default recipe again after the last seed's fit; each seed's time is compared with the mean of both",
    )
    p.add_argument(
        "--context-args", default="", help=f"added to rfkit eval context's (after {shlex.join(CONTEXT_ARGS)})"
    )
    p.add_argument(
        "--needles-args", default="", help=f"added to rfkit eval needles' (after {shlex.join(NEEDLES_ARGS)})"
    )
    p.add_argument("--speed", action="store_true", help="also rfkit bench speed on the first seed's model")
    p.add_argument(
        "--free-ppl", help="rfkit eval ppl of the training-free model on the same heads (adds its Wikipedia line)"
    )
    p.add_argument("--check", action="store_true", help="only write lines.json / lines.md from the files there")
    p.add_argument(
        "--shipped", choices=sorted(SHIPPED), help="only check the seeds behind the README's table of that recipe"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands still to run")
    opts = p.parse_args(argv)
    opts.overrides, opts.argv = overrides, given
    try:
        opts.seeds = [int(s) for s in opts.seeds.split(",")]
    except ValueError:
        raise InputError(f"--seeds: expected integers separated by commas, got {opts.seeds!r}") from None
    if len(set(opts.seeds)) != len(opts.seeds) or any(s < 0 for s in opts.seeds):
        raise InputError(f"--seeds: expected distinct integers >= 0, got {opts.seeds}")
    if opts.shipped:
        opts.check, opts.recipe = True, SHIPPED[opts.shipped].recipe
    elif not opts.recipe:
        raise InputError("--recipe: required (or --shipped)")
    if opts.free_ppl and not Path(opts.free_ppl).is_file():
        raise InputError(f"--free-ppl: no such result file {opts.free_ppl!r}")
    if opts.reference_after and opts.reference == "none":
        raise InputError("--reference-after: needs a default recipe to fit (--reference is none)")
    for name in ("recipe", "reference"):
        value = getattr(opts, name)
        if not (name == "reference" and value == "none") and not Path(value).is_file():
            raise InputError(f"--{name}: no such recipe file {value!r}")
    for flag in ("--trainer.default_root_dir", "--seed_everything"):
        if any(a == flag or a.startswith(flag + "=") for a in overrides):
            raise InputError(
                f"{flag}: set for each fit by seed_lines (--runs, --seeds); leave it out of the overrides after --"
            )
    for name in ("context_args", "needles_args"):
        try:
            shlex.split(getattr(opts, name))
        except ValueError as err:
            raise InputError(f"--{name.replace('_', '-')}: {err}") from None
    if Path(opts.output).exists() and not Path(opts.output).is_dir():
        raise InputError(f"--output: {opts.output} is a file, not a folder")
    opts.runs = opts.runs or str(Path("runs") / "seed_lines" / Path(opts.output).name)
    return opts


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse(sys.argv[1:] if argv is None else argv)
        if not opts.check:
            todo = [s for s in plan(opts) if not s.result.is_file()]
            if opts.dry_run:
                for step in todo:
                    print(f"{step.name}: {shlex.join(command(step, opts))}")
                return 0
            started = time.monotonic()
            for i, step in enumerate(todo, 1):
                print(f"[{i}/{len(todo)}] {step.name} ...", flush=True)
                print(
                    f"[{i}/{len(todo)}] {step.name}: {run_step(step, opts) / 60:.1f} min"
                    f" (total {(time.monotonic() - started) / 60:.1f})",
                    flush=True,
                )
        result = check(opts)
    except InputError as err:
        print(f"seed_lines: error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as err:  # a step that failed; result files that disagree
        print(f"seed_lines: {err}", file=sys.stderr)
        return 1
    print(markdown(result), end="")
    print(f"-> {Path(opts.output) / 'lines.json'}, {Path(opts.output) / 'lines.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
