"""The real embedded default: SmolLM2-135M-Instruct and English Wikipedia summaries, on CPU.

Kept small (128-token blocks, a few batches, two training steps) so that it runs in CI in
about a minute; the full recipe is `rfkit fit --config recipes/smollm2_b05.yaml`.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rfkit.cli import main

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def test_smollm2_wikipedia_fit_end_to_end(tmp_path, capsys):
    main([
        "fit", "--config", str(ROOT / "recipes" / "smollm2_b05.yaml"),
        "--data.seq_len", "128",
        "--data.batch_size", "2",
        "--data.calibration_samples", "8",
        "--data.val_blocks", "4",
        "--model.policy.init_args.window", "13",
        "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path),
    ])  # fmt: skip
    summary_path = next(tmp_path.rglob("summary.json"))
    summary = json.loads(summary_path.read_text())
    # a real pretrained model on real English text: perplexity in a sane range
    assert 3.0 < summary["ppl_original"] < 80.0
    assert summary["ppl_converted"] > 0
    # beta 0.5 of 90 KV groups (30 layers x 3) = 45 whole groups = 135 of 270 query heads
    assert summary["total_heads"] == 270 and summary["replaced_heads"] == 135
    # SmolLM2: 30 layers x 3 KV heads x (K, V) x 64 dims x 4 bytes per token, half of it kept
    assert summary["cache_bytes_per_token_original"] == 30 * 3 * 2 * 64 * 4
    assert summary["cache_bytes_per_token_converted"] == 30 * 3 * 2 * 64 * 4 / 2
    assert summary["params_removed"] > 0 and summary["params_added"] > 0

    run = summary_path.parent
    head_map = json.loads((run / "head_map.json").read_text())
    assert (head_map["num_layers"], head_map["num_heads"], head_map["num_kv_heads"]) == (30, 9, 3)
    for heads in head_map["selected"]:  # whole KV groups only: {0,1,2}, {3,4,5}, {6,7,8}
        assert len(heads) % 3 == 0 and all(sorted(heads[i : i + 3]) == list(range(heads[i], heads[i] + 3)) for i in range(0, len(heads), 3))
    rr = torch.tensor(head_map["rr_mean"])
    assert rr.min() >= 0 and rr.max() <= 1 and rr.max() > 0.6  # recency-aware heads exist

    import rfkit  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(str(run / "model"))
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    assert torch.isfinite(model(ids).logits).all()
