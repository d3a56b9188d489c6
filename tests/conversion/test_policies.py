import pytest

from rfkit.conversion.policies import ExplicitHeads, PolicyError, RecencyRatioPolicy
from rfkit.conversion.profile import HeadProfile
from rfkit.models.layout import AttentionLayout, LayoutError

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


# -- the comparison policies ---------------------------------------------------------------------
from rfkit.conversion.policies import LayerwisePolicy, RandomHeads  # noqa: E402

DEEP = AttentionLayout("llama", num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)


def test_keep_layers_moves_the_budget_to_the_other_layers():
    # without keep_layers beta 0.5 takes L1G1 and L0G0; keeping layer 0 takes both groups of layer 1
    assert RecencyRatioPolicy(beta=0.5, keep_layers=[0]).select(LAYOUT, PROFILE) == [[], [0, 1, 2, 3]]
    assert RecencyRatioPolicy(beta=0.5, keep_layers=[0, 1]).select(LAYOUT, PROFILE) == [[], []]


def test_random_heads_is_seeded_counts_beta_and_respects_keep_layers():
    a = RandomHeads(beta=0.5, seed=3).select(DEEP, None)
    assert a == RandomHeads(beta=0.5, seed=3).select(DEEP, None)
    assert sum(len(s) for s in a) == 12  # 6 of 12 KV groups, 2 query heads each
    assert all(len(s) in (0, 2, 4) and s in ([], [0, 1], [2, 3], [0, 1, 2, 3]) for s in a)  # whole groups
    draws = {str(RandomHeads(beta=0.5, seed=s).select(DEEP, None)) for s in range(5)}
    assert len(draws) > 1
    kept = RandomHeads(beta=0.25, seed=0, granularity="query_head", keep_layers=[0, 5]).select(DEEP, None)
    assert kept[0] == [] and kept[5] == [] and sum(len(s) for s in kept) == 6


def test_layerwise_replaces_whole_layers():
    spread = LayerwisePolicy(beta=0.5).select(DEEP, None)
    assert [i for i, s in enumerate(spread) if s] == [1, 3, 5]  # interleaved, layer 0 kept
    assert all(s == [0, 1, 2, 3] for s in spread if s)
    assert [i for i, s in enumerate(LayerwisePolicy(beta=1 / 3).select(DEEP, None)) if s] == [2, 5]
    explicit = LayerwisePolicy(layers=[0, 4])
    assert [i for i, s in enumerate(explicit.select(DEEP, None)) if s] == [0, 4]
    assert explicit.beta == pytest.approx(2 / 6)
    assert LayerwisePolicy(beta=0.5, keep_layers=[1, 3]).layer_choice(DEEP, None) == [2, 4, 5]


def test_layerwise_recency_takes_the_layers_with_most_recency_aware_heads():
    policy = LayerwisePolicy(beta=0.5, choose="recency", window=4)
    assert policy.needs_profile and policy.profile_settings()["window"] == 4
    assert policy.select(LAYOUT, PROFILE) == [[], [0, 1, 2, 3]]  # layer 1's RA-I sum 25 > layer 0's 20
    assert LayerwisePolicy(beta=0.5).profile_settings() is None  # spread needs no profile


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: RandomHeads(beta=1.5), "model.policy.beta"),
        (lambda: RandomHeads(granularity="layer"), "model.policy.granularity"),
        (lambda: LayerwisePolicy(choose="best"), "model.policy.choose"),
        (lambda: LayerwisePolicy(layers=[-1]), "model.policy.layers"),
        (lambda: RecencyRatioPolicy(keep_layers="0"), "model.policy.keep_layers"),
        (lambda: LayerwisePolicy(layers=[7]).select(DEEP, None), "model.policy.layers"),
    ],
)
def test_bad_comparison_policy_settings_name_the_field(make, field):
    with pytest.raises(PolicyError, match=field):
        make()
