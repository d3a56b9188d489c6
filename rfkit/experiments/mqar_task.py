"""The MQAR task of ``rfkit eval mqar``: synthetic examples and their accuracy.

Multi-query associative recall (MQAR, Zoology style): a sequence opens with key-value pairs
``k1 v1 k2 v2 ...``, then queries the keys again later on; the model must answer each queried
key with its value.

**Data** (:func:`make_mqar`). Token 0 is reserved (never generated; free for padding). Keys are
drawn from ``[1, 1 + K)`` and values from ``[1 + K, vocab_size)`` with ``K = (vocab_size - 1) // 2``,
both without replacement inside an example. The query region after the ``2 * num_kv_pairs``
prefix tokens is cut into ``(input_seq_len - 2 * num_kv_pairs) // 2`` two-token slots; every
queried key takes one slot, chosen without replacement with Zoology's power law
``p(slot i) ~ power_a * i ** (power_a - 1)`` (i = 1, 2, ...: early slots, i.e. short gaps, more
likely). Every other position holds a noise token drawn from the *value* half (so a key never
appears outside its pair and its query, which would plant a false association in a small
vocabulary). Labels are -100 everywhere except at each answer.

**Alignment** (self-consistent, next-token): a queried key sits at ``inputs[t]``, its value at
``inputs[t + 1]`` and ``labels[t + 1] = value``. The logits at ``t`` predict ``labels[t + 1]``,
exactly as :func:`rfkit.training.losses.summed_nll` shifts them, and the value in the input keeps the
sequence an ordinary token stream. (Zoology instead puts noise after the key and does not shift
its labels.) Accuracy (:func:`mqar_accuracy`) is the fraction of labelled positions whose argmax
prediction from the previous position equals the value.
"""

from __future__ import annotations

import torch

from rfkit.evals.common import EvalError
from rfkit.validate import fraction, positive_int

RESERVED_IDS = 1  # token 0: never generated


class MQARError(EvalError):
    """Bad MQAR input; one line for the user, naming the field."""


def vocab_split(vocab_size: int) -> tuple[range, range]:
    """(key ids, value ids) of a vocabulary: two disjoint halves above the reserved id 0."""
    k = (vocab_size - RESERVED_IDS) // 2
    return range(RESERVED_IDS, RESERVED_IDS + k), range(RESERVED_IDS + k, vocab_size)


def check_mqar_settings(
    input_seq_len: int, num_kv_pairs: int, vocab_size: int, num_queries: int | None = None, prefix: str = ""
) -> int:
    """Raise :class:`MQARError` unless the settings make a valid MQAR task; returns the query count."""
    positive_int(f"{prefix}input_seq_len", input_seq_len, error=MQARError)
    positive_int(f"{prefix}num_kv_pairs", num_kv_pairs, error=MQARError)
    positive_int(f"{prefix}vocab_size", vocab_size, error=MQARError)
    queries = num_kv_pairs if num_queries is None else positive_int(f"{prefix}num_queries", num_queries, error=MQARError)
    if queries > num_kv_pairs:
        raise MQARError(f"{prefix}num_queries: {queries} exceeds num_kv_pairs {num_kv_pairs} (each key is queried at most once)")
    keys, values = vocab_split(vocab_size)
    if len(keys) < num_kv_pairs or len(values) < num_kv_pairs:
        raise MQARError(
            f"{prefix}vocab_size: {vocab_size} is too small for {num_kv_pairs} distinct keys and values; "
            f"needs at least {2 * num_kv_pairs + RESERVED_IDS}"
        )
    slots = (input_seq_len - 2 * num_kv_pairs) // 2
    if slots < queries:
        need = 2 * num_kv_pairs + 2 * queries
        raise MQARError(
            f"{prefix}input_seq_len: {input_seq_len} cannot hold {num_kv_pairs} key-value pairs and {queries} "
            f"queries; needs at least 2*num_kv_pairs + 2*queries = {need}"
        )
    return queries


def make_mqar(
    num_examples: int,
    input_seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    power_a: float = 0.01,
    seed: int = 0,
    num_queries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zoology-style MQAR examples: ``(inputs, labels)``, both ``(num_examples, input_seq_len)`` long.

    ``inputs = k1 v1 ... kP vP | query region``; in the query region each queried key is followed
    by its value, at two-token slots drawn (without replacement) with probability proportional to
    ``power_a * i ** (power_a - 1)`` for slot i = 1, 2, ...; the other positions are noise from the
    value half of the vocabulary. ``labels`` is -100 except ``labels[t + 1] = value`` where
    ``inputs[t]`` is a queried key (next-token alignment, see the module docstring).
    ``num_queries`` (default ``num_kv_pairs``) keys are queried, each once. Deterministic in ``seed``.
    """
    positive_int("num_examples", num_examples, error=MQARError)
    queries = check_mqar_settings(input_seq_len, num_kv_pairs, vocab_size, num_queries)
    fraction("power_a", power_a, low_open=True, error=MQARError, message="{field}: must lie {bounds}, got {value!r}")
    g = torch.Generator().manual_seed(int(seed))
    key_ids, value_ids = vocab_split(vocab_size)
    n, p = num_examples, num_kv_pairs
    keys = torch.rand(n, len(key_ids), generator=g).argsort(dim=1)[:, :p] + key_ids.start  # (n, p) distinct
    values = torch.rand(n, len(value_ids), generator=g).argsort(dim=1)[:, :p] + value_ids.start  # (n, p)
    slots = (input_seq_len - 2 * p) // 2
    ranks = torch.arange(1, slots + 1, dtype=torch.float64)
    weights = (float(power_a) * ranks ** (float(power_a) - 1.0)).expand(n, slots)
    gaps = torch.multinomial(weights, queries, replacement=False, generator=g)  # (n, q) slot per query
    asked = torch.rand(n, p, generator=g).argsort(dim=1)[:, :queries]  # (n, q) which pairs are queried
    inputs = torch.randint(value_ids.start, value_ids.stop, (n, input_seq_len), generator=g)  # noise
    inputs[:, 0 : 2 * p : 2] = keys
    inputs[:, 1 : 2 * p : 2] = values
    key_pos = 2 * p + 2 * gaps  # (n, q)
    asked_keys, asked_values = keys.gather(1, asked), values.gather(1, asked)
    inputs.scatter_(1, key_pos, asked_keys)
    inputs.scatter_(1, key_pos + 1, asked_values)
    labels = torch.full_like(inputs, -100)
    labels.scatter_(1, key_pos + 1, asked_values)
    return inputs, labels


@torch.no_grad()
def mqar_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """``(correct, total)`` over labelled positions: ``argmax logits[:, t]`` against ``labels[:, t + 1]``."""
    targets = labels[:, 1:]
    mask = targets != -100
    predicted = logits[:, :-1].argmax(dim=-1)
    return int((predicted[mask] == targets[mask]).sum()), int(mask.sum())
