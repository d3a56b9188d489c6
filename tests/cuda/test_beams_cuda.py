"""Beam search on the device moves every mixer's state with the K/V (``Cache.reorder_cache``): the
log-probabilities ``generate`` reports along each returned beam equal one full forward's over that
beam on the same device, in float32, for every operator kind (tests/models/test_beams.py on the
CPU in float64, with the behaviour of transformers 5.24)."""

from __future__ import annotations

import pytest
import torch
from cuda_models import OPERATORS, converted
from helpers import random_ids

pytestmark = pytest.mark.cuda

PROMPT, NEW = 10, 14  # generated tokens leave the windows (sink + window <= 6)


@pytest.mark.parametrize("beams", [2, 3])
@pytest.mark.parametrize("kind", OPERATORS)
def test_beam_search_scores_equal_a_full_forward_along_every_beam(kind, beams, device):
    model = converted(kind).to(device)
    ids = random_ids(1, PROMPT, seed=4).to(device)
    with torch.no_grad():
        out = model.generate(
            ids, num_beams=beams, num_return_sequences=beams, max_new_tokens=NEW, do_sample=False,
            output_scores=True, return_dict_in_generate=True, length_penalty=0.0,
        )  # fmt: skip
        steps = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
        assert out.sequences.shape == (beams, PROMPT + NEW) and out.sequences.device.type == device.type
        assert len({tuple(s.tolist()) for s in out.sequences}) == beams
        reordered = 0
        for row, seq in enumerate(out.sequences):
            logp = model(seq[None]).logits[0].float().log_softmax(-1)
            want = logp[PROMPT - 1 : -1].gather(-1, seq[PROMPT:, None])[:, 0]
            torch.testing.assert_close(steps[row].float(), want, atol=1e-4, rtol=0)
            path = out.beam_indices[row, :NEW]
            reordered += int((path[1:] != path[:-1]).any())
    assert reordered > 0  # some beam switched parents: the states had to move
