"""The RecurFormer attention layer (paper Algorithm 1) and the converted HF model classes.

Inside one attention layer, with query heads split into kept (att) and replaced (m)::

    [Q_att, Q_m, K_att, K_m, V_att, V_m] = W_QKV X     # one packed projection (qkv_proj)
    Q_att, Q_m, K_att, K_m = RoPE(...)                 # one rotary call on the first four
    X_att = Attention(Q_att, K_att, V_att)              # the kept heads and their KV heads
    X_m   = Mixer(V_m)  or  Mixer(Q_m, K_m, V_m)        # all replaced heads of the layer in one block
    out   = W_O concat(X_att, X_m)                      # W_O's columns stored as [kept..., replaced...]

The rows of ``W_QKV`` are the pretrained ``W_Q`` / ``W_K`` / ``W_V`` rows of those heads, gathered
and permuted once at conversion (``Q_m`` / ``K_m`` only for operators that read queries and keys,
``inputs == "qkv"``), so a forward is one input GEMM, one RoPE call and views; ``W_O``'s input
columns are permuted once too, so the two outputs are simply concatenated. The cache holds K/V of
the kept KV heads only; the mixer's constant-size state lives beside it (see
:mod:`rfkit.models.cache`).

Format versions (``config.rf_format_version``): models saved before the packed projection (no
field) held ``q_proj`` / ``k_proj`` / ``v_proj`` / ``mq_proj`` / ``mk_proj``. They are built in that
layout, loaded as saved, and packed in place right after ``from_pretrained`` (the config then says
:data:`PACKED_FORMAT`, so saving again writes the packed layout).

Padding: attention sees padding through the usual 4-D mask, but a recurrent mixer would fold
pad tokens into its state. The converted ``*ForCausalLM.forward`` therefore hands the current
chunk's 2-D token mask ``(B, L)`` down to every layer as the keyword :data:`TOKEN_MASK_KWARG`
(transformers forwards unknown keywords from the CausalLM through the decoder model and layers
to ``self_attn``), only when that chunk contains padding; the mixer then skips the pad tokens
(``MambaBlock.forward(..., mask=...)``), so a left-padded prompt leaves the same state as the
unpadded one. One-token decode steps never carry padding and keep using ``mixer.step``.

Converted models are ordinary HF models: ``model_type`` ``rf_llama`` / ``rf_mistral`` /
``rf_qwen2``, registered with the Auto classes when ``rfkit`` is imported, so
``AutoModelForCausalLM.from_pretrained(dir)`` restores them.

One module because the converted layer (its packed projection, its prefill and decode paths) and
the model classes that rebuild it from a config are one unit: a saved folder ships them as its
``modeling_rfkit.py`` (:mod:`rfkit.models.export`), and the layer's paths share its head layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaForCausalLM, eager_attention_forward

from rfkit.models.cache import CACHE_ARG, advance_headless, count_headless_tokens, mixer_counts, mixer_state_store
from rfkit.models.configuration import RecurFormerLlamaConfig, RecurFormerMistralConfig, RecurFormerQwen2Config
from rfkit.models.layout import AttentionLayout, GroupView, group_runs, projection_biases, sliding_window
from rfkit.models.operators import ReplacementOperator
from rfkit.models.precision import default_dtype, new_weight_dtype
from rfkit.models.rotary import rotate, rotation_matrix

log = logging.getLogger(__name__)

# Keyword under which the converted CausalLM passes the current chunk's token mask (B, L), 1 for
# real tokens, down to RecurFormerAttention. Present only when the chunk holds padding. A caller
# may also pass it to ``forward`` / ``generate`` as a full 2-D mask (B, past + L), which then takes
# precedence over ``attention_mask`` (generate does so itself for compileable caches, whose
# ``attention_mask`` arrives already converted to 4-D).
TOKEN_MASK_KWARG = "rf_token_mask"
#: Keyword under which the converted CausalLM passes the current chunk's length (a host int) to
#: every RecurFormerAttention, so that a layer tells a decode step from a prefill without reading
#: the hidden states' shape once per layer.
CHUNK_TOKENS_KWARG = "rf_chunk_tokens"
#: ``config.rf_format_version`` of models whose converted layers hold one packed ``qkv_proj``;
#: configs without the field are of the earlier layout (module docstring)
PACKED_FORMAT = 2


def format_version(config) -> int:
    """The layout version of a converted model's weights (1: before the packed projection)."""
    return int(getattr(config, "rf_format_version", None) or 1)


def _chunk_token_mask(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The last ``length`` columns of a 2-D token mask when they contain padding, else None.

    None also for one-token chunks (decode steps cannot hold padding; the mixer's ``step`` runs)
    and for masks that are not 2-D or shorter than the chunk. The padding check is one host sync
    per forward of a multi-token chunk (prefill), none per decode step.
    """
    if mask is None or length <= 1 or mask.dim() != 2 or mask.shape[-1] < length:
        return None
    chunk = mask[:, -length:]
    return None if bool(chunk.all()) else chunk


class RecurFormerAttention(nn.Module):
    """An attention layer whose ``replaced`` query heads run through one mixer block."""

    def __init__(self, config, layer_idx: int, replaced: list[int], operator: ReplacementOperator, packed: bool = True):
        super().__init__()
        layout = AttentionLayout.from_config(config)
        self.config, self.layer_idx = config, layer_idx
        self.head_dim, self.num_heads = layout.head_dim, layout.num_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.is_causal = True
        self.sliding_window = sliding_window(config, layer_idx)

        replaced = sorted(set(replaced))
        kept = [h for h in range(layout.num_heads) if h not in replaced]
        kept_kv = sorted({layout.kv_head_of(h) for h in kept})
        mixer_kv = sorted({layout.kv_head_of(h) for h in replaced})
        self.kept_heads, self.replaced_heads = kept, replaced
        self.kept_kv_heads, self.mixer_kv_heads = kept_kv, mixer_kv

        # Kept query heads per kept KV head. Equal everywhere (always so for kv_group selection):
        # one GQA attention call. Otherwise one call per run of equal group sizes on slices of the
        # query and the cache (both lists are sorted), never a copy of the cache per query head.
        per_kv = [sum(layout.kv_head_of(h) == g for h in kept) for g in kept_kv]
        self.num_key_value_groups = per_kv[0] if per_kv and len(set(per_kv)) == 1 else 1
        self._gather = bool(per_kv) and len(set(per_kv)) != 1
        self._group_runs = group_runs(per_kv) if self._gather else []

        qkv_bias, o_bias = projection_biases(config)
        hd, hidden = layout.head_dim, layout.hidden_size
        # operators that keep attending (inputs "qkv") read the replaced heads' own queries and
        # keys: their pretrained rows stay in the packed projection
        self.mixer_reads_qk = getattr(operator, "inputs", "values") == "qkv"
        # The packed projection's heads, in row order (module docstring): name -> (start, stop)
        # in units of head_dim rows. Kept and replaced parts may share a KV head (head granularity):
        # its K/V rows then appear in both, so every part is a contiguous slice.
        counts = {
            "q": len(kept),
            "mq": len(replaced) if self.mixer_reads_qk else 0,
            "k": len(kept_kv) if kept else 0,
            "mk": len(mixer_kv) if self.mixer_reads_qk else 0,
            "v": len(kept_kv) if kept else 0,
            "mv": len(mixer_kv),
        }
        self.parts, start = {}, 0
        for name, count in counts.items():
            self.parts[name] = (start, start + count)
            start += count
        self.rotated_heads = self.parts["mk"][1]  # q, mq, k, mk: the heads RoPE applies to
        # a decode step splits the packed heads in two calls: rotated | v | mv, then q | mq | k | mk
        self._unrotated_split = [self.rotated_heads, counts["v"], counts["mv"]]
        self._rotated_split = [counts[name] for name in ("q", "mq", "k", "mk")]
        # without kept heads, a mixer that rotates in its step takes the packed heads split once
        self._packed_split = [*self._rotated_split, counts["v"], counts["mv"]]
        self.has_kept = bool(kept)
        self.qkv_proj = None
        self.o_proj = nn.Linear(layout.num_heads * hd, hidden, bias=o_bias)
        if packed:
            self.qkv_proj = nn.Linear(hidden, start * hd, bias=qkv_bias)
        else:  # a model saved before the packed projection: loaded as saved, then pack_legacy()
            self.q_proj = nn.Linear(hidden, len(kept) * hd, bias=qkv_bias) if kept else None
            self.k_proj = nn.Linear(hidden, len(kept_kv) * hd, bias=qkv_bias) if kept else None
            self.v_proj = nn.Linear(hidden, layout.num_kv_heads * hd, bias=qkv_bias)
            if self.mixer_reads_qk:
                self.mq_proj = nn.Linear(hidden, len(replaced) * hd, bias=qkv_bias)
                self.mk_proj = nn.Linear(hidden, len(mixer_kv) * hd, bias=qkv_bias)
        if self.mixer_reads_qk:
            kv_for_query = [mixer_kv.index(layout.kv_head_of(h)) for h in replaced]
            d_in = (len(replaced) + 2 * len(mixer_kv)) * hd
            self.mixer = operator.build(
                d_in, len(replaced) * hd, layer_idx, kv_for_query=kv_for_query, head_dim=hd, scaling=self.scaling
            )
        else:
            self.mixer = operator.build(len(mixer_kv) * hd, len(replaced) * hd, layer_idx)
        # the decode step of a layer whose heads are all replaced hands such a mixer its query and
        # key unrotated, with the token's rotary cos / sin (WindowAttention.takes_rotation)
        self._mixer_rotates = (
            not kept and self.mixer_reads_qk and getattr(self.mixer, "takes_rotation", False) and getattr(self.mixer, "handles_dtype", False)
        )

    # -- conversion -------------------------------------------------------------------------
    def _rows(self, tensor: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """The ``head_dim``-row blocks of ``heads`` in a projection's weight or bias, in order."""
        hd = self.head_dim
        return torch.cat([tensor[h * hd : (h + 1) * hd] for h in heads]) if heads else tensor[:0]

    def _pack(self, q, mq, k, mk, v_all) -> torch.Tensor:
        """The packed projection's weight (or bias) from the kept heads' queries ``q`` and keys
        ``k``, the replaced heads' ``mq`` / ``mk`` (None when the mixer reads values only) and the
        values of every KV head ``v_all``, in the row order of :attr:`parts`."""
        v, mv = (self._rows(v_all, heads) for heads in (self.kept_kv_heads, self.mixer_kv_heads))
        parts = (q, mq, k, mk, v, mv) if self.has_kept else (None, mq, None, mk, None, mv)
        return torch.cat([t for t in parts if t is not None])

    @torch.no_grad()
    def load_from_attention(self, attn: nn.Module) -> None:
        """Copy the pretrained projections of an HF attention module (gathered / permuted)."""
        hd = self.head_dim
        all_kv = list(range(attn.v_proj.weight.shape[0] // hd))
        for name in ("weight", "bias"):
            if getattr(attn.v_proj, name) is None:
                continue
            q, k, v = (getattr(getattr(attn, proj), name) for proj in ("q_proj", "k_proj", "v_proj"))
            parts = {  # the pre-packing modules, each with its rows
                "q_proj": self._rows(q, self.kept_heads) if self.has_kept else None,
                "mq_proj": self._rows(q, self.replaced_heads) if self.mixer_reads_qk else None,
                "k_proj": self._rows(k, self.kept_kv_heads) if self.has_kept else None,
                "mk_proj": self._rows(k, self.mixer_kv_heads) if self.mixer_reads_qk else None,
                "v_proj": self._rows(v, all_kv),
            }
            if self.qkv_proj is not None:
                getattr(self.qkv_proj, name).copy_(self._pack(*parts.values()))
                continue
            for module, rows in parts.items():  # a model being built in the pre-packing layout
                if rows is not None:
                    getattr(getattr(self, module), name).copy_(rows)
        order = self.kept_heads + self.replaced_heads
        self.o_proj.weight.copy_(torch.cat([attn.o_proj.weight[:, h * hd : (h + 1) * hd] for h in order], dim=1))
        if self.o_proj.bias is not None:
            self.o_proj.bias.copy_(attn.o_proj.bias)
        self.to(attn.v_proj.weight.device)

    @torch.no_grad()
    def pack_legacy(self) -> None:
        """Pack the separate projections of a model saved before :data:`PACKED_FORMAT` into
        ``qkv_proj`` (same device, dtype and ``requires_grad``) and drop them."""
        if self.qkv_proj is not None:
            return
        names = ("q_proj", "mq_proj", "k_proj", "mk_proj", "v_proj")
        old = {name: getattr(self, name, None) for name in names}
        ref = old["v_proj"].weight
        packed = {}
        for field in ("weight", "bias"):
            if getattr(old["v_proj"], field) is not None:
                packed[field] = self._pack(*(None if old[n] is None else getattr(old[n], field) for n in names))
        proj = nn.Linear(ref.shape[1], packed["weight"].shape[0], bias="bias" in packed, device=ref.device, dtype=ref.dtype)
        for field, value in packed.items():
            getattr(proj, field).copy_(value)
            getattr(proj, field).requires_grad_(ref.requires_grad)
        for name in names:
            if hasattr(self, name):
                delattr(self, name)
        self.qkv_proj = proj

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        # earlier transformers 5 releases pass the cache to attention as ``past_key_values``,
        # 5.24 as ``cache``: accept both
        past_key_values = cache if cache is not None else past_key_values
        # (B, L) token mask of this chunk, set by the converted CausalLM only when it holds padding;
        # popped so that the attention interface never sees it.
        token_mask = kwargs.pop(TOKEN_MASK_KWARG, None)
        tokens = kwargs.pop(CHUNK_TOKENS_KWARG, None)
        if self._decode_ready(hidden_states, past_key_values, token_mask, tokens):
            return self._decode(hidden_states, position_embeddings, attention_mask, past_key_values, kwargs), None
        B, L, _ = hidden_states.shape
        query, key, value, mixer_qkv = self._project(hidden_states, position_embeddings)
        outputs = []
        if query is not None:
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.layer_idx)
            outputs.append(self._attend(query, key, value, attention_mask, kwargs).reshape(B, L, -1))  # (B, L, Hq_kept * hd)
        elif past_key_values is not None:
            self._record_headless(past_key_values, hidden_states)
        outputs.append(self._mix(mixer_qkv, past_key_values, token_mask))  # (B, L, Hq_m * hd)
        return self.o_proj(torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]), None

    def _record_headless(self, cache, hidden_states: torch.Tensor) -> None:
        """No kept heads: record the chunk's tokens with zero-head K/V so the cache's length stays right."""
        B, L, _ = hidden_states.shape
        empty = hidden_states.new_zeros(B, 0, L, self.head_dim)
        cache.update(empty, empty, self.layer_idx)
        count_headless_tokens(cache, self.layer_idx)

    def _attend(self, query, key, value, attention_mask, kwargs) -> torch.Tensor:
        """The kept heads' attention through the model's attention interface: ``(B, L, Hq_kept, hd)``."""
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        settings = dict(
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        if not self._gather:
            return attention(self, query, key, value, attention_mask, **settings)[0]
        parts = []
        for (q0, q1), (k0, k1), groups in self._group_runs:
            part, _ = attention(GroupView(self, groups), query[:, q0:q1], key[:, k0:k1], value[:, k0:k1], attention_mask, **settings)
            parts.append(part)
        return torch.cat(parts, dim=2)  # heads in kept order

    def _project(self, hidden_states: torch.Tensor, position_embeddings):
        """Every projection of the layer from one GEMM: the kept heads' rotated query, key and
        value ``(B, H, L, hd)`` (None without kept heads) and what the mixer reads: the replaced
        heads' KV-head values ``(B, L, Hkv_m * hd)``, or for ``qkv`` operators their rotated
        ``(q, k, v)`` in ``(B, H, L, hd)``. Queries and keys are rotated in one call; every part
        is a view of the packed output."""
        if self.qkv_proj is None:  # built from a pre-packing config without from_pretrained
            self.pack_legacy()
        B, L, _ = hidden_states.shape
        heads = self.qkv_proj(hidden_states).view(B, L, -1, self.head_dim).transpose(1, 2)  # (B, N, L, hd)
        rotated = rotate(heads[:, : self.rotated_heads], *position_embeddings) if self.rotated_heads else None
        query = key = value = None
        if self.has_kept:
            query, key, value = self._part(rotated, "q"), self._part(rotated, "k"), self._part(heads, "v")
        mixer_v = self._part(heads, "mv")
        if not self.mixer_reads_qk:
            return query, key, value, mixer_v.transpose(1, 2).reshape(B, L, -1)
        return query, key, value, (self._part(rotated, "mq"), self._part(rotated, "mk"), mixer_v)

    def _part(self, heads: torch.Tensor, name: str) -> torch.Tensor:
        """The heads of part ``name`` (:attr:`parts`) of a packed ``(B, N, L, hd)`` tensor: a view."""
        start, stop = self.parts[name]
        return heads[:, start:stop]

    def mixer_input(self, hidden_states: torch.Tensor, position_embeddings, values: torch.Tensor | None = None) -> torch.Tensor:
        """What the mixer reads, packed (B, L, d_in): the replaced heads' KV-head values, preceded
        for ``qkv`` operators by their rotated queries and keys. Attention transfer calls this on
        the original model's hidden states, so a mixer is fitted on exactly what it will be fed."""
        mixer_in = self._project(hidden_states, position_embeddings)[3]
        if not self.mixer_reads_qk:
            return mixer_in
        B, L, _ = hidden_states.shape
        return torch.cat([t.transpose(1, 2).reshape(B, L, -1) for t in mixer_in], dim=-1)

    def _mix(self, x, cache, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the mixer on ``x``: a packed (B, L, d_in) tensor, or for ``qkv`` operators the
        ``(q, k, v)`` triple that :meth:`_project` returns (the mixer's forward / ``step_qkv``
        take it as it is, with no packing and splitting between them). ``mask`` (B, L), 1 for
        real tokens, is given only when the chunk holds padding; it is then passed on as
        ``mixer(..., mask=mask)`` so pad tokens leave the state untouched (mixers without padding
        support are never sent a mask for unpadded input)."""
        extra = {} if mask is None else {"mask": mask}
        split = isinstance(x, tuple)
        dtype = (x[0] if split else x).dtype
        cast = self._mixer_dtype(dtype)
        if cast is not None:  # a mixer that takes its weights' dtype only (ReplacementMixer.handles_dtype)
            x = tuple(t.to(cast) for t in x) if split else x.to(cast)
        out = self._run_mixer(x, split, cache, extra)
        return out if out.dtype == dtype else out.to(dtype)

    def _mixer_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype to cast the mixer's input to (its weights'), None when it takes any (``handles_dtype``)."""
        if getattr(self.mixer, "handles_dtype", False):
            return None
        weight = next((p for p in self.mixer.parameters() if p.is_floating_point()), None)
        return None if weight is None or weight.dtype == dtype else weight.dtype

    def _run_mixer(self, x, split: bool, cache, extra: dict) -> torch.Tensor:
        # through the module's call (a qkv mixer takes the (q, k, v) tuple there): wrappers such as
        # an FSDP unit, which gathers the mixer's weights, see every training and prefill forward
        if cache is None:
            return self.mixer(x, **extra)
        store, counts = mixer_state_store(cache), mixer_counts(cache)
        state = store.get(self.layer_idx)
        length = x[0].shape[-2] if split else x.shape[1]
        if state is not None and length == 1:
            # A decode step: one real token (padding only ever precedes a prompt).
            out = self._mixer_step(x, split, cache)
            if extra:  # a token mask came with the step: the rows' counts may no longer agree
                counts[self.layer_idx] = None
            return out
        seen = counts.get(self.layer_idx) if state is not None else 0
        if state is None:
            out, state = self.mixer(x, return_states=True, **extra)
        else:
            out, state = self.mixer(x, *state, return_states=True, **extra)
        store[self.layer_idx] = tuple(state)
        counts[self.layer_idx] = None if seen is None or extra else seen + length
        return out

    def _mixer_step(self, x, split: bool, cache, rotation=None) -> torch.Tensor:
        """The mixer's one-token step on the state ``cache`` holds for this layer, told the host
        count when it takes one (``takes_seen``) and the token's rotary ``(cos, sin)`` when its
        query and key come unrotated (``takes_rotation``); stores the new state and count."""
        store, counts = mixer_state_store(cache), mixer_counts(cache)
        state, seen = store[self.layer_idx], counts.get(self.layer_idx)
        step = self.mixer.step_qkv if split else self.mixer.step
        if rotation is not None:
            out, *state = step(*x, *state, seen=seen, rotation=rotation)
        elif getattr(self.mixer, "takes_seen", False):
            out, *state = step(*x, *state, seen=seen) if split else step(x, *state, seen=seen)
        else:
            out, *state = step(*x, *state) if split else step(x, *state)
        store[self.layer_idx] = tuple(state)
        counts[self.layer_idx] = None if seen is None else seen + 1
        return out

    # -- one decode token ---------------------------------------------------------------------
    def _decode_ready(self, hidden_states: torch.Tensor, cache, token_mask, tokens: int | None = None) -> bool:
        """Whether :meth:`_decode` serves this call: one token in inference with a cache that holds
        this layer's mixer state already (a step, not a prefill). ``tokens``: the chunk's length
        when the converted CausalLM passed it (:data:`CHUNK_TOKENS_KWARG`), else read here."""
        if cache is None or token_mask is not None or self.training or self.qkv_proj is None:
            return False
        if (hidden_states.shape[1] if tokens is None else tokens) != 1 or torch.is_grad_enabled():
            return False
        return self.layer_idx in mixer_state_store(cache)

    def _decode(self, hidden_states, position_embeddings, attention_mask, cache, kwargs) -> torch.Tensor:
        """One decode token through the layer with the fewest tensor ops: one GEMM, two splits of the
        packed heads around one rotary matrix product (:func:`rotation_matrix`), the kept heads'
        attention (SDPA directly when the model uses it and there is no mask or sliding window)
        and the mixer's step; ``(B, 1, hidden)``. A layer without kept heads whose mixer rotates in
        its step (``takes_rotation``) splits the packed heads once and hands it the unrotated query
        and key with the token's cos / sin: on CPU the compiled step rotates them as it reads them
        (in situ, where every small call runs from cold caches after the GEMMs, the rotation and the
        second split cost about a third of such a layer's time outside its projections). The same
        ops on every device."""
        heads = self.qkv_proj(hidden_states).view(-1, self.parts["mv"][1], 1, self.head_dim)  # (B, N, 1, hd): L = 1
        if self._mixer_rotates:  # no kept heads: views of the packed heads, rotated in the mixer's step
            _, mixer_q, _, mixer_k, _, mixer_v = heads.split(self._packed_split, dim=1)
            if not advance_headless(cache, self.layer_idx):
                self._record_headless(cache, hidden_states)
            return self.o_proj(self._mixer_step((mixer_q, mixer_k, mixer_v), True, cache, rotation=position_embeddings))
        rotated, value, mixer_v = heads.split(self._unrotated_split, dim=1)
        if self.rotated_heads:  # every rotated head in one matrix product (rotation_matrix)
            query, mixer_q, key, mixer_k = (rotated @ rotation_matrix(*position_embeddings)).split(self._rotated_split, dim=1)
        outputs = []
        if self.has_kept:
            key, value = cache.update(key, value, self.layer_idx)
            outputs.append(self._attend_one(query, key, value, attention_mask, kwargs))
        elif not advance_headless(cache, self.layer_idx):  # counted on the host when it can be
            self._record_headless(cache, hidden_states)
        if self.mixer_reads_qk:
            x = (mixer_q, mixer_k, mixer_v)
        else:
            x = mixer_v.reshape(-1, 1, len(self.mixer_kv_heads) * self.head_dim)
        if getattr(self.mixer, "handles_dtype", False):  # no cast to decide: straight to the step
            outputs.append(self._mixer_step(x, self.mixer_reads_qk, cache))  # (B, 1, Hq_m * hd)
        else:
            outputs.append(self._mix(x, cache))
        return self.o_proj(torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0])

    def _attend_one(self, query, key, value, attention_mask, kwargs) -> torch.Tensor:
        """The kept heads' attention for one query token ``(B, Hq, 1, hd)`` -> ``(B, 1, Hq * hd)``."""
        if (
            attention_mask is None
            and self.sliding_window is None
            and not self._gather
            and self.config._attn_implementation == "sdpa"
        ):
            # a KV head's query heads as its query positions: SDPA reads each key once, not once per
            # query head as enable_gqa does (about 2x faster on CPU); the head order is unchanged
            grouped = query.view(-1, len(self.kept_kv_heads), self.num_key_value_groups, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, key, value, scale=self.scaling)
        else:
            out = self._attend(query, key, value, attention_mask, kwargs)
        return out.reshape(-1, 1, self.parts["q"][1] * self.head_dim)


# -- conversion of a loaded model -------------------------------------------------------------
def decoder_layers(model) -> nn.ModuleList:
    return model.get_decoder().layers


def convert_attention(model, selected: list[list[int]], operator: ReplacementOperator, packed: bool = True) -> dict[int, nn.Module]:
    """Swap attention modules in place: every layer with selected heads gets a RecurFormer layer
    (``packed=False``: in the layout of models saved before :data:`PACKED_FORMAT`, for loading them).

    Returns the original attention modules that were swapped out, by layer index (the shared
    teacher of :mod:`rfkit.training.teacher` puts them back to run the original model).
    """
    layers = decoder_layers(model)
    operator.check_layers([i for i, heads in enumerate(selected) if heads])
    originals = {}
    for layer_idx, heads in enumerate(selected):
        if not heads:
            continue
        old = layers[layer_idx].self_attn
        base = old.v_proj.weight.dtype
        with default_dtype(torch.float32):  # new weights start in float32, whatever the caller's default
            new = RecurFormerAttention(model.config, layer_idx, heads, operator, packed=packed)
        for child in new.children():  # the pretrained projections in the base's dtype, the mixer in
            child.to(dtype=new_weight_dtype(base) if child is new.mixer else base)  # float32 beside a half base
        new.load_from_attention(old)
        layers[layer_idx].self_attn = new
        originals[layer_idx] = old
    return originals


def pack_legacy_model(model) -> int:
    """Pack the projections of every converted layer still in the pre-:data:`PACKED_FORMAT`
    layout and record the new format in the config; returns how many layers were packed."""
    packed = 0
    for layer in decoder_layers(model):
        attn = layer.self_attn
        if isinstance(attn, RecurFormerAttention) and attn.qkv_proj is None:
            attn.pack_legacy()
            packed += 1
    if getattr(model.config, "rf_selected", None):
        model.config.rf_format_version = PACKED_FORMAT
    return packed


# -- HF classes for converted models ----------------------------------------------------------
# Our overrides accept the cache as ``cache`` and as ``past_key_values`` (generate() validates
# user kwargs against their signatures) and hand it on under the installed name (CACHE_ARG).


def _pass_cache(kwargs: dict, cache, past_key_values) -> None:
    given = cache if cache is not None else past_key_values
    if given is not None:  # only when given: 5.24 warns on the old name even when it is None
        kwargs[CACHE_ARG] = given


class _RecurFormerCausalLM:
    """What every ``RecurFormer*ForCausalLM`` adds to its family's ``*ForCausalLM`` (listed
    before it in the bases): conversion at construction from ``config.rf_selected`` /
    ``config.rf_operator``, and the token mask handed down to the mixers."""
    _keep_in_fp32_modules_strict = ["mixer"]  # float32 new weights in a bf16 / fp16 load (models.precision)

    def __init__(self, config):
        super().__init__(config)
        if config.rf_selected:
            packed = format_version(config) >= PACKED_FORMAT
            convert_attention(self, config.rf_selected, ReplacementOperator.from_dict(config.rf_operator), packed=packed)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As the base; a model saved before :data:`PACKED_FORMAT` is loaded as saved and its
        converted layers' projections are then packed in place (:func:`pack_legacy_model`)."""
        loaded = super().from_pretrained(*args, **kwargs)
        pack_legacy_model(loaded[0] if isinstance(loaded, tuple) else loaded)  # (model, info) with output_loading_info
        return loaded

    # The explicit signature matters: generate() inspects forward's parameters (it only builds
    # position_ids for left-padded batches when ``position_ids`` is one of them).
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        cache=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        """The base model's forward, plus: the current chunk's 2-D token mask reaches the mixers
        (as ``TOKEN_MASK_KWARG``) when the chunk contains padding, and its length reaches every
        converted layer (as ``CHUNK_TOKENS_KWARG``)."""
        full_mask = kwargs.pop(TOKEN_MASK_KWARG, None)
        if full_mask is None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            full_mask = attention_mask
        tokens = input_ids if input_ids is not None else inputs_embeds
        chunk_mask = _chunk_token_mask(full_mask, tokens.shape[1]) if tokens is not None else None
        if chunk_mask is not None:
            kwargs[TOKEN_MASK_KWARG] = chunk_mask
        if tokens is not None:
            kwargs[CHUNK_TOKENS_KWARG] = tokens.shape[1]
        _pass_cache(kwargs, cache, past_key_values)
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )

    def prepare_inputs_for_generation(
        self,
        input_ids,
        next_sequence_length=None,
        past_key_values=None,
        attention_mask=None,
        inputs_embeds=None,
        is_first_iteration=False,
        cache=None,
        **kwargs,
    ):
        """As the base, but when generate turns the 2-D ``attention_mask`` into a 4-D one (it
        does for compileable caches such as ``StaticCache``), the 2-D mask is passed along as
        ``TOKEN_MASK_KWARG`` so the mixers still see the padding."""
        _pass_cache(kwargs, cache, past_key_values)
        inputs = super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        given = inputs.get("attention_mask")
        if (
            isinstance(attention_mask, torch.Tensor)
            and attention_mask.dim() == 2
            and not (isinstance(given, torch.Tensor) and given.dim() == 2)
        ):
            inputs[TOKEN_MASK_KWARG] = attention_mask
        return inputs


class RecurFormerLlamaForCausalLM(_RecurFormerCausalLM, LlamaForCausalLM):
    config_class = RecurFormerLlamaConfig


class RecurFormerMistralForCausalLM(_RecurFormerCausalLM, MistralForCausalLM):
    config_class = RecurFormerMistralConfig


class RecurFormerQwen2ForCausalLM(_RecurFormerCausalLM, Qwen2ForCausalLM):
    config_class = RecurFormerQwen2Config


# base model_type -> (rf config class, rf model class)
_FAMILIES = {
    "llama": (RecurFormerLlamaConfig, RecurFormerLlamaForCausalLM),
    "mistral": (RecurFormerMistralConfig, RecurFormerMistralForCausalLM),
    "qwen2": (RecurFormerQwen2Config, RecurFormerQwen2ForCausalLM),
}
for _rf_config, _rf_model in _FAMILIES.values():
    AutoConfig.register(_rf_config.model_type, _rf_config, exist_ok=True)
    AutoModelForCausalLM.register(_rf_config, _rf_model, exist_ok=True)
del _rf_config, _rf_model


def to_recurformer(model, selected: list[list[int]], operator: ReplacementOperator):
    """Convert a loaded HF model in place and turn it into its ``rf_*`` class; returns it.

    The swapped-out original attention modules stay reachable as ``model.rf_originals`` (a plain
    attribute: not a submodule, so never saved, moved or trained with the model)."""
    layout = AttentionLayout.from_config(model.config)
    rf_cfg_cls, rf_model_cls = _FAMILIES[layout.model_type]
    originals = convert_attention(model, selected, operator)
    old = model.config
    fields = {k: v for k, v in old.to_dict().items() if k not in ("model_type", "architectures", "transformers_version", "rf_format_version")}
    new = rf_cfg_cls(rf_selected=[list(s) for s in selected], rf_operator=operator.to_dict(), rf_format_version=PACKED_FORMAT, **fields)
    new._attn_implementation = old._attn_implementation
    new.architectures = [rf_model_cls.__name__]
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new
    model.__class__ = rf_model_cls
    model.config = new
    object.__setattr__(model, "rf_originals", originals)
    return model
