"""A needle key's margin in one forward, and the state audit's forwards that replay what a change
did not touch (:mod:`rfkit.training.state_audit` asks them; ``benchmarks/needle_margins.py``
reads :func:`margins` too).

The margin: with the key's tokens following the prompt (teacher forced), at each of them the
log-probability of the key's token minus the best other token's, the smallest over the key
(above 0: the greedy answer is the whole key), read from float32 logits."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rfkit.errors import RFKitError
from rfkit.models.modeling import decoder_layers


def answer_tokens(tokenizer, text: str, key: int, prompt: list[int] | None = None) -> list[int]:
    """The tokens the model must produce after ``text`` to answer ``key`` (the key's leading space
    merged as the tokenizer merges it). ``prompt``: ``text``'s ids when already tokenized."""
    full = tokenizer(text + f" {key}")["input_ids"]
    if prompt is None:
        prompt = tokenizer(text)["input_ids"]
    if full[: len(prompt)] != prompt or len(full) == len(prompt):
        raise RFKitError("the prompt's tokens change when the key follows it; cannot name the answer's tokens")
    return full[len(prompt) :]


def prompt_pairs(tokenizer, records: list[dict]) -> list[tuple[torch.Tensor, list[int]]]:
    """``(ids (1, L), the key's tokens)`` for each needle record, the prompt tokenized as ``rfkit
    eval needles`` tokenizes it."""
    pairs = []
    for r in records:
        ids = tokenizer(r["text"])["input_ids"]
        pairs.append((torch.tensor([ids]), answer_tokens(tokenizer, r["text"], r["key"], ids)))
    return pairs


@contextlib.contextmanager
def float32_logits(model: nn.Module):
    """Within the block, the output projection (``lm_head``) computes in float32 from the last
    hidden state, whatever the model's dtype: a bf16 logit of about 20 is rounded to 1/8, coarser
    than the margins the audit compares."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        yield
        return

    def exact(module, inputs, output):
        bias = None if module.bias is None else module.bias.float()
        return torch.nn.functional.linear(inputs[0].float(), module.weight.float(), bias)

    handle = head.register_forward_hook(exact)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def margins(model: nn.Module, prompts: list[tuple[torch.Tensor, list[int]]]) -> list[dict]:
    """Per prompt, with the key's tokens following it (teacher forced; one forward): at each key
    token the log-probability of that token minus the best other token's. ``{"margin"}``: the
    smallest (above 0: the greedy answer is the whole key), ``"first"``: the first token's,
    ``"top"``: the best token at the answering position, ``"weakest"``: which key token has the
    smallest."""
    device = next(model.parameters()).device
    out = []
    for ids, answer in prompts:
        given = torch.cat([ids, torch.tensor([answer[:-1]], dtype=ids.dtype)], dim=1).to(device)
        with float32_logits(model):
            logp = model(input_ids=given, use_cache=False, logits_to_keep=len(answer)).logits[0].float().log_softmax(-1)
        rows = torch.arange(len(answer), device=logp.device)
        wanted = torch.tensor(answer, device=logp.device)
        right = logp[rows, wanted]
        other = logp.clone()
        other[rows, wanted] = float("-inf")
        each = right - other.max(-1).values
        weakest = int(each.argmin())
        out.append({"margin": round(float(each[weakest]), 4), "first": round(float(each[0]), 4), "top": int(logp[0].argmax()), "weakest": weakest})
    return out


class Measure:
    """The audit's margins (:func:`margins`) over its prompts, with each prompt's decoder-layer
    outputs kept for the gates as they stand, so that a forward after a change in layer ``start``
    and later replays the layers before ``start`` instead of computing them again: the same
    numbers bit for bit (those layers' inputs and weights did not change), in about half the time
    when the changed layers spread over the model. The outputs are kept in host memory (on a GPU
    the one a forward needs is copied back).

    ``measure(indices, start, record)``: the margins of those prompts (indices into ``prompts``);
    the layers below ``start`` replayed where this prompt's outputs are kept (computed otherwise);
    with ``record``, the outputs from ``start`` on are held back until :meth:`commit` (the gates
    were changed for good: the prompts just measured are kept, every other prompt's outputs
    dropped) or :meth:`discard` (the change was undone). ``replay=False``: every forward whole (a
    check on the replay; nothing kept)."""

    def __init__(self, model: nn.Module, prompts: list[tuple[torch.Tensor, list[int]]], replay: bool = True):
        self.model, self.prompts, self.replay = model, prompts, replay
        self.layers = list(decoder_layers(model))
        self.device = next(model.parameters()).device
        self.kept: dict[int, list] = {}  # in host memory: a 7B model's 4,096-token prompt keeps about 1 GB
        self.pending: dict[int, dict[int, object]] = {}

    def __call__(self, indices: list[int], start: int = 0, record: bool = False) -> list[float]:
        out = []
        for i in indices:
            stored = self.kept.get(i) if self.replay else None
            begin = start if stored is not None else 0
            got: dict[int, object] = {}
            with self._replayed(stored, begin), self._recorded(got, begin, record and self.replay):
                [m] = margins(self.model, [self.prompts[i]])
            if record and self.replay:
                self.pending[i] = got
            out.append(m["margin"])
        return out

    def commit(self) -> None:
        kept = {}
        for i, got in self.pending.items():
            base = list(self.kept.get(i) or [None] * len(self.layers))
            for j, output in got.items():
                base[j] = output
            kept[i] = base
        self.kept, self.pending = kept, {}

    def discard(self) -> None:
        self.pending = {}

    def forget(self, keep: list[int]) -> None:
        """Drop the outputs of every prompt not in ``keep``."""
        keep = set(keep)
        self.kept = {i: v for i, v in self.kept.items() if i in keep}

    @contextlib.contextmanager
    def _replayed(self, stored, start: int):
        patched = []
        try:
            if start:  # the layers before start hand on, unread, the input start needs (hooks still run)
                given = _moved(stored[start - 1], self.device)
                for layer in self.layers[:start]:
                    patched.append((layer, layer.__dict__.get("forward")))
                    layer.forward = lambda *args, **kwargs: given
            yield
        finally:
            for layer, own in patched:
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own

    @contextlib.contextmanager
    def _recorded(self, got: dict, start: int, on: bool):
        handles = []
        if on:
            for j in range(start, len(self.layers)):
                handles.append(self.layers[j].register_forward_hook((lambda j: lambda module, inputs, output: got.__setitem__(j, _moved(output, "cpu")))(j)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _moved(output, device):
    """A decoder layer's output (a tensor, or a tuple holding them) on ``device``."""
    if isinstance(output, torch.Tensor):
        return output.to(device)
    if isinstance(output, (tuple, list)):
        return type(output)(_moved(x, device) for x in output)
    return output
