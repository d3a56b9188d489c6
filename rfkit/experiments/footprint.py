"""What a model holds and reads, in bytes, predicted from its layout: the cache (K/V per token of
the kept heads plus the mixers' constant state) and what one decode step reads (the weights plus
that cache). ``rfkit bench cache`` checks the prediction against a measured cache; ``rfkit bench
speed`` sets a step's bytes beside its measured speed."""

from __future__ import annotations


def analytic_cache(model, batch: int = 1) -> dict:
    """Predicted cache: K/V bytes per token (kept KV heads) and the mixers' constant state."""
    from rfkit.models.layout import AttentionLayout
    from rfkit.models.modeling import RecurFormerAttention

    layout = AttentionLayout.from_config(model.config)
    itemsize = next(model.parameters()).element_size()
    kv_heads, state = 0, 0
    for layer in model.get_decoder().layers:
        attn = layer.self_attn
        if isinstance(attn, RecurFormerAttention):
            kv_heads += len(attn.kept_kv_heads) if attn.has_kept else 0
            kv_dtype = attn.o_proj.weight.dtype
            cache_dtype = getattr(attn.mixer, "cache_dtype", None)  # a plugin's mixer may not have the hook
            state += attn.mixer.state_bytes(batch, cache_dtype(kv_dtype) if callable(cache_dtype) else kv_dtype)
        else:
            kv_heads += layout.num_kv_heads
    total_kv = layout.num_kv_heads * len(model.get_decoder().layers)
    return {
        "kv_bytes_per_token": batch * kv_heads * 2 * layout.head_dim * itemsize,
        "state_bytes": state,
        "kept_kv_fraction": kv_heads / total_kv,
    }


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters one decode step reads: every parameter once (``parameters()`` lists a
    tied one once), except that an input embedding table the output head does not share is read
    one row at a time."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not table:
        total -= table.numel() * table.element_size() - table.shape[1] * table.element_size()
    return total


def step_bytes(model, context: int, batch: int) -> dict:
    """What one decode step after ``context`` tokens reads: weights plus the cache (K/V of the kept
    heads for every token, plus the mixers' constant state), predicted from the model's layout."""
    cache = analytic_cache(model, batch)
    weights = weight_bytes_per_step(model)
    cache_bytes = cache["kv_bytes_per_token"] * context + cache["state_bytes"]
    return {"weights": weights, "cache": cache_bytes, "total": weights + cache_bytes}
