"""The converted model: HF classes (``rf_llama``, ``rf_mistral``, ``rf_qwen2``), their cache, and the
mixers that stand in for replaced heads (Mamba block, window attention, hybrid window + state);
plus the attention layout of a supported decoder and the cheap checks that a model source has one.

Depends on :mod:`rfkit.ops` (and the bottom-layer :mod:`rfkit.hub`) only; nothing here knows about
training.
"""
