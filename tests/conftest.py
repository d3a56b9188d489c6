"""Shared fixtures: tiny random models saved as HF directories, a tiny corpus, a converted model
and the data cache; the plain helpers they use are in helpers.py. Also the hook that deselects the
tests marked ``cuda`` where no GPU is (tests/cuda)."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, run_cli, tiny_args, tiny_model  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM

import rfkit  # noqa: F401  (registers the converted model types)
from rfkit.cli import main


def pytest_configure(config):
    """One build of the compiled CPU kernels for the whole run: every test (and every rfkit
    process a test starts) has its own ``RFKIT_CACHE``, where each would otherwise compile them
    again. Set here, before pytest-xdist starts its workers, so they and their children inherit
    it; the library's file name is keyed by its sources, flags and machine
    (:func:`rfkit.ops.cpu_kernels.kernels_dir`)."""
    import getpass
    import os
    import tempfile
    from pathlib import Path

    if "RFKIT_KERNELS_DIR" not in os.environ:
        os.environ["RFKIT_KERNELS_DIR"] = str(Path(tempfile.gettempdir()) / f"rfkit-test-kernels-{getpass.getuser()}")


# The test files that take longest (the slowest tests of `make test` on the 2-core CI machine,
# summed per file), longest first. `make test` hands whole files to its workers in collection
# order (pytest-xdist --dist loadfile --no-loadscope-reorder; xdist's default order, most tests
# first, sent the few-test real fits out last, and one worker ran them alone at the end). Started
# first, these leave the many short files to fill in around them. The "test files by time" table
# at the end of a run gives the current figures.
LONGEST_FIRST = (
    "tests/training/test_ddp.py",
    "tests/test_integration.py",
    "tests/experiments/test_mqar.py",
    "tests/cli/test_bad_inputs.py",
    "tests/test_recipe_dry_runs.py",
    "tests/training/test_faults.py",
    "tests/test_sharing.py",
    "tests/test_plugin.py",
    "tests/cli/test_cli.py",
    "tests/experiments/test_bench.py",
    "tests/models/test_fast_paths.py",
    "tests/evals/test_lm_eval.py",
    "tests/training/test_quality.py",
    "tests/experiments/test_sweep.py",
    "tests/models/test_mamba.py",
)


def _file_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Put the files of :data:`LONGEST_FIRST` first (the order of the tests within a file kept).
    Deselect (not skip) every test marked ``cuda`` where no GPU is, unless ``RFKIT_CUDA_TWIN=1``
    asks for them: they then run on the CPU as twins of the GPU check (tests/cuda/conftest.py)."""
    import os

    items.sort(key=_file_rank)  # stable: every other file keeps its place
    if os.environ.get("RFKIT_CUDA_TWIN") == "1" or torch.cuda.is_available():
        return
    deselected = [item for item in items if item.get_closest_marker("cuda") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("cuda") is None]


_SECONDS = {"file": {}, "worker": {}}


def pytest_runtest_logreport(report):
    """Add each phase's duration to its file's and its worker's total (under pytest-xdist the
    controller sees every worker's reports, each with the worker it came from)."""
    path = report.nodeid.split("::")[0]
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
    for kind, key in (("file", path), ("worker", worker)):
        _SECONDS[kind][key] = _SECONDS[kind].get(key, 0.0) + report.duration


def pytest_sessionstart(session):
    import time

    _SECONDS["started"] = time.time()


def pytest_terminal_summary(terminalreporter):
    """A table of the slowest test files and each worker's busy time: what a change to
    :data:`LONGEST_FIRST`, or a new slow test, has to go by. With ``RFKIT_TEST_TIMES=FILE`` the
    run's wall time, outcome counts, every file's and worker's seconds and the provenance block go
    to that JSON file too (``benchmarks/results/test_suite/`` holds the runs CONTRIBUTING.md cites)."""
    import os

    files, workers = _SECONDS["file"], _SECONDS["worker"]
    if not files:
        return
    terminalreporter.write_sep("=", "test files by time")
    for path, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    busy = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in sorted(workers.items()))
    terminalreporter.write_line(f"busy time per worker: {busy}")
    if os.environ.get("RFKIT_TEST_TIMES"):
        import shlex
        import sys

        from rfkit.atomic import atomic_write_json
        from rfkit.provenance import provenance

        counts = {k: len(v) for k, v in terminalreporter.stats.items() if k in ("passed", "failed", "error", "skipped")}
        atomic_write_json(os.environ["RFKIT_TEST_TIMES"], {
            "kind": "test_suite",
            "counts": counts,
            "workers": {name: round(seconds, 1) for name, seconds in sorted(workers.items())},
            "files": {path: round(seconds, 1) for path, seconds in sorted(files.items(), key=lambda kv: -kv[1])},
            "provenance": provenance(started=_SECONDS["started"], command=shlex.join(["python", "-m", "pytest", *sys.argv[1:]])),
        })  # fmt: skip


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, width 64, GQA 4/2) saved as an HF directory together with
    the real SmolLM2 tokenizer, so the CLI path (tokenise, profile, convert) runs in seconds."""
    from transformers import AutoTokenizer

    from rfkit.hub import EMBEDDED_MODEL, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL))
    torch.manual_seed(0)
    config = LlamaConfig(**dict(TINY, vocab_size=len(tokenizer)), num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A local JSONL corpus: enough text for calibration, validation and training blocks."""
    import json
    import random

    rng = random.Random(0)
    words = "the a river city music war king light north ancient modern small great people water".split()
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(400):
            text = " ".join(rng.choice(words) for _ in range(60))
            f.write(json.dumps({"title": f"doc {i}", "text": text}) + "\n")
    return path


@pytest.fixture(scope="session")
def converted_dir(tiny_model_dir, tiny_corpus, tmp_path_factory):
    """The tiny GQA llama (4 heads, 2 KV heads, head_dim 16) converted by ``rfkit convert``
    with the SmolLM2 recipe's settings; tests only read it."""

    root = tmp_path_factory.mktemp("converted")
    out = root / "conv"
    try:
        main(["convert", *tiny_args(tiny_model_dir, tiny_corpus, root), "--output", str(out)])
    except SystemExit as exit:
        assert not exit.code
    return out


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """Send the packed-block cache to a temp dir shared by the requesting module's tests."""
    # TextDataModule.cache_path looks data_cache_dir up in rfkit.data.datamodule
    from rfkit.data import datamodule as data

    root = tmp_path_factory.mktemp("data-cache")
    mp = pytest.MonkeyPatch()
    mp.setattr(data, "data_cache_dir", lambda: root)
    yield root
    mp.undo()
