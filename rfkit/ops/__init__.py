"""Numerical kernels: the selective scans (pure PyTorch, and the optional CPU C kernel) and the
window mixers' FlexAttention call that :mod:`rfkit.models` calls. Of the rest of rfkit only the
utilities (errors, the cache folder, CPU flags).
"""
