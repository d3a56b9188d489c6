"""Attention transfer with the model on the device: what ``capture`` keeps in host memory (pinned
where CUDA is, so uploads copy straight from it), the uploads of ``_rows`` (through a pinned staging
tensor and a non-blocking copy on CUDA; plain indexing on the CPU, where there is no page-locked
memory to ask for), and a whole ``transfer`` (capture, calibration or read-out solve, training)
on the device in float32 and with a bf16 base."""

from __future__ import annotations

import math

import pytest
import torch
from cuda_models import converted, loud_original, rel_err
from helpers import random_ids
from torch import nn

from rfkit.training import transfer as transfer_module
from rfkit.training.transfer import TransferConfig, capture, transfer

pytestmark = pytest.mark.cuda


class Replay(nn.Module):
    """A stand-in mixer that returns recorded outputs: the converted model then equals the original."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output

    def forward(self, x, **_):
        return self.output


@pytest.mark.parametrize("kind", ["mamba", "hybrid"])
def test_capture_keeps_pinned_host_buffers_that_rebuild_the_original(kind, device):
    """Captured in two batches from the model on the device: host tensors, pinned exactly where
    CUDA is; replayed as the mixers' outputs on the device they give the original model's logits."""
    model = converted(kind).to(device)
    ids = random_ids(4, 24, seed=2)
    data = capture(model, ids, batch_size=2, progress=False)
    assert sorted(data) == [0, 1]
    for values, target in data.values():
        for t in (values, target):
            assert t.device.type == "cpu" and t.dtype == torch.float32 and len(t) == 4
            assert t.is_pinned() == (device.type == "cuda")
    with torch.no_grad():
        expected = loud_original().to(device)(ids.to(device)).logits
        for i, (_, target) in data.items():
            model.model.layers[i].self_attn.mixer = Replay(target.to(device))
        got = model(ids.to(device), use_cache=False).logits
    assert got.device.type == device.type
    assert rel_err(got, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_uploads_equal_their_source_through_a_pinned_staging_tensor_on_cuda(dtype, device, monkeypatch):
    model = converted("hybrid", dtype).to(device)
    values, target = capture(model, random_ids(4, 24, seed=2), batch_size=4, progress=False)[0]
    assert values.dtype == target.dtype == dtype  # kept in the model's dtype
    staged = []
    real = torch.index_select

    def recording(*args, out=None, **kwargs):
        if out is not None:
            staged.append(out)
        return real(*args, out=out, **kwargs) if out is not None else real(*args, **kwargs)

    monkeypatch.setattr(torch, "index_select", recording)
    rows, span = torch.tensor([3, 0, 3]), slice(5, 21)
    for src in (values, target):
        got = transfer_module._rows(src, rows, span, device)
        assert got.device.type == device.type and got.dtype == dtype
        assert torch.equal(got.cpu(), src[:, span][rows])
    if device.type == "cuda":  # one page-locked staging tensor per upload, gathered on the host
        assert len(staged) == 2 and all(t.is_pinned() and t.device.type == "cpu" for t in staged)
    else:  # no pinned source on the CPU: indexed in place, nothing staged
        assert staged == []


@pytest.mark.parametrize(
    ("kind", "dtype"), [("mamba", torch.float32), ("hybrid", torch.bfloat16), ("hybrid_mamba", torch.bfloat16)],
    ids=["mamba-float32", "hybrid-bf16", "hybrid_mamba-bf16"],
)  # fmt: skip
def test_transfer_runs_on_the_device_and_keeps_the_new_weights_there_in_float32(kind, dtype, device):
    """Capture, the mixer's calibration (the hybrids) or the read-out solve (Mamba), three
    training steps from the pinned captures, and the evaluations, all with the mixers on the
    device: finite errors, the read-out solve lowering Mamba's, and the mixers' weights trained
    in place, still float32 on the device."""
    model = converted(kind, dtype).to(device)
    mixers = {i: layer.self_attn.mixer for i, layer in enumerate(model.model.layers)}
    before = {(i, n): p.detach().clone() for i, m in mixers.items() for n, p in m.named_parameters()}
    config = TransferConfig(steps=3, samples=4, batch_size=2, seq_len=16, lr=1e-2)
    report = transfer(model, random_ids(4, 24, seed=3), config, progress=False)
    assert report["steps_run"] == 3 and all(math.isfinite(x) for x in report["losses"])
    for key in ("mse_before", "mse_after_readout", "mse_after"):
        assert all(math.isfinite(x) for x in report[key].values()), key
    if kind == "mamba":
        assert all(report["mse_after_readout"][i] < report["mse_before"][i] for i in report["mse_before"])
    else:
        assert sorted(report["calibration"]) == ["0", "1"]
    for i, mixer in mixers.items():
        assert model.model.layers[i].self_attn.mixer is mixer
        for name, param in mixer.named_parameters():
            assert param.device.type == device.type and param.dtype == torch.float32, name
    changed = [key for key, p in before.items() if not torch.equal(p, dict(mixers[key[0]].named_parameters())[key[1]])]
    assert changed  # calibrated, solved or trained
