"""The screen of a real ``make demo`` (``rfkit fit --config recipes/smollm2_b05.yaml``), in the README."""

from __future__ import annotations

from tables import RESULTS, load, table

FOLDER = "demo_smollm2_b05_amx_train_kernel"


@table("demo_screen")
def demo_screen() -> str:
    """``screen.txt`` is what the terminal showed, start to end (progress bars at their last state);
    ``summary.json`` is the run's own summary, whose provenance names the command."""
    load(f"{FOLDER}/summary.json")
    screen = (RESULTS / FOLDER / "screen.txt").read_text().rstrip("\n")
    return "```\n" + screen + "\n```"
