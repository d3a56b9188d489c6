"""The paper's evaluations and the reviewers' ones, each a module with a command:

    rfkit data hashhop   write HashHop samples (JSONL)
    rfkit eval hashhop   h_gq: greedy chain completion through the hybrid cache
    rfkit eval passkey   passkey retrieval at several lengths and depths
    rfkit eval context   long-document perplexity and passkey per length, against the training-free baseline
    rfkit eval needles   needles of other shapes (fillers, long keys, several keys), against the same
    rfkit eval ppl       perplexity on held-out text, sliding window for long documents
    rfkit eval mqar      MQAR ablation over beta (paper Fig. 4), from a recipe
    rfkit eval lm-eval   lm-evaluation-harness tasks on a converted model (``eval`` extra)

Each task module defines ``add_arguments(parser)``, ``validate(args)`` (checks that need no
model; raise :class:`rfkit.evals.common.EvalError`) and ``run(args) -> int``.
:mod:`rfkit.evals.perplexity` is the perplexity evaluation they and ``rfkit fit``'s callbacks share.

This file imports nothing: the callbacks import :mod:`rfkit.evals.perplexity`, and importing it
runs this file first, which must not load the evaluation commands (a layer above the callbacks).
"""
