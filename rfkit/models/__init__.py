"""The converted model: HF classes (``rf_llama``, ``rf_mistral``, ``rf_qwen2``), their cache, and the
mixers that stand in for replaced heads (Mamba block, window attention, hybrid window + state).

Depends on :mod:`rfkit.ops` only; nothing here knows about recipes or training.
"""
