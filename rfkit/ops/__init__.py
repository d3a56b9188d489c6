"""Numerical kernels: the selective scans (pure PyTorch, and the optional CPU C kernel) that
:mod:`rfkit.models` calls. No dependency on the rest of rfkit.
"""
