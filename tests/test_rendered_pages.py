"""Every table of measured numbers in README.md and docs/ is rendered from the result files under
benchmarks/results by ``python benchmarks/render.py``: a page that disagrees with its files, a
table that is neither rendered nor marked static, or a result file that does not name the command
that wrote it, fails here."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from helpers import ROOT


def _render_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("rf_render", ROOT / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _render_module()
PAGES = render.pages()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_rendered_block_equals_its_result_files(page):
    text = page.read_text()
    new = render.rendered_page(text, page.name)
    if new != text:
        diff = [f"- {a}\n+ {b}" for a, b in zip(text.split("\n"), new.split("\n")) if a != b][:5]
        pytest.fail(f"{page.relative_to(ROOT)} differs from its result files; run python benchmarks/render.py\n" + "\n".join(diff))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_table_is_rendered_or_marked_static(page):
    bad = render.unrendered_tables(page.read_text())
    assert not bad, (
        f"{page.relative_to(ROOT)}: the tables at lines {bad} are not rendered from result files; render them "
        f"(benchmarks/tables/) or, if they hold no measurement, put '{render.STATIC}' right above them"
    )


def test_the_pages_render_tables_and_every_renderer_is_used():
    used = {name for page in PAGES for name, _, _ in render.blocks(page.read_text(), page.name)}
    import tables

    assert used, "no page holds a rendered block"
    assert set(tables.names()) <= used, f"renderers no page uses: {sorted(set(tables.names()) - used)}"


def test_every_source_names_its_command_date_commit_and_wall_time():
    import tables

    for name in tables.names():
        _, paths = tables.render(name)
        for path in paths:
            prov = json.loads(path.read_text())["provenance"]
            where = path.relative_to(ROOT)
            assert prov.get("command", "").split()[0] in ("rfkit", "python"), f"{where}: command {prov.get('command')!r}"
            assert len(prov.get("commit") or "") == 40, f"{where}: commit {prov.get('commit')!r}"
            assert (prov.get("date") or "")[:2] == "20", f"{where}: date {prov.get('date')!r}"
            assert "wall_seconds" in prov, f"{where}: no wall time"


def test_a_stale_block_is_rewritten_and_a_missing_end_marker_is_an_error():
    import tables

    name = tables.names()[0]
    page = f"intro\n<!-- rendered: {name} -->\n| stale | 0 |\n<!-- /rendered -->\nafter\n"
    new = render.rendered_page(page, "page")
    assert "| stale | 0 |" not in new and new.startswith("intro\n") and new.endswith("<!-- /rendered -->\nafter\n")
    assert render.rendered_page(new, "page") == new
    with pytest.raises(render.PageError, match="no '<!-- /rendered -->'"):
        render.blocks(f"<!-- rendered: {name} -->\n| x |\n", "page")
    assert render.unrendered_tables("text\n| a |\n|---|\n") == [2]
    assert render.unrendered_tables(f"{render.STATIC}\n| a |\n|---|\n") == []


def test_the_demo_screen_shows_rfkits_lines_and_no_lightning_summary_or_epoch_bar():
    screen = (ROOT / "benchmarks" / "results" / "demo_smollm2_b05_amx_train_kernel" / "screen.txt").read_text()
    assert "rfkit fit: done in" in screen and "rfkit: train" in screen and "rfkit: save" in screen
    for noise in ("Total FLOPs", "| Name", "Epoch 0", "Trainable params"):
        assert noise not in screen, f"the demo screen shows Lightning's {noise!r}"


def test_the_demo_screen_keeps_each_bar_at_its_last_state_and_drops_transient_bars():
    spec = importlib.util.spec_from_file_location("rf_demo_screen", ROOT / "benchmarks" / "demo_screen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    captured = (
        "rfkit: load   0.1 s\n"
        "transfer: train:   0%|   | 0/2 [00:00<?, ?step/s]\rtransfer: train:  50%|#  | 1/2\n"
        "transfer: train: 100%|## | 2/2 [00:02<00:00]\n"
        "\n"
        "Validation DataLoader 0:  50%|#  | 1/2\n"
        "train (steps): 100%|## | 20/20\n"
        "rfkit fit: done in 8 min\n"
    )
    assert module.screen(captured) == (
        "rfkit: load   0.1 s\ntransfer: train: 100%|## | 2/2 [00:02<00:00]\n\ntrain (steps): 100%|## | 20/20\nrfkit fit: done in 8 min\n"
    )
