"""Numerical kernels: the selective scans (pure PyTorch, and the optional CPU C kernel), the
window mixers' FlexAttention call and the hybrid's Triton state kernels that :mod:`rfkit.models`
calls. Of the rest of rfkit only the utilities (errors, the cache folder, CPU flags).
"""
