"""lm-evaluation-harness tasks on an rfkit model, in process (HellaSwag, MMLU, your own tasks).

    rfkit eval lm-eval --model DIR|RECIPE [--original] --tasks hellaswag,mmlu
                       [--include-path DIR] [--num-fewshot N] [--limit N] [--batch-size N]
                       [--device cpu|cuda] [--json OUT]

The model is loaded with ``rfkit.config.loading.load_model`` (a converted directory, a plain HF
directory, or a recipe converted on the spot without training; ``--original`` for the base
model), wrapped in lm-eval's ``HFLM`` as an instance (no second load), and evaluated with
``lm_eval.simple_evaluate``. The results table is printed; ``--json`` gets the per-task
results plus the versions, n-shot, sample counts, task configs and run config.

Needs the ``eval`` extra (lm-eval >= 0.4.9): ``pip install "rfkit[eval]"``. Task names are
checked against lm-eval's task index (plus ``--include-path``) before the model loads.

With internet access (the standard tasks download their datasets from the Hugging Face hub):

    rfkit eval lm-eval --model runs/smollm2_b05/model --tasks hellaswag --num-fewshot 0 --json hellaswag.json
    rfkit eval lm-eval --model runs/smollm2_b05/model --tasks mmlu --num-fewshot 5 --json mmlu.json

Add ``--original`` for the unconverted base model, and ``--limit N`` for a quick look at the
first N examples of each task. Offline, point ``--include-path`` at a directory of task YAMLs
whose ``dataset_path``/``dataset_kwargs`` read local files (see ``tests/fixtures/lm_eval/``).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import time
from pathlib import Path

from rfkit.evals.common import (
    EvalError,
    add_model_arguments,
    add_to_card,
    check_model_arguments,
    positive_int,
    write_json,
)

MIN_VERSION = (0, 4, 9)
INSTALL_HINT = 'lm-eval is not installed; install the eval extra: pip install "rfkit[eval]"'

# TaskManager indexes every task YAML of lm-eval (seconds); one per include path per process,
# and one of an include path alone (:func:`task_manager`)
_TASK_MANAGERS: dict[tuple[str, ...], object] = {}


def import_lm_eval():
    """The ``lm_eval`` module, or an EvalError saying how to install it (or that it is too old)."""
    try:
        import lm_eval
    except ImportError:
        raise EvalError(INSTALL_HINT) from None
    version = getattr(lm_eval, "__version__", "0")
    parts = tuple(int(p) for p in (version.split(".") + ["0", "0"])[:3] if p.isdigit())
    if len(parts) == 3 and parts < MIN_VERSION:
        raise EvalError(f"lm-eval {version} is too old (need >= 0.4.9); upgrade: pip install -U \"rfkit[eval]\"")
    return lm_eval


def task_manager(include_path: str | None, names: list[str] = ()):
    """lm-eval's TaskManager over its own tasks plus ``include_path`` (cached per path). When every
    one of ``names`` is a task of ``include_path`` itself (not a group or tag there, which may name
    lm-eval's own tasks), a manager of that folder alone: indexing lm-eval's own task YAMLs takes
    about 20 s on a 2-core CPU, and a run of local tasks does not need them."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    key = (str(Path(include_path).resolve()),) if include_path else ()
    if include_path and names:
        local_key = ("local", *key)
        if local_key not in _TASK_MANAGERS:
            _TASK_MANAGERS[local_key] = TaskManager(include_path=include_path, include_defaults=False)
        local = _TASK_MANAGERS[local_key]
        if set(names) <= set(local.all_subtasks):
            return local
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = TaskManager(include_path=include_path)
    return _TASK_MANAGERS[key]


def resolve_tasks(names: list[str], manager) -> list[str]:
    """Task names as lm-eval takes them: known names and groups, glob patterns expanded, and
    task YAML files. Unknown names are one EvalError naming all of them."""
    known = manager.all_tasks
    known_set = set(known)
    resolved, unknown = [], []
    for name in names:
        if name in known_set:
            resolved.append(name)
        elif name.endswith((".yaml", ".yml")) and Path(name).is_file():
            resolved.append(name)
        elif any(c in name for c in "*?["):
            matched = fnmatch.filter(known, name)
            (resolved.extend(matched) if matched else unknown.append(name))
        else:
            unknown.append(name)
    if unknown:
        hints = []
        for name in unknown:
            near = difflib.get_close_matches(name, known, n=2, cutoff=0.75)
            if near:
                hints.append(f"{name} -> {' or '.join(near)}?")
        hint = f" (did you mean: {'; '.join(hints)})" if hints else ""
        raise EvalError(
            f"--tasks: unknown task(s) {', '.join(unknown)}{hint}; add your own task YAMLs with --include-path DIR, "
            "or see `lm-eval --tasks list` for the names lm-eval knows"
        )
    return list(dict.fromkeys(resolved))


def jsonable(obj):
    """A JSON-safe copy of lm-eval's results: numpy scalars to numbers, NaN/inf to None,
    tuples to lists, anything else (functions, dtypes, ...) to its string."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError):
            pass
    return str(obj)


# ----------------------------------------------------------------------------- command
def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--tasks", required=True, help="lm-eval task or group names (or task YAML files), comma separated")
    parser.add_argument("--include-path", default=None, help="directory of extra task YAMLs")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument(
        "--limit", type=float, default=None, help="at most this many examples per task (a value below 1: that fraction)"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="requests per forward")
    parser.add_argument("--seed", type=int, default=0, help="seed of lm-eval's random, numpy, torch and few-shot sampling")


def validate(args) -> None:
    """Flags, the model spec (no weights), lm-eval itself, and the task names."""
    args.task_list = [t.strip() for t in str(args.tasks).split(",") if t.strip()]
    if not args.task_list:
        raise EvalError("--tasks: give at least one task, like hellaswag or hellaswag,mmlu")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise EvalError(f"--include-path: '{args.include_path}' is not a directory")
    if args.num_fewshot is not None:
        positive_int(args, "num_fewshot", minimum=0)
    if args.limit is not None:
        if not (math.isfinite(args.limit) and args.limit > 0) or (args.limit >= 1 and args.limit != int(args.limit)):
            raise EvalError(f"--limit: must be a whole number >= 1 or a fraction in (0, 1), got {args.limit:g}")
        if args.limit >= 1:
            args.limit = int(args.limit)
    positive_int(args, "batch_size")
    check_model_arguments(args)
    manager = task_manager(args.include_path, args.task_list)
    args.task_list = resolve_tasks(args.task_list, manager)
    args.task_manager = manager


def run(args) -> int:
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import make_table

    from rfkit.config.loading import load_model

    loaded = load_model(args.model_spec, args.original, args.torch_device)
    start = time.perf_counter()
    lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, backend="causal", batch_size=args.batch_size)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=args.task_list,
        task_manager=args.task_manager,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size,
        log_samples=False,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    wall = round(time.perf_counter() - start, 2)
    print(f"lm-eval on {loaded.name}")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    out = {
        "task": "lm-eval",
        "model": loaded.name,
        "base_model": loaded.base_model,
        "converted": loaded.converted,
        "notes": loaded.notes,
        "tasks": args.task_list,
        "num_fewshot": args.num_fewshot,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "device": str(args.torch_device),
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "wall_seconds": wall,
    }
    for key in ("results", "groups", "group_subtasks", "versions", "n-shot", "n-samples", "higher_is_better",
                "configs", "config"):  # fmt: skip
        if key in results:
            out[key] = jsonable(results[key])
    write_json(args.json_out, out, getattr(args, "command_line", None))
    scores = {
        f"{task} {metric.split(',')[0]}": value
        for task, metrics in out.get("results", {}).items()
        for metric, value in metrics.items()
        if isinstance(value, (int, float)) and "stderr" not in metric
    }  # "acc,none" -> "acc"; standard errors stay in the JSON
    add_to_card(
        args, f"lm-eval tasks={','.join(args.task_list)} fewshot={args.num_fewshot} limit={args.limit} seed={args.seed}",
        f"lm-evaluation-harness ({', '.join(args.task_list)}; {args.num_fewshot} shots, limit {args.limit})",
        scores, dict.fromkeys(scores, ".4f"),
    )  # fmt: skip
    return 0
