"""Beam search and the other batch operations of the cache move the mixer states with the K/V.

Beam search reorders the cache after every step (``Cache.reorder_cache``); the mixers' states
(Mamba's, the window's sink + ring, the hybrid's sums) sit beside the K/V on the same cache
object and must follow, or a beam continues from another beam's state. The check: the per-token
log-probabilities that ``generate`` reports along each returned beam
(``compute_transition_scores``) equal those of one full forward over that beam's sequence, in
float64 (``generate`` reports float32 scores), with enough new tokens that generated tokens have left the windows. A decoding mode
the states cannot support (assisted and prompt-lookup decoding crop the cache) is one error.
"""

from __future__ import annotations

import pytest
import torch
from helpers import loud_mixers, random_ids, tiny_model

from rfkit.models.cache import CacheCropError, mixer_state_store
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridMambaOperator, HybridOperator, MambaOperator, SinkRecentOperator

PROMPT, NEW, BEAMS = 10, 14, 3
OPERATORS = {
    "mamba": lambda: MambaOperator(d_state=4, zero_init_output=False),
    "sink_recent": lambda: SinkRecentOperator(sink=2, window=4),
    "hybrid": lambda: HybridOperator(sink=2, window=4, feature_dim=4, decay_horizon=8.0),
    "hybrid_mamba": lambda: HybridMambaOperator(sink=2, window=4, state_dim=4),
}


def loud_model(operator: str):
    """A tiny GQA Llama with one KV group of each layer replaced, the mixers' outputs made loud
    (random tiny models barely use them) and the hybrids' gates open, in float64."""
    model = tiny_model("llama", 4, 2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
    model = loud_mixers(to_recurformer(model, [[0, 1], [2, 3]], OPERATORS[operator]()))
    return model.double().eval()


def beams(model, ids):
    return model.generate(
        ids, num_beams=BEAMS, num_return_sequences=BEAMS, max_new_tokens=NEW, do_sample=False,
        output_scores=True, return_dict_in_generate=True, length_penalty=0.0,
    )  # fmt: skip


@pytest.mark.parametrize("operator", OPERATORS)
def test_beam_search_scores_equal_a_full_forward_along_every_beam(operator):
    model = loud_model(operator)
    ids = random_ids(1, PROMPT, seed=4)
    with torch.no_grad():
        out = beams(model, ids)
        steps = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
        assert out.sequences.shape == (BEAMS, PROMPT + NEW) and len({tuple(s.tolist()) for s in out.sequences}) == BEAMS
        reordered = 0
        for row, seq in enumerate(out.sequences):
            logp = model(seq[None]).logits[0].log_softmax(-1)
            want = logp[PROMPT - 1 : -1].gather(-1, seq[PROMPT:, None])[:, 0]
            torch.testing.assert_close(steps[row], want.float(), atol=1e-5, rtol=0)  # generate keeps float32 scores
            beam_path = out.beam_indices[row, :NEW]
            reordered += int((beam_path[1:] != beam_path[:-1]).any())
    assert reordered > 0  # some beam switched parents: the states had to move


def test_without_moving_the_states_the_scores_would_be_wrong(monkeypatch):
    """The check above can fail: with the states left in place (the behaviour before the cache
    moved them) the scores along some beam differ from the full forward."""
    from rfkit.models import cache

    monkeypatch.setattr(cache.MixerStatesCache, "_rows", lambda self, op: None)
    model = loud_model("hybrid")
    ids = random_ids(1, PROMPT, seed=4)
    with torch.no_grad():
        out = beams(model, ids)
        steps = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
        worst = 0.0
        for row, seq in enumerate(out.sequences):
            logp = model(seq[None]).logits[0].log_softmax(-1)
            want = logp[PROMPT - 1 : -1].gather(-1, seq[PROMPT:, None])[:, 0]
            worst = max(worst, float((steps[row] - want.float()).abs().max()))
    assert worst > 1e-3


def test_batch_select_and_repeat_move_the_states_and_crop_is_refused():
    model = loud_model("hybrid")
    ids = random_ids(2, PROMPT, seed=5)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        store = mixer_state_store(cache)
        before = {layer: tuple(t.clone() for t in states) for layer, states in store.items()}
        cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
        assert all(torch.equal(t, b.repeat_interleave(2, 0)) for layer in store for t, b in zip(store[layer], before[layer]))
        cache.batch_select_indices(torch.tensor([2]))  # the second prompt
        assert all(torch.equal(t, b[1:2]) for layer in store for t, b in zip(store[layer], before[layer]))
        assert cache.get_seq_length() == PROMPT and not cache.is_croppable
        cache.crop(0)  # removes nothing: allowed
        with pytest.raises(CacheCropError, match="cannot be cropped"):
            cache.crop(-1)
        cache.reset()
        assert not store and cache.get_seq_length() == 0


@pytest.mark.parametrize("mode", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_decoding_is_one_clear_error(mode):
    model = loud_model("hybrid")
    ids = random_ids(1, PROMPT, seed=4)
    extra = {"assistant_model": loud_model("hybrid")} if mode == "assistant_model" else {"prompt_lookup_num_tokens": 3}
    with torch.no_grad(), pytest.raises(ValueError, match="crop"):
        model.generate(ids, max_new_tokens=NEW, do_sample=False, **extra)
