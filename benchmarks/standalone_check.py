"""Does a saved model folder work without rfkit? Run ``standalone_probe.py`` where ``import rfkit`` fails.

    python benchmarks/standalone_check.py --model DIR --json OUT

``--model`` is a folder written by ``rfkit fit`` (with ``config.yaml`` and, beside it in the run
directory, ``summary.json``); a folder saved before models carried their code is made
self-contained first (``rfkit export`` into a temporary copy). Its validation blocks are rebuilt
from its recipe, with rfkit, and handed to the probe, which loads the folder with
``trust_remote_code=True`` in a process whose import path has a ``rfkit`` package that refuses to
import, and computes their perplexity as ``rfkit fit`` does. The file records both perplexities and
their relative difference.

The tests (``tests/test_sharing.py``) use :func:`run_probe` and :func:`run_without_rfkit` the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROBE = HERE / "standalone_probe.py"
#: what a distributed launcher (or an earlier DDP run in the same process) leaves in the environment;
#: accelerate, under lm_eval, reads them as "join a process group"
DISTRIBUTED = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}


def probe_outputs(model, ids: torch.Tensor) -> dict:
    """The probe's comparison outputs (``standalone_probe.outputs``) for a model loaded here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rf_standalone_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe.outputs(model, ids)


def blocked_env(workdir: Path) -> dict:
    """The environment of a process where ``import rfkit`` fails: a package of that name that raises,
    first on the import path (the working directory is ``workdir``, not a checkout)."""
    block = workdir / "block" / "rfkit"
    block.mkdir(parents=True, exist_ok=True)
    (block / "__init__.py").write_text('raise ImportError("rfkit is blocked in this process")\n')
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED}  # a fresh colleague's shell, not a rank of ours
    env.update(PYTHONPATH=str(block.parent), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("HF_MODULES_CACHE", str(workdir / "hf_modules"))  # transformers' copies of the folders' code
    return env


def run_without_rfkit(argv: list[str], workdir: Path, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``argv`` run where rfkit cannot be imported, in ``cwd`` (default ``workdir``). A working
    directory that holds an rfkit checkout only suits a command whose import path does not start
    with it (a console script, not ``python -m``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = blocked_env(workdir)
    return subprocess.run(argv, cwd=cwd or workdir, env=env, text=True, capture_output=True, timeout=timeout)


def run_probe(folders: list[dict], workdir: Path, timeout: float = 600) -> dict:
    """The probe's result for ``folders`` (``{"path", "tag", "inputs": {...tensors}}``); the
    tensors it wrote are read back into ``result["folders"][tag]["tensors"]``."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = {"out": str(workdir / "result.json"), "folders": []}
    for folder in folders:
        inputs = workdir / f"{folder['tag']}.inputs.pt"
        torch.save(folder["inputs"], inputs)
        job["folders"].append({"path": str(Path(folder["path"]).resolve()), "tag": folder["tag"], "inputs": str(inputs)})  # the probe runs elsewhere
    (workdir / "job.json").write_text(json.dumps(job))
    done = run_without_rfkit([sys.executable, str(PROBE), str(workdir / "job.json")], workdir, timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads((workdir / "result.json").read_text())
    for tag, found in result["folders"].items():
        found["tensors"] = torch.load(workdir / f"{tag}.pt")
    return result


def main(argv: list[str] | None = None) -> int:
    from rfkit.atomic import atomic_write_json
    from rfkit.config.sharing import export
    from rfkit.provenance import stamp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model folder written by rfkit fit")
    parser.add_argument("--summary", help="the fit's summary.json (default: beside the model folder)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    started = time.time()
    model = Path(args.model)
    summary = json.loads(Path(args.summary or model.parent / "summary.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        import yaml

        from rfkit.data import TextDataModule

        recipe = yaml.safe_load((model / "config.yaml").read_text())
        settings = dict(recipe["data"].get("init_args", {}))
        model_settings = recipe["model"].get("init_args", recipe["model"])
        settings.setdefault("tokenizer", model_settings["base_model"])  # the CLI links it
        data = TextDataModule(**settings)
        data.setup("fit")
        folder, exported = model, False
        if "auto_map" not in json.loads((model / "config.json").read_text()):
            folder, exported = Path(tmp) / "exported", True
            export(model, folder)
        inputs = {"ids": data.validation[:1, :32], "blocks": data.validation, "batch_size": data.batch_size}
        found = run_probe([{"path": folder, "tag": "model", "inputs": inputs}], Path(tmp) / "probe")
    ppl = found["folders"]["model"]["perplexity"]
    result = {
        "model": str(model),
        "exported_first": exported,
        "rfkit_import_error": found["rfkit_import_error"],
        "model_class": found["folders"]["model"]["model_module"] + "." + found["folders"]["model"]["model_class"],
        "validation_blocks": int(len(data.validation)),
        "seq_len": int(data.validation.shape[1]),
        "ppl_without_rfkit": ppl,
        "ppl_converted_fit": summary["ppl_converted"],
        "relative_difference": abs(ppl - summary["ppl_converted"]) / summary["ppl_converted"],
    }
    atomic_write_json(args.json, stamp(result, started=started))
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
