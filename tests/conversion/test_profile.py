import math

import pytest
import torch
from helpers import random_ids, tiny_model

from rfkit.conversion.profile import attention_entropy, profile_heads, recency_ratio

# One head, 4 tokens, causal rows summing to 1.
A = torch.tensor(
    [
        [1.0, 0.0, 0.0, 0.0],
        [0.5, 0.5, 0.0, 0.0],
        [0.6, 0.1, 0.3, 0.0],
        [0.4, 0.1, 0.2, 0.3],
    ]
)[None]


def test_rr_hand_computed_without_first_token_exclusion():
    # window 1: entries with |i-j| <= 1 sum to 1 + 1 + 0.4 + 0.5 = 2.9 over a total of 4
    assert recency_ratio(A, window=1, exclude_first_token=False).item() == pytest.approx(2.9 / 4)


def test_rr_hand_computed_with_first_token_exclusion():
    # row 0 and column 0 dropped: numerator 0.5 + 0.4 + 0.5 = 1.4, denominator 0.5 + 0.4 + 0.6 = 1.5
    assert recency_ratio(A, window=1, exclude_first_token=True).item() == pytest.approx(1.4 / 1.5)


def test_rr_window_covering_everything_is_one():
    assert recency_ratio(A, window=3, exclude_first_token=False).item() == pytest.approx(1.0)
    assert recency_ratio(A, window=0, exclude_first_token=False).item() == pytest.approx((1 + 0.5 + 0.3 + 0.3) / 4)


@pytest.mark.parametrize("exclude", [True, False])
def test_chunked_profile_matches_full_attention_matrices(exclude):
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    ids = random_ids(3, 40)
    profile = profile_heads(model, [{"input_ids": ids}], window=5, alpha=0.3, exclude_first_token=exclude, chunk=7, progress=False)
    model.set_attn_implementation("eager")
    attentions = model(ids, output_attentions=True).attentions
    rr = torch.stack([recency_ratio(a, 5, exclude) for a in attentions], 1)  # (B, layers, H)
    torch.testing.assert_close(torch.tensor(profile.rr_mean, dtype=torch.float64), rr.mean(0).double(), atol=1e-5, rtol=1e-5)
    assert profile.rai == (rr > 0.3).sum(0).tolist()
    assert profile.samples == 3 and profile.seq_len == 40


def test_profiling_attention_gives_the_same_logits_and_restores_the_model():
    model = tiny_model("qwen2", num_heads=4, num_kv_heads=1)
    ids = random_ids(2, 33)
    before = model(ids).logits
    impl = model.config._attn_implementation
    from rfkit.conversion import profile as prof

    captured = {}
    original = prof._RecencyCollector.attend

    def spy(self, module, q, k, v, scaling):
        out = original(self, module, q, k, v, scaling)
        captured.setdefault(module.layer_idx, out)
        return out

    prof._RecencyCollector.attend = spy
    try:
        profile_heads(model, [{"input_ids": ids}], window=4, alpha=0.5, chunk=8, progress=False)
    finally:
        prof._RecencyCollector.attend = original
    assert set(captured) == {0, 1}
    assert model.config._attn_implementation == impl
    torch.testing.assert_close(model(ids).logits, before)


def test_recency_is_found_in_a_banded_attention_pattern():
    """A head that only attends within the window must get RR 1 and count in RA-I."""
    L = 16
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    band = ((j <= i) & (i - j <= 2)).float()
    band = band / band.sum(-1, keepdim=True)
    uniform = (j <= i).float() / (i + 1).float()
    rr = recency_ratio(torch.stack([band, uniform]), window=2)
    assert rr[0].item() == pytest.approx(1.0)
    assert rr[1].item() < 0.5


def _h(*p):
    """Entropy (nats) of a distribution given as probabilities."""
    return -sum(x * math.log(x) for x in p if x > 0)


def test_entropy_of_uniform_attention_is_one_and_of_one_hot_attention_is_zero():
    L = 6
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    uniform = (j <= i).float() / (i + 1).float()
    diagonal = torch.eye(L)  # every row on its own token
    for exclude in (True, False):
        ent = attention_entropy(torch.stack([uniform, diagonal]), exclude_first_token=exclude)
        assert ent[0].item() == pytest.approx(1.0)
        assert ent[1].item() == pytest.approx(0.0)


def test_entropy_hand_computed():
    # rows 1..3 of A, normalised by log(2), log(3), log(4)
    rows = [_h(0.5, 0.5) / math.log(2), _h(0.6, 0.1, 0.3) / math.log(3), _h(0.4, 0.1, 0.2, 0.3) / math.log(4)]
    assert attention_entropy(A, exclude_first_token=False).item() == pytest.approx(sum(rows) / 3)
    # column 0 dropped, rows renormalised: row 2 is (0.25, 0.75) over 2 tokens, row 3 (1/6, 2/6, 3/6) over 3
    rows = [_h(0.25, 0.75) / math.log(2), _h(1 / 6, 2 / 6, 3 / 6) / math.log(3)]
    assert attention_entropy(A, exclude_first_token=True).item() == pytest.approx(sum(rows) / 2)


@pytest.mark.parametrize("exclude", [True, False])
def test_chunked_entropy_matches_full_attention_matrices(exclude):
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    ids = random_ids(3, 40)
    profile = profile_heads(model, [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}], window=5, alpha=0.3,
                            exclude_first_token=exclude, chunk=7, progress=False)  # fmt: skip
    model.set_attn_implementation("eager")
    attentions = model(ids, output_attentions=True).attentions
    ent = torch.stack([attention_entropy(a, exclude) for a in attentions], 1)  # (B, layers, H)
    assert len(profile.entropy_mean) == 2 and len(profile.entropy_mean[0]) == 4
    got = torch.tensor(profile.entropy_mean, dtype=torch.float64)
    torch.testing.assert_close(got, ent.mean(0), atol=1e-5, rtol=1e-5)
    assert profile.samples == 3


def test_profiles_cached_without_entropy_still_load_and_are_not_reused(tmp_path, monkeypatch):
    import hashlib
    import json

    from rfkit.conversion.convert import profile_cache_path
    from rfkit.conversion.headmap import load_profile

    old = {"window": 4, "alpha": 0.5, "exclude_first_token": True, "seq_len": 32, "samples": 4,
           "rai": [[1, 2]], "rr_mean": [[0.1, 0.2]], "meta": {}}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_profile(tmp_path / "old.json").entropy_mean == []
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path))
    settings = {"window": 4, "alpha": 0.5, "exclude_first_token": True}
    key = json.dumps({"model": "m", "data": "d", "samples": 4, **settings}, sort_keys=True)  # the key before entropy
    assert profile_cache_path("m", "d", settings, 4).stem != hashlib.sha1(key.encode()).hexdigest()[:16]
