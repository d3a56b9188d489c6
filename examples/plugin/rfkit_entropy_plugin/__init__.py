"""An example rfkit plugin: a policy that picks heads by attention entropy, and an operator
that replaces them with a gated per-channel exponential moving average.

Installed (``pip install examples/plugin``), this module is registered under the
``rfkit.plugins`` entry-point group, which rfkit imports before it reads a recipe; recipes
can then name both classes by their short name::

    model:
      policy:
        class_path: EntropyPolicy
        init_args: {beta: 0.25, prefer: high}
      operator:
        class_path: EMAOperator
        init_args: {expand: 1}

Only rfkit's public base classes are used: :class:`~rfkit.policies.HeadSelectionPolicy` and
:class:`~rfkit.operators.ReplacementOperator` (whose module docstring gives the mixer contract).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rfkit.operators import AttentionLayout, OperatorError, ReplacementOperator
from rfkit.policies import HeadProfile, HeadSelectionPolicy, PolicyError, RecencyRatioPolicy, units_to_heads

__all__ = ["EMAMixer", "EMAOperator", "EntropyPolicy"]
__version__ = "0.1.0"


# --------------------------------------------------------------------------- policy
class EntropyPolicy(HeadSelectionPolicy):
    """Replace the heads with the most diffuse attention (highest normalised attention entropy).

    A head's score is its mean normalised attention entropy over the calibration set
    (``profile.entropy_mean``: 1 is attention spread evenly over the prefix, 0 is attention on a
    single token; computed in :mod:`rfkit.conversion.profile`). ``prefer: high`` (the default) replaces the most
    diffuse heads: their output is close to an average over the context, which a recurrent
    state summarises well. Focused heads (retrieval, copying, strictly local) are kept. With
    ``exclude_first_token`` the attention sink (token 0) is left out of the entropy, so a sink
    head is judged by how it spreads the rest of its attention. ``prefer: low`` inverts the
    ranking (replace the most focused heads), for comparison.

    Args:
        beta: Fraction of units (KV groups or query heads) to replace, in [0, 1].
        prefer: ``high`` replaces the highest-entropy units, ``low`` the lowest.
        granularity: ``kv_group`` scores a KV group by its query heads' mean entropy and
            replaces whole groups (only this frees KV cache in GQA models); ``query_head``
            replaces single query heads.
        window: Profiling setting passed through to rfkit's profiler (the RR window; the
            entropy does not use it, but it is part of the cached profile's key).
        alpha: Profiling setting passed through (the RA-I threshold; not used for entropy).
        exclude_first_token: Leave token 0 out of each row's entropy (rows renormalised).
    """

    needs_profile = True

    def __init__(
        self,
        beta: float = 0.5,
        prefer: Literal["high", "low"] = "high",
        granularity: Literal["kv_group", "query_head"] = "kv_group",
        window: int = 51,
        alpha: float = 0.5,
        exclude_first_token: bool = True,
    ):
        super().__init__(beta)
        if prefer not in ("high", "low"):
            raise PolicyError(f"model.policy.prefer: {prefer!r} is not allowed; allowed: high, low")
        self.prefer = prefer
        # validates window, alpha and granularity with rfkit's own messages
        self._profile = RecencyRatioPolicy(
            window=window, alpha=alpha, beta=beta, exclude_first_token=exclude_first_token, granularity=granularity
        )
        self.granularity = granularity

    def profile_settings(self) -> dict:
        return self._profile.profile_settings()  # window, alpha, exclude_first_token

    def describe(self) -> dict:
        return {**super().describe(), **self.profile_settings(), "prefer": self.prefer, "granularity": self.granularity}

    def unit_scores(self, layout: AttentionLayout, profile: HeadProfile) -> dict[tuple[int, int], float]:
        """(layer, unit) -> mean normalised entropy, where a unit is a KV group or a query head."""
        ent = profile.entropy_mean
        if self.granularity == "query_head":
            return {(layer, h): ent[layer][h] for layer in range(layout.num_layers) for h in range(layout.num_heads)}
        scores = {}
        for layer in range(layout.num_layers):
            for g in range(layout.num_kv_heads):
                heads = layout.query_heads_of(g)
                scores[(layer, g)] = sum(ent[layer][h] for h in heads) / len(heads)
        return scores

    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> list[list[int]]:
        if profile is None or not getattr(profile, "entropy_mean", None):
            raise PolicyError(
                "model.policy: EntropyPolicy needs attention entropy in the head profile, which this profile "
                "lacks (made by an older rfkit); profile again (model.reuse_profile: false)"
            )
        if len(profile.entropy_mean) != layout.num_layers:
            raise PolicyError(
                f"model.policy: the profile has entropy for {len(profile.entropy_mean)} layers, "
                f"the model has {layout.num_layers}"
            )
        scores = self.unit_scores(layout, profile)
        n = min(len(scores), int(math.floor(self.beta * len(scores) + 0.5)))  # round half up, as rfkit does
        sign = -1.0 if self.prefer == "high" else 1.0
        chosen = sorted(scores, key=lambda unit: (sign * scores[unit], unit))[:n]  # ties: earlier unit
        return units_to_heads(layout, chosen, self.granularity)


# --------------------------------------------------------------------------- operator
def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OperatorError(f"model.operator.{name}: {value!r} is not allowed; must be an integer >= 1")
    return value


class EMAMixer(nn.Module):
    """Gated per-channel linear recurrence: (B, L, d_in) -> (B, L, d_out).

    ``u, z = in_proj(x)``; ``h_t = a * h_{t-1} + (1 - a) * u_t`` with a learned decay
    ``a = sigmoid(decay_logit)`` in (0, 1) per channel; ``y_t = out_proj(h_t * silu(z_t))``.
    The state is ``(h,)``, ``h`` (B, d_inner). Initial decays span time scales
    ``1 / (1 - a)`` from 2 to ``max_timescale`` tokens, log-spaced over the channels.

    The sequence is processed in chunks of ``chunk_size`` tokens; inside a chunk every state
    comes at once from pairwise decay weights ``exp(cum_t - cum_s)`` (exponents <= 0, so
    nothing overflows). A pad token (``mask`` 0) gets decay 1 and input weight 0, so it
    leaves the state untouched.
    """

    def __init__(self, d_in: int, d_out: int, expand: int = 1, max_timescale: float = 256.0, chunk_size: int = 64,
                 layer_idx: int | None = None):  # fmt: skip
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.d_inner = expand * d_in
        self.chunk_size, self.layer_idx = chunk_size, layer_idx
        self.in_proj = nn.Linear(d_in, 2 * self.d_inner, bias=False)
        self.out_proj = nn.Linear(self.d_inner, d_out, bias=False)
        tau = torch.exp(torch.linspace(math.log(2.0), math.log(max_timescale), self.d_inner))
        self.decay_logit = nn.Parameter(torch.log(tau - 1.0))  # sigmoid(log(tau - 1)) = 1 - 1 / tau
        self.decay_logit._no_weight_decay = True

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, d_inner={self.d_inner}"

    def _cdt(self) -> torch.dtype:
        return torch.float64 if self.decay_logit.dtype == torch.float64 else torch.float32

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        """Bytes of one state ``(h,)`` for ``batch_size`` sequences stored in ``dtype``."""
        return int(batch_size) * self.d_inner * torch.empty((), dtype=dtype).element_size()

    def allocate_inference_cache(self, batch_size: int, dtype=None, device=None):
        w = self.decay_logit
        return (torch.zeros(batch_size, self.d_inner, dtype=dtype or w.dtype, device=device or w.device),)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None, mask=None, return_states: bool = False):
        """x (B, L, d_in) -> (B, L, d_out) [, (h,)]. ``h`` (B, d_inner) continues a previous
        chunk (not modified). ``mask`` (B, L), 1 for real tokens."""
        if x.dim() != 3 or x.shape[-1] != self.d_in:
            raise ValueError(f"x must be (batch, length, {self.d_in}), got {tuple(x.shape)}")
        bsz, length, _ = x.shape
        if mask is not None and tuple(mask.shape) != (bsz, length):
            raise ValueError(f"mask must be (batch, length) = {(bsz, length)}, got {tuple(mask.shape)}")
        if h is not None and tuple(h.shape) != (bsz, self.d_inner):
            raise ValueError(f"h must be {(bsz, self.d_inner)}, got {tuple(h.shape)}")
        cdt = self._cdt()
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, d_inner) each
        log_a = F.logsigmoid(self.decay_logit.to(cdt)).expand(bsz, length, -1)  # (B, L, d_inner), < 0
        gain = torch.sigmoid(-self.decay_logit.to(cdt)).expand(bsz, length, -1)  # 1 - a
        if mask is not None:
            m = mask.to(device=x.device, dtype=cdt)[:, :, None]
            log_a, gain = log_a * m, gain * m  # pad: a = 1, no input
        state = h.to(cdt) if h is not None else x.new_zeros((bsz, self.d_inner), dtype=cdt)
        inputs = gain * u.to(cdt)
        outs = []
        for start in range(0, length, self.chunk_size):
            la, inp = log_a[:, start : start + self.chunk_size], inputs[:, start : start + self.chunk_size]
            t = la.shape[1]
            cum = la.cumsum(1)  # (B, t, D)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
            expo = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf"))  # (B, t, s, D)
            hs = torch.einsum("btsd,bsd->btd", expo.exp(), inp) + cum.exp() * state[:, None]
            state = hs[:, -1]
            outs.append(hs)
        hs = torch.cat(outs, 1) if outs else x.new_zeros((bsz, 0, self.d_inner), dtype=cdt)
        y = self.out_proj((hs * F.silu(z.to(cdt))).to(x.dtype))
        if return_states:
            return y, (state.to(h.dtype if h is not None else self.decay_logit.dtype),)
        return y

    def step(self, x: torch.Tensor, h: torch.Tensor):
        """Decode one token: x (B, 1, d_in) or (B, d_in) -> (out (B, 1, d_out), h (B, d_inner))."""
        if x.dim() == 3:
            if x.shape[1] != 1:
                raise ValueError(f"step() takes one token, got x of shape {tuple(x.shape)}")
            x = x[:, 0]
        cdt = self._cdt()
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, d_inner) each
        a = torch.sigmoid(self.decay_logit.to(cdt))
        new = a * h.to(cdt) + torch.sigmoid(-self.decay_logit.to(cdt)) * u.to(cdt)
        out = self.out_proj((new * F.silu(z.to(cdt))).to(x.dtype))[:, None]
        return out, new.to(h.dtype)


class EMAOperator(ReplacementOperator):
    """Replace a layer's selected heads with one :class:`EMAMixer` (a gated per-channel
    exponential moving average of their KV heads' values): one ``d_inner`` vector of state
    per sequence, against Mamba's ``d_inner * (d_state + d_conv)``.

    Args:
        expand: Inner width multiplier: d_inner = expand * d_in.
        max_timescale: The slowest initial decay, in tokens (``1 / (1 - a)``); the fastest is 2.
        zero_init_output: Start with ``out_proj`` at zero, so a fresh conversion is the
            original model with the replaced heads silenced; training grows the mixer's share.
    """

    def __init__(self, expand: int = 1, max_timescale: float = 256.0, zero_init_output: bool = True):
        self.expand = _positive_int("expand", expand)
        if isinstance(max_timescale, bool) or not isinstance(max_timescale, (int, float)) or not max_timescale > 2:
            raise OperatorError(f"model.operator.max_timescale: {max_timescale!r} is not allowed; must be > 2")
        self.max_timescale = float(max_timescale)
        self.zero_init_output = bool(zero_init_output)

    def init_args(self) -> dict:
        return {"expand": self.expand, "max_timescale": self.max_timescale, "zero_init_output": self.zero_init_output}

    def build(self, d_in: int, d_out: int, layer_idx: int) -> nn.Module:
        mixer = EMAMixer(d_in, d_out, expand=self.expand, max_timescale=self.max_timescale, layer_idx=layer_idx)
        if self.zero_init_output:
            nn.init.zeros_(mixer.out_proj.weight)
        return mixer
