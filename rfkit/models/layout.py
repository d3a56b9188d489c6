"""The attention layout of a supported decoder: layers, query heads, KV heads, head dim."""

from __future__ import annotations

from dataclasses import dataclass

from rfkit.errors import RFKitError

# model_type -> whether q/k/v projections carry a bias. These families share the HF attention
# module shape (q_proj, k_proj, v_proj, o_proj; RoPE; GQA through num_key_value_heads).
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}


class LayoutError(RFKitError):
    """The model's attention layout is not one rfkit can convert. One line for the user."""


@dataclass(frozen=True)
class AttentionLayout:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.num_heads // self.num_kv_heads

    def kv_head_of(self, query_head: int) -> int:
        return query_head // self.group_size

    def query_heads_of(self, kv_head: int) -> list[int]:
        g = self.group_size
        return list(range(kv_head * g, (kv_head + 1) * g))

    @property
    def total_heads(self) -> int:
        return self.num_layers * self.num_heads

    @classmethod
    def from_config(cls, config) -> "AttentionLayout":
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        model_type = getattr(config, "rf_base_model_type", None) or config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LayoutError(
                f"model.base_model: attention layout of model_type '{model_type}' is not supported; "
                f"allowed: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        num_heads = config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if num_heads % num_kv:
            raise LayoutError(
                f"model.base_model: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}"
            )
        return cls(model_type, config.num_hidden_layers, num_heads, num_kv, head_dim, config.hidden_size)


def group_runs(per_kv: list[int]) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
    """Consecutive kept KV heads with the same number of query heads, as
    ``((first query, end), (first KV head, end), query heads per KV head)``."""
    runs, q0, k0 = [], 0, 0
    for k, n in enumerate(per_kv + [None]):
        if k == len(per_kv) or n != per_kv[k0]:
            size = per_kv[k0]
            q1 = q0 + size * (k - k0)
            runs.append(((q0, q1), (k0, k), size))
            q0, k0 = q1, k
    return runs


class GroupView:
    """The layer as the attention interface sees it, with another GQA group size (one call of a
    head-level selection whose KV heads serve different numbers of query heads)."""

    def __init__(self, layer, groups: int):
        self._layer, self.num_key_value_groups = layer, groups

    def __getattr__(self, name):
        return getattr(self._layer, name)

def _family(config) -> str:
    """The base family of a config (a converted model's ``rf_base_model_type``)."""
    return getattr(config, "rf_base_model_type", None) or config.model_type


def projection_biases(config) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) of the family's attention projections."""
    if _family(config) == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx``'s attention (None: full attention)."""
    model_type, window = _family(config), getattr(config, "sliding_window", None)
    if model_type == "qwen2":
        types = getattr(config, "layer_types", None)
        return window if types is not None and types[layer_idx] == "sliding_attention" else None
    return window if model_type == "mistral" else None
