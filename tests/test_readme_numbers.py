"""The README's speed and memory tables of the trained default are rendered from the result files
that ``rfkit bench speed`` / ``rfkit bench cache`` wrote (benchmarks/speed_tables.py): a page that
disagrees with its files fails here."""

from __future__ import annotations

import importlib.util

from helpers import ROOT


def _renderer():
    spec = importlib.util.spec_from_file_location("speed_tables", ROOT / "benchmarks" / "speed_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_speed_and_memory_tables_are_the_rendered_result_files():
    tables = _renderer()
    readme = (ROOT / "README.md").read_text()
    for table in (tables.speed_table(), tables.memory_table()):
        assert table in readme, f"README.md is out of date; paste the output of python benchmarks/speed_tables.py:\n{table}"


def test_the_docs_speed_tables_are_the_same_files():
    tables = _renderer()
    trained = (ROOT / "docs" / "trained.md").read_text()
    assert tables.speed_table() in trained and tables.memory_table() in trained
