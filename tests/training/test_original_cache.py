"""The original model's validation perplexity is measured once per model, data, dtype and device,
then reused from rfkit's cache (as the head profile is): a fit spends its first half-minute on it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import run_cli, tiny_args

import rfkit.callbacks.perplexity as perplexity
from rfkit.callbacks import PerplexityMonitor


@pytest.mark.slow
def test_a_second_fit_reuses_the_original_models_perplexity(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    real, calls = perplexity.evaluate_perplexity, []

    def counting(model, loader, max_batches, desc):
        calls.append(desc)
        return real(model, loader, max_batches, desc)

    monkeypatch.setattr(perplexity, "evaluate_perplexity", counting)
    measured = []
    for i, extra in enumerate([[], [], ["--model.reuse_profile", "false"]]):
        root = tmp_path / f"run{i}"
        code, _, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, root), *extra], capsys)
        assert code == 0, err
        measured.append(json.loads(next(root.rglob("summary.json")).read_text())["ppl_original"])
    assert calls.count("perplexity (original)") == 2  # the first fit and the one told not to reuse
    assert calls.count("perplexity (converted)") == 3
    assert measured[1] == measured[0] and measured[2] == pytest.approx(measured[0], rel=1e-6)
    assert len(list((tmp_path / "cache" / "original_ppl").glob("*.json"))) == 1


def test_the_cache_key_follows_model_data_dtype_and_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path))
    model = torch.nn.Linear(2, 2)
    module = SimpleNamespace(base_model="some/model", model=model)
    data = SimpleNamespace(fingerprint=lambda: "abc", val_blocks=8, batch_size=2)
    path = PerplexityMonitor().original_cache_path(module, data)
    assert path.parent == tmp_path / "original_ppl"
    others = [
        PerplexityMonitor(max_batches=2).original_cache_path(module, data),
        PerplexityMonitor().original_cache_path(SimpleNamespace(base_model="other/model", model=model), data),
        PerplexityMonitor().original_cache_path(module, SimpleNamespace(fingerprint=lambda: "abd", val_blocks=8, batch_size=2)),
        PerplexityMonitor().original_cache_path(module, SimpleNamespace(fingerprint=lambda: "abc", val_blocks=4, batch_size=2)),
        PerplexityMonitor().original_cache_path(SimpleNamespace(base_model="some/model", model=model.to(torch.bfloat16)), data),
    ]
    assert len({path, *others}) == 6
    assert PerplexityMonitor().original_cache_path(SimpleNamespace(base_model=None, model=model), data) is None
