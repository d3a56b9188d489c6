"""The RecurFormer attention layer (paper Algorithm 1) and the converted HF model classes.

Inside one attention layer, with query heads split into kept (att) and replaced (m)::

    V     = W_V X                      # values of all KV heads (W_V kept whole)
    Q     = W_Q^part X                 # query projection of kept heads only
    K     = W_K^part X                 # key projection of the KV heads that kept heads use
    X_att = Attention(Q, K, V[att])
    X_m   = Mixer(V[m])                # all replaced heads of the layer in one block
    out   = W_O concat(X_att, X_m)     # W_O kept whole, columns stored as [kept..., replaced...]

``W_O``'s input columns are permuted once at conversion so that the kept heads' and the
replaced heads' outputs are simply concatenated, instead of scattered back to head order on
every forward. The cache holds K/V of the kept KV heads only; the mixer's constant-size state
lives beside it (see :mod:`rfkit.models.cache`).

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaForCausalLM, apply_rotary_pos_emb, eager_attention_forward

from rfkit.models.cache import CACHE_ARG, count_headless_tokens, mixer_state_store
from rfkit.models.configuration import RecurFormerLlamaConfig, RecurFormerMistralConfig, RecurFormerQwen2Config
from rfkit.models.layout import AttentionLayout, GroupView, group_runs, projection_biases, sliding_window
from rfkit.models.operators import ReplacementOperator
from rfkit.models.precision import default_dtype, new_weight_dtype

log = logging.getLogger(__name__)

# Keyword under which the converted CausalLM passes the current chunk's token mask (B, L), 1 for
# real tokens, down to RecurFormerAttention. Present only when the chunk holds padding. A caller
# may also pass it to ``forward`` / ``generate`` as a full 2-D mask (B, past + L), which then takes
# precedence over ``attention_mask`` (generate does so itself for compileable caches, whose
# ``attention_mask`` arrives already converted to 4-D).
TOKEN_MASK_KWARG = "rf_token_mask"


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

    def __init__(self, config, layer_idx: int, replaced: list[int], operator: ReplacementOperator):
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
        # Head index tensors are made on first use per device (_index), not kept as buffers:
        # from_pretrained builds modules on the meta device and would leave them uninitialised.
        self._index_cache: dict = {}

        qkv_bias, o_bias = projection_biases(config)
        hd, hidden = layout.head_dim, layout.hidden_size
        self.q_proj = nn.Linear(hidden, len(kept) * hd, bias=qkv_bias) if kept else None
        self.k_proj = nn.Linear(hidden, len(kept_kv) * hd, bias=qkv_bias) if kept else None
        self.v_proj = nn.Linear(hidden, layout.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(layout.num_heads * hd, hidden, bias=o_bias)
        # operators that keep attending (inputs "qkv") read the replaced heads' own queries and
        # keys: their pretrained projections stay, as mq_proj / mk_proj
        self.mixer_reads_qk = getattr(operator, "inputs", "values") == "qkv"
        self.mq_proj = self.mk_proj = None
        if self.mixer_reads_qk:
            self.mq_proj = nn.Linear(hidden, len(replaced) * hd, bias=qkv_bias)
            self.mk_proj = nn.Linear(hidden, len(mixer_kv) * hd, bias=qkv_bias)
            kv_for_query = [mixer_kv.index(layout.kv_head_of(h)) for h in replaced]
            d_in = (len(replaced) + 2 * len(mixer_kv)) * hd
            self.mixer = operator.build(
                d_in, len(replaced) * hd, layer_idx, kv_for_query=kv_for_query, head_dim=hd, scaling=self.scaling
            )
        else:
            self.mixer = operator.build(len(mixer_kv) * hd, len(replaced) * hd, layer_idx)

    # -- conversion -------------------------------------------------------------------------
    @torch.no_grad()
    def load_from_attention(self, attn: nn.Module) -> None:
        """Copy the pretrained projections of an HF attention module (sliced / permuted)."""
        hd = self.head_dim

        def rows(weight, heads):
            return torch.cat([weight[h * hd : (h + 1) * hd] for h in heads]) if heads else weight[:0]

        # kept heads' Q/K, and (window operators) the replaced heads' own Q/K
        for q_proj, k_proj, heads, kv_heads in (
            (self.q_proj, self.k_proj, self.kept_heads, self.kept_kv_heads),
            (self.mq_proj, self.mk_proj, self.replaced_heads, self.mixer_kv_heads),
        ):
            if q_proj is None:
                continue
            for mine, theirs, picked in ((q_proj, attn.q_proj, heads), (k_proj, attn.k_proj, kv_heads)):
                mine.weight.copy_(rows(theirs.weight, picked))
                if mine.bias is not None:
                    mine.bias.copy_(rows(theirs.bias, picked))
        self.v_proj.load_state_dict(attn.v_proj.state_dict())
        order = self.kept_heads + self.replaced_heads
        self.o_proj.weight.copy_(torch.cat([attn.o_proj.weight[:, h * hd : (h + 1) * hd] for h in order], dim=1))
        if self.o_proj.bias is not None:
            self.o_proj.bias.copy_(attn.o_proj.bias)
        self.to(attn.v_proj.weight.device)

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
        B, L, _ = hidden_states.shape
        hd = self.head_dim
        query, key, value, mixer_qkv = self._project(hidden_states, position_embeddings)
        outputs = []
        if query is not None:
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.layer_idx)
            attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            settings = dict(
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                sliding_window=self.sliding_window,
                **kwargs,
            )
            if not self._gather:
                attn_out, _ = attention(self, query, key, value, attention_mask, **settings)
            else:
                parts = []
                for (q0, q1), (k0, k1), groups in self._group_runs:
                    part, _ = attention(
                        GroupView(self, groups), query[:, q0:q1], key[:, k0:k1], value[:, k0:k1], attention_mask, **settings
                    )
                    parts.append(part)
                attn_out = torch.cat(parts, dim=2)  # (B, L, Hq_kept, hd), heads in kept order
            outputs.append(attn_out.reshape(B, L, -1))  # (B, L, Hq_kept * hd)
        elif past_key_values is not None:
            # No kept heads: record the tokens with zero-head K/V so the cache's length stays right.
            empty = hidden_states.new_zeros(B, 0, L, hd)
            past_key_values.update(empty, empty, self.layer_idx)
            count_headless_tokens(past_key_values, self.layer_idx)
        outputs.append(self._mix(mixer_qkv, past_key_values, token_mask))  # (B, L, Hq_m * hd)
        return self.o_proj(torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]), None

    def _project(self, hidden_states: torch.Tensor, position_embeddings):
        """Every projection of the layer, each computed once: the kept heads' rotated query, key
        and value ``(B, H, L, hd)`` (None without kept heads) and what the mixer reads: the
        replaced heads' KV-head values ``(B, L, Hkv_m * hd)``, or for ``qkv`` operators their
        rotated ``(q, k, v)`` in ``(B, H, L, hd)``. Kept and replaced queries (and keys) are
        rotated in one call, then sliced apart as views."""
        B, L, _ = hidden_states.shape
        hd = self.head_dim
        values = self.v_proj(hidden_states).view(B, L, -1, hd)  # (B, L, Hkv, hd)
        mixer_v = self._heads(values, "mixer_kv_heads")
        query = key = value = None
        q_parts, k_parts = [], []
        if self.q_proj is not None:
            q_parts.append(self.q_proj(hidden_states))
            k_parts.append(self.k_proj(hidden_states))
            value = self._heads(values, "kept_kv_heads").transpose(1, 2)  # (B, Hkv_kept, L, hd)
        if self.mixer_reads_qk:
            q_parts.append(self.mq_proj(hidden_states))
            k_parts.append(self.mk_proj(hidden_states))
        if not q_parts:
            return None, None, None, mixer_v.reshape(B, L, -1)
        q = (q_parts[0] if len(q_parts) == 1 else torch.cat(q_parts, -1)).view(B, L, -1, hd).transpose(1, 2)
        k = (k_parts[0] if len(k_parts) == 1 else torch.cat(k_parts, -1)).view(B, L, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        n_q = len(self.kept_heads) if self.q_proj is not None else 0
        n_k = len(self.kept_kv_heads) if self.q_proj is not None else 0
        if self.q_proj is not None:
            query, key = q[:, :n_q], k[:, :n_k]
        if not self.mixer_reads_qk:
            return query, key, value, mixer_v.reshape(B, L, -1)
        return query, key, value, (q[:, n_q:], k[:, n_k:], mixer_v.transpose(1, 2))

    def _heads(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """``values`` (B, L, Hkv, hd) of the KV heads listed in ``name``: a view when they are
        a contiguous range, else one index_select."""
        heads = getattr(self, name)
        if heads and heads == list(range(heads[0], heads[0] + len(heads))):
            return values[:, :, heads[0] : heads[0] + len(heads)]
        return values.index_select(2, self._index(name, values.device))

    def mixer_input(self, hidden_states: torch.Tensor, position_embeddings, values: torch.Tensor | None = None) -> torch.Tensor:
        """What the mixer reads, packed (B, L, d_in): the replaced heads' KV-head values, preceded
        for ``qkv`` operators by their rotated queries and keys. Attention transfer calls this on
        the original model's hidden states, so a mixer is fitted on exactly what it will be fed."""
        mixer_in = self._project(hidden_states, position_embeddings)[3]
        if not self.mixer_reads_qk:
            return mixer_in
        B, L, _ = hidden_states.shape
        return torch.cat([t.transpose(1, 2).reshape(B, L, -1) for t in mixer_in], dim=-1)

    def _index(self, name: str, device) -> torch.Tensor:
        key = (name, device)
        if key not in self._index_cache:
            self._index_cache[key] = torch.tensor(getattr(self, name), dtype=torch.long, device=device)
        return self._index_cache[key]

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
        store = mixer_state_store(cache)
        state = store.get(self.layer_idx)
        if state is None:
            out, state = self.mixer(x, return_states=True, **extra)
        elif (x[0].shape[-2] if split else x.shape[1]) == 1:
            # A decode step: one real token (padding only ever precedes a prompt).
            out, *state = self.mixer.step_qkv(*x, *state) if split else self.mixer.step(x, *state)
        else:
            out, state = self.mixer(x, *state, return_states=True, **extra)
        store[self.layer_idx] = tuple(state)
        return out


# -- conversion of a loaded model -------------------------------------------------------------
def decoder_layers(model) -> nn.ModuleList:
    return model.get_decoder().layers


def convert_attention(model, selected: list[list[int]], operator: ReplacementOperator) -> dict[int, nn.Module]:
    """Swap attention modules in place: every layer with selected heads gets a RecurFormer layer.

    Returns the original attention modules that were swapped out, by layer index (the shared
    teacher of :mod:`rfkit.training.teacher` puts them back to run the original model).
    """
    layers = decoder_layers(model)
    originals = {}
    for layer_idx, heads in enumerate(selected):
        if not heads:
            continue
        old = layers[layer_idx].self_attn
        base = old.v_proj.weight.dtype
        with default_dtype(torch.float32):  # new weights start in float32, whatever the caller's default
            new = RecurFormerAttention(model.config, layer_idx, heads, operator)
        for child in new.children():  # the pretrained projections in the base's dtype, the mixer in
            child.to(dtype=new_weight_dtype(base) if child is new.mixer else base)  # float32 beside a half base
        new.load_from_attention(old)
        layers[layer_idx].self_attn = new
        originals[layer_idx] = old
    return originals


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
            convert_attention(self, config.rf_selected, ReplacementOperator.from_dict(config.rf_operator))

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
        (as ``TOKEN_MASK_KWARG``) when the chunk contains padding."""
        full_mask = kwargs.pop(TOKEN_MASK_KWARG, None)
        if full_mask is None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            full_mask = attention_mask
        tokens = input_ids if input_ids is not None else inputs_embeds
        chunk_mask = _chunk_token_mask(full_mask, tokens.shape[1]) if tokens is not None else None
        if chunk_mask is not None:
            kwargs[TOKEN_MASK_KWARG] = chunk_mask
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
    fields = {k: v for k, v in old.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
    new = rf_cfg_cls(rf_selected=[list(s) for s in selected], rf_operator=operator.to_dict(), **fields)
    new._attn_implementation = old._attn_implementation
    new.architectures = [rf_model_cls.__name__]
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new
    model.__class__ = rf_model_cls
    model.config = new
    object.__setattr__(model, "rf_originals", originals)
    return model
