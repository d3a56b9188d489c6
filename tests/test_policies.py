import pytest

from rfkit.layout import AttentionLayout, LayoutError
from rfkit.policies import ExplicitHeads, PolicyError, RecencyRatioPolicy
from rfkit.profile import HeadProfile

# 2 layers, 4 query heads, 2 KV heads (groups {0,1}, {2,3})
LAYOUT = AttentionLayout("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
PROFILE = HeadProfile(
    window=4,
    alpha=0.5,
    exclude_first_token=True,
    seq_len=32,
    samples=10,
    rai=[[10, 9, 0, 1], [2, 3, 10, 10]],
    rr_mean=[[0.9, 0.8, 0.1, 0.2], [0.3, 0.4, 0.95, 0.9]],
)


def test_kv_group_global_takes_the_most_recency_aware_groups():
    # group scores: L0G0 19, L0G1 1, L1G0 5, L1G1 20 -> beta 0.5 of 4 groups: L1G1 then L0G0
    selected = RecencyRatioPolicy(beta=0.5).select(LAYOUT, PROFILE)
    assert selected == [[0, 1], [2, 3]]


def test_kv_group_beta_quarter_takes_the_single_best_group():
    assert RecencyRatioPolicy(beta=0.25).select(LAYOUT, PROFILE) == [[], [2, 3]]


def test_query_head_global():
    # RA-I 10 at L0H0, L1H2, L1H3 -> ties broken by rr_mean: L1H2 (0.95), L1H3 (0.9), L0H0 (0.9; earlier key wins)
    policy = RecencyRatioPolicy(beta=3 / 8, granularity="query_head")
    assert policy.select(LAYOUT, PROFILE) == [[0], [2, 3]]


def test_per_layer_scope_replaces_the_same_share_in_every_layer():
    policy = RecencyRatioPolicy(beta=0.5, granularity="query_head", scope="per_layer")
    assert policy.select(LAYOUT, PROFILE) == [[0, 1], [2, 3]]
    policy = RecencyRatioPolicy(beta=0.25, granularity="query_head", scope="per_layer")
    assert policy.select(LAYOUT, PROFILE) == [[0], [2]]


def test_beta_zero_and_one():
    assert RecencyRatioPolicy(beta=0.0).select(LAYOUT, PROFILE) == [[], []]
    assert RecencyRatioPolicy(beta=1.0).select(LAYOUT, PROFILE) == [[0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"beta": 1.5}, "model.policy.beta"),
        ({"beta": -0.1}, "model.policy.beta"),
        ({"alpha": 2}, "model.policy.alpha"),
        ({"window": 0}, "model.policy.window"),
        ({"granularity": "layer"}, "model.policy.granularity"),
        ({"scope": "local"}, "model.policy.scope"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(PolicyError) as err:
        RecencyRatioPolicy(**kwargs)
    assert str(err.value).startswith(field)
    assert "\n" not in str(err.value)


def test_explicit_heads_and_validation():
    policy = ExplicitHeads([[3, 1]])
    assert policy.select(LAYOUT, None) == [[1, 3], []]
    assert policy.beta == pytest.approx(2 / 8)
    with pytest.raises(PolicyError, match="layer 0"):
        ExplicitHeads([[4]]).select(LAYOUT, None)


def test_layout_rejects_unknown_model_types():
    class Cfg:
        model_type = "gpt2"

    with pytest.raises(LayoutError, match="gpt2"):
        AttentionLayout.from_config(Cfg())
