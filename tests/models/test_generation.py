"""generate() on converted models: left padding, sampling, user caches, decode steps, use_cache.

All models are the tiny random ones of ``conftest`` (2 layers, width 64, head_dim 16), converted
with a small Mamba mixer. Two layouts are used throughout:

* ``GQA``: Llama, 4 query / 2 KV heads, layer 0 has *all* heads replaced (no kept heads, no K/V in
  the cache), layer 1 keeps heads 0 and 3 next to a mixer for heads 1 and 2.
* ``MHA``: Llama, 4 / 4 heads, layer 0 shares mixer (heads 1, 2) and attention (heads 0, 3),
  layer 1 has all heads replaced.

A random tiny model barely uses its mixers (std-0.02 V and W_O times a small ``out_proj``): a
wrong mixer state shows up around 1e-5 in the logits, below any sensible tolerance. ``build``
therefore scales V, W_O and the mixers' ``out_proj`` by ``LOUD`` so that a mixer that reads pad
tokens moves the logits by > 1e-3; every padding test checks that sensitivity explicitly by
running once more with the mask withheld from the mixers (the behaviour before the fix).

Tolerances: float32 logits padded vs unpadded agree to ~2e-7 (asserted at atol 1e-5); float64
step-by-step decoding agrees with full forwards at atol 1e-8.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids, tiny_model
from transformers import DynamicCache, StaticCache

from rfkit.models.cache import mixer_state_store
from rfkit.models.modeling import TOKEN_MASK_KWARG, RecurFormerAttention, to_recurformer
from rfkit.models.operators import MambaOperator

GQA = ("llama", 4, 2, [[0, 1, 2, 3], [1, 2]])
MHA = ("llama", 4, 4, [[1, 2], [0, 1, 2, 3]])
LAYOUTS = {"gqa": GQA, "mha": MHA}
LOUD = 4.0
PAD = 0
ATOL32 = 1e-5  # float32 logits, padded vs unpadded (observed <= 2e-7)
SENSITIVE = 1e-3  # the same logits with the mask withheld from the mixers differ by more than this
ATOL64 = 1e-8  # float64 logits, cached decoding vs full forward


def build(layout: str = "gqa", dtype=torch.float32, selected=None):
    """A converted tiny model in eval mode with audible mixers (see module docstring);
    ``selected`` overrides the layout's replaced heads."""
    family, heads, kv, default = LAYOUTS[layout]
    selected = default if selected is None else selected
    model = tiny_model(family, heads, kv)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(LOUD)
            layer.self_attn.o_proj.weight.mul_(LOUD)
    model = to_recurformer(model, selected, MambaOperator(d_state=4, zero_init_output=False))
    with torch.no_grad():
        for attn in rf_layers(model):
            attn.mixer.out_proj.weight.mul_(LOUD)
    # Random models emit eos (id 2) early; never stop before max_new_tokens, and pad with PAD.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.to(dtype).eval()


def rf_layers(model) -> list[RecurFormerAttention]:
    return [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, RecurFormerAttention)]


def prompts() -> list[torch.Tensor]:
    """Two prompts of different lengths (5 and 9 tokens)."""
    return [random_ids(1, 5, seed=3)[0], random_ids(1, 9, seed=4)[0]]


def left_pad(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of the sequences left-padded with PAD to the longest."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - len(s) :] = s
        mask[row, width - len(s) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as generate() builds them (pads at 0)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.fixture
def mask_ignored(monkeypatch):
    """Call to make the mixers ignore the token mask from then on: the behaviour before the fix."""

    def apply():
        original = RecurFormerAttention._mix
        monkeypatch.setattr(RecurFormerAttention, "_mix", lambda self, x, cache, mask=None: original(self, x, cache))

    return apply


# -- a. left padding ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["gqa", "mha"])
@torch.no_grad()
def test_left_padded_prompt_logits_equal_the_unpadded_prompt(layout, mask_ignored):
    """Last prompt position's logits of each row of a left-padded batch equal the prompt run alone;
    with the mask withheld from the mixers, the padded row's logits move by > SENSITIVE."""
    model = build(layout)
    seqs = prompts()
    ids, mask = left_pad(seqs)
    alone = torch.cat([model(s[None]).logits[:, -1] for s in seqs])  # (2, V)
    padded = model(ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]
    torch.testing.assert_close(padded, alone, atol=ATOL32, rtol=0)

    mask_ignored()
    leaky = model(ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]
    assert (leaky[0] - alone[0]).abs().max() > SENSITIVE  # row 0 has 4 pad tokens
    torch.testing.assert_close(leaky[1], alone[1], atol=ATOL32, rtol=0)  # row 1 has none


@pytest.mark.parametrize("layout", ["gqa", "mha"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_greedy_generate_equals_each_prompt_alone(layout, use_cache):
    """Greedy tokens of a left-padded batch == generating each prompt alone (batch 1, no padding),
    with the cache (prefill + mixer steps) and without (full forwards of the growing batch)."""
    model = build(layout)
    seqs = prompts()
    ids, mask = left_pad(seqs)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=use_cache)
    for row, s in enumerate(seqs):
        alone = model.generate(s[None], max_new_tokens=6, do_sample=False)
        assert torch.equal(out[row, ids.shape[1] :], alone[0, len(s) :]), row


def test_ignoring_the_mask_changes_greedy_tokens(mask_ignored):
    """The greedy test above is sensitive: with the mixers reading the pad tokens (GQA layout),
    the padded row's generated tokens change."""
    model = build("gqa")
    seqs = prompts()
    ids, mask = left_pad(seqs)
    alone = model.generate(seqs[0][None], max_new_tokens=6, do_sample=False)[0, len(seqs[0]) :]
    mask_ignored()
    leaky = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
    assert not torch.equal(leaky, alone)


def test_generate_passes_positions_and_the_token_mask_to_the_mixers():
    """What reaches the layers during a left-padded generate(): position_ids built from the mask
    (pads at 0, so kept heads see the same RoPE positions as unpadded), the prefill chunk's token
    mask at every mixer, and no mask on decode steps (the mixer's ``step`` runs)."""
    model = build("mha")
    ids, mask = left_pad(prompts())
    seen_positions, mixer_masks, steps = [], [], []
    model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen_positions.append(kwargs.get("position_ids")), with_kwargs=True
    )
    for attn in rf_layers(model):
        attn.mixer.register_forward_pre_hook(
            lambda mod, args, kwargs: mixer_masks.append(kwargs.get("mask")), with_kwargs=True
        )
        step = attn.mixer.step
        attn.mixer.step = lambda *a, _step=step, **k: (steps.append(1), _step(*a, **k))[1]
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(seen_positions[0], positions(mask))
    assert len(mixer_masks) == 2 and all(torch.equal(m, mask) for m in mixer_masks)  # prefill, 2 layers
    assert len(steps) == 2 * 2  # 2 decode forwards x 2 converted layers

    # An unpadded batch: the common path passes no mask at all.
    mixer_masks.clear()
    model.generate(ids, attention_mask=torch.ones_like(mask), max_new_tokens=1, do_sample=False)
    assert mixer_masks == [None, None]


@torch.no_grad()
def test_forward_without_mask_and_training_with_padding_still_work():
    """The extra keyword must not break a plain training forward, a padded training forward with
    labels (the keyword also reaches the loss function), or a model with an unconverted layer
    (whose stock attention receives and ignores it)."""
    model = build("gqa", selected=[[0, 1], []]).train()
    ids, mask = left_pad(prompts())
    with torch.enable_grad():
        assert model(ids).logits.shape == (2, 9, 128)
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
    assert all(p.grad is not None for attn in rf_layers(model) for p in attn.mixer.parameters())
    # The keyword may also be given explicitly (a full-width 2-D mask); it is then what the mixers get.
    model.eval()
    given = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
    explicit = model(ids, attention_mask=mask, position_ids=positions(mask), **{TOKEN_MASK_KWARG: mask}).logits
    assert torch.equal(explicit, given)


# -- b. sampling ----------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_sampling_equals_a_manual_loop_of_full_forwards(padded):
    """do_sample with temperature 0.8 and top-k 20 draws exactly the tokens of a loop that runs a
    full forward (no cache) on the growing sequence, divides by the temperature, keeps the top 20
    logits and calls torch.multinomial, from the same seed (HF applies temperature then top-k, then
    softmax and one multinomial per step; nothing else consumes the RNG)."""
    model = build("gqa")
    with torch.no_grad():  # logits of std ~3 instead of ~0.15: peaked distributions, so that a wrong
        model.lm_head.weight.mul_(20.0)  # temperature or top-k in either loop changes the draws
    if padded:
        ids, mask = left_pad(prompts())
    else:
        ids = random_ids(8, 6, seed=5)  # 8 rows x 8 steps = 64 draws
        mask = torch.ones_like(ids)
    torch.manual_seed(1234)
    out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=8)

    torch.manual_seed(1234)
    seq, m = ids, mask
    for _ in range(8):
        logits = model(seq, attention_mask=m, position_ids=positions(m)).logits[:, -1].float() / 0.8
        kth = logits.topk(20, dim=-1).values[:, -1:]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1)], dim=1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
    assert torch.equal(out, seq)


# -- c. user-passed caches ------------------------------------------------------------------------
@pytest.mark.parametrize("selected", [[[0, 1], []], GQA[3]])
def test_user_dynamic_cache_gives_the_default_tokens_and_holds_the_right_state(selected):
    """generate(past_key_values=DynamicCache(config=...)) == the default; afterwards the cache holds
    mixer states for exactly the converted layers, and each layer's K/V only its kept KV heads."""
    model = build("gqa", selected=selected)
    ids, mask = left_pad(prompts())
    default = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    cache = DynamicCache(config=model.config)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert torch.equal(out, default)

    converted = {i for i, heads in enumerate(selected) if heads}
    store = mixer_state_store(cache)
    assert set(store) == converted
    tokens = ids.shape[1] + 6 - 1  # the last sampled token is never fed back
    assert cache.get_seq_length() == tokens  # also when layer 0 has no kept heads
    for i, layer in enumerate(model.model.layers):
        keys = cache.layers[i].keys
        attn = layer.self_attn
        kv_heads = len(attn.kept_kv_heads) if i in converted else 2
        assert cache.layers[i].get_seq_length() == tokens, i
        if kv_heads:
            assert tuple(keys.shape) == (2, kv_heads, tokens, 16), i
        else:  # no kept heads: zero-head K/V for the prompt, the decode tokens counted on the host
            assert tuple(keys.shape) == (2, 0, ids.shape[1], 16), i
        if i in converted:
            conv, ssm = store[i]
            assert conv.shape == (2, attn.mixer.d_inner, attn.mixer.d_conv)
            assert ssm.shape == (2, attn.mixer.d_inner, attn.mixer.d_state)


@pytest.mark.parametrize("layout", ["gqa", "mha"])
def test_static_cache_works_with_headless_layers_and_left_padding(layout):
    """cache_implementation="static" (a StaticCache sized per layer from the first update, so a
    layer with 0 or fewer kept KV heads just allocates fewer) gives the default greedy tokens for a
    left-padded batch. generate hands a compileable cache a 4-D attention_mask, so the 2-D mask
    must come through prepare_inputs_for_generation: checked at the mixers."""
    model = build(layout)
    ids, mask = left_pad(prompts())
    default = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    mixer_masks = []
    for attn in rf_layers(model):
        attn.mixer.register_forward_pre_hook(
            lambda mod, args, kwargs: mixer_masks.append(kwargs.get("mask")), with_kwargs=True
        )
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        cache_implementation="static",
        return_dict_in_generate=True,
    )
    assert isinstance(out.past_key_values, StaticCache)
    assert torch.equal(out.sequences, default)
    assert len(mixer_masks) == 2 and all(torch.equal(m, mask) for m in mixer_masks)
    heads = [tuple(layer.keys.shape[:2]) for layer in out.past_key_values.layers]
    assert heads == [(2, len(attn.kept_kv_heads)) for attn in rf_layers(model)]


# -- d. step-by-step decoding -------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["gqa", "mha"])
@torch.no_grad()
def test_float64_decode_steps_equal_full_forward(layout):
    """Prefill 6 tokens, then one token at a time through a DynamicCache, without position_ids
    (the model derives them from the cache length, which must count tokens even when layer 0 has
    no kept heads), equals one full forward at atol 1e-8 in float64."""
    model = build(layout, torch.float64)
    ids = random_ids(2, 14, seed=6)
    full = model(ids).logits
    cache = DynamicCache()
    pieces = [model(ids[:, :6], past_key_values=cache, use_cache=True).logits]
    for t in range(6, 14):
        pieces.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=ATOL64, rtol=0)


@pytest.mark.parametrize("layout", ["gqa", "mha"])
@torch.no_grad()
def test_float64_padded_decode_steps_equal_the_unpadded_full_forward(layout):
    """A left-padded batch decoded step by step (growing mask and positions, as generate does)
    gives, for each row's real tokens, the logits of that row's unpadded full forward."""
    model = build(layout, torch.float64)
    seqs = [random_ids(1, 12, seed=7)[0], random_ids(1, 7, seed=8)[0]]
    prompt = [s[:-4] for s in seqs]  # the last 4 tokens of each row are fed one by one
    ids, mask = left_pad(prompt)
    cache = DynamicCache()
    logits = [model(ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache).logits]
    for t in range(4):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = torch.stack([s[len(s) - 4 + t] for s in seqs])[:, None]
        logits.append(
            model(step, attention_mask=mask, position_ids=positions(mask)[:, -1:], past_key_values=cache).logits
        )
    logits = torch.cat(logits, 1)  # (2, width, V)
    for row, s in enumerate(seqs):
        torch.testing.assert_close(logits[row, -len(s) :], model(s[None]).logits[0], atol=ATOL64, rtol=0)


@torch.no_grad()
def test_mha_and_padded_greedy_generate_equal_the_argmax_chain_of_full_forwards():
    """test_modeling covers GQA unpadded; here the MHA layout unpadded and the GQA layout padded
    (each full forward gets the padded mask and generate's positions)."""
    model = build("mha")
    ids = random_ids(1, 6, seed=9)
    seq = ids
    for _ in range(6):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), seq)

    model = build("gqa")
    ids, mask = left_pad(prompts())
    seq, m = ids, mask
    for _ in range(6):
        nxt = model(seq, attention_mask=m, position_ids=positions(m)).logits[:, -1].argmax(-1, keepdim=True)
        seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), seq)


# -- e. use_cache by default --------------------------------------------------------------------
def test_generate_uses_the_cache_and_the_mixer_step_by_default():
    """Without use_cache, generate returns a cache holding mixer states and runs each converted
    layer's mixer.step once per decode forward; with use_cache=False it never steps."""
    model = build("gqa")
    calls = []
    for attn in rf_layers(model):
        step = attn.mixer.step
        attn.mixer.step = lambda *a, _step=step, **k: (calls.append(1), _step(*a, **k))[1]
    ids = random_ids(2, 6, seed=10)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values is not None
    assert set(mixer_state_store(out.past_key_values)) == {0, 1}
    assert len(calls) == 2 * 4  # 2 converted layers x 4 decode forwards (the prefill is one forward)
    calls.clear()
    model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
    assert calls == []
