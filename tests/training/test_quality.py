"""Conversion quality methods on tiny models: init from attention, attention transfer, the shared
teacher and distillation losses, LoRA merge, freeze schedules."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import MAMBA, SMOLLM, random_ids, run_cli, sweep_overrides, tiny_args, tiny_model
from torch import nn

from rfkit.conversion.policies import PolicyError
from rfkit.models.lora import LoraSettings, apply_lora, lora_layers
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import MambaOperator
from rfkit.training.distill import DistillConfig, DistillError, hidden_loss, kl_loss
from rfkit.training.freeze import FreezeStage, check_schedule, stage_at, trainable_names
from rfkit.training.teacher import SharedTeacher
from rfkit.training.output_loss import mapped_mse
from rfkit.training.transfer import TransferConfig, TransferError, capture, transfer

SELECTED = [[0, 1], [2, 3]]  # GQA 4/2: one whole KV group per layer


def converted(seed: int = 0, selected=SELECTED, operator=None):
    original = tiny_model("llama", seed=seed)
    model = to_recurformer(copy.deepcopy(original), selected, operator or MambaOperator())
    return original, model.eval()


class Replay(nn.Module):
    """A stand-in mixer that returns recorded outputs: the converted model then equals the original."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x, **_):
        return self.output


def replayed(model, ids):
    data = capture(model, ids, batch_size=len(ids), progress=False)
    layers = model.get_decoder().layers
    for i, (_, target) in data.items():
        layers[i].self_attn.mixer = Replay(target)
    return data


# -- capture and transfer -------------------------------------------------------------------
def test_capture_targets_rebuild_the_original_exactly():
    original, model = converted()
    ids = random_ids(2, 24)
    data = replayed(model, ids)
    assert set(data) == {0, 1}
    values, target = data[0]
    assert values.shape == (2, 24, 16) and target.shape == (2, 24, 32)  # 1 KV head in, 2 query heads out
    with torch.no_grad():
        expected = original(input_ids=ids).logits
        got = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("space", ["heads", "output"])
def test_transfer_reduces_each_layers_mse(space):
    _, model = converted()
    blocks = random_ids(8, 32, seed=3)
    config = TransferConfig(steps=40, lr=3e-3, samples=8, batch_size=4, space=space)
    report = transfer(model, blocks, config, progress=False)
    assert report["mean_mse_before"] == pytest.approx(1.0)  # zero-initialised output: predicts 0
    for layer in ("0", "1"):
        assert report["mse_after_readout"][layer] < report["mse_before"][layer]
        assert report["mse_after"][layer] < report["mse_after_readout"][layer]
    assert report["mean_mse_after"] < 0.9


@pytest.mark.parametrize("width", [8, 24])
def test_mapped_mse_equals_the_error_after_the_projection(width):
    """Transfer's output-space loss through the Gram matrix: the value and gradient of
    ``F.mse_loss(d @ P, 0)`` (width 8: fewer replaced-head columns than output ones)."""
    g = torch.Generator().manual_seed(0)
    d = torch.randn(3, 5, width, generator=g, dtype=torch.float64)
    proj = torch.randn(width, 16, generator=g, dtype=torch.float64)
    plain = d.clone().requires_grad_(True)
    want = torch.nn.functional.mse_loss(plain @ proj, torch.zeros(3, 5, 16, dtype=torch.float64))
    want.backward()
    fast = d.clone().requires_grad_(True)
    got = mapped_mse(fast, proj @ proj.T, proj)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(fast.grad, plain.grad)
    torch.testing.assert_close(mapped_mse(d, None, None), d.pow(2).mean())


def test_mapped_mse_through_a_bf16_gram_is_float32_and_close_to_exact():
    """A bf16 Gram matrix (bf16 captures): the product runs in bf16, the error, loss and gradient
    stay float32 and within bf16's rounding of the float64 values."""
    g = torch.Generator().manual_seed(1)
    d = torch.randn(2, 64, 24, generator=g, dtype=torch.float64)
    proj = torch.randn(24, 32, generator=g, dtype=torch.float64)
    exact = d.clone().requires_grad_(True)
    want = mapped_mse(exact, proj @ proj.T, proj)
    want.backward()
    low = d.float().requires_grad_(True)
    got = mapped_mse(low, (proj @ proj.T).bfloat16(), proj.float())
    got.backward()
    assert got.dtype == torch.float32 and low.grad.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=0)
    torch.testing.assert_close(low.grad.double(), exact.grad, rtol=2e-2, atol=2e-2 * float(exact.grad.abs().mean()))
    assert not torch.equal(low.grad, (2 * d @ (proj @ proj.T) / d[..., 0].numel() / 32).float())  # bf16 rounded it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_space_transfer_runs_its_gram_product_in_the_captures_dtype(dtype, monkeypatch):
    from rfkit.training import output_loss as module

    seen, real = [], module._GramSquare.forward

    def spy(ctx, d, G):
        seen.append((d.dtype, G.dtype))
        return real(ctx, d, G)

    monkeypatch.setattr(module._GramSquare, "forward", staticmethod(spy))
    _, model = converted()
    model = model.to(dtype)
    for layer in model.get_decoder().layers:  # new weights stay float32, as the fit keeps them
        if hasattr(layer.self_attn, "mixer"):
            layer.self_attn.mixer.float()
    report = transfer(model, random_ids(4, 32, seed=5), TransferConfig(steps=3, samples=4, space="output"), progress=False)
    assert seen and set(seen) == {(torch.float32, dtype)}
    assert report["mean_mse_after"] <= report["mean_mse_before"]


def test_transfer_without_readout_still_learns():
    _, model = converted()
    blocks = random_ids(4, 32, seed=4)
    report = transfer(model, blocks, TransferConfig(steps=30, samples=4, readout="none"), progress=False)
    assert report["mse_after_readout"] == report["mse_before"]
    assert report["mean_mse_after"] < report["mean_mse_before"]


def test_transfer_leaves_the_pretrained_weights_alone():
    _, model = converted()
    before = {n: p.clone() for n, p in model.named_parameters() if ".mixer." not in n}
    transfer(model, random_ids(4, 16), TransferConfig(steps=3, samples=4), progress=False)
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("steps", -1, "model.transfer.steps: -1 is not allowed"),
        ("samples", 0, "model.transfer.samples: 0 is not allowed"),
        ("lr", 0.0, "model.transfer.lr: 0.0 is not allowed"),
        ("readout", "svd", "model.transfer.readout: 'svd' is not allowed; allowed: lstsq, none"),
        ("seq_len", 1, "model.transfer.seq_len: 1 is not allowed"),
        ("space", "logits", "model.transfer.space: 'logits' is not allowed; allowed: heads, output"),
        ("time_limit", 0, "model.transfer.time_limit: 0 is not allowed"),
        ("long_seq_len", 1, "model.transfer.long_seq_len: 1 is not allowed; must be an integer >= 2"),
        ("long_samples", 0, "model.transfer.long_samples: 0 is not allowed; must be an integer >= 1"),
        ("long_batch_size", 0, "model.transfer.long_batch_size: 0 is not allowed; must be an integer >= 1"),
        ("long_source", "embedded:nope", "model.transfer.long_source: unknown embedded data 'embedded:nope'; "
         "allowed: embedded:wikipedia-en, embedded:shakespeare"),
        ("long_source", "/no/such/plays.txt", "model.transfer.long_source: path '/no/such/plays.txt' does not exist"),
        ("long_source", "", "model.transfer.long_source: empty; allowed: embedded:wikipedia-en"),
    ],
)
def test_transfer_settings_are_checked(field, value, message):
    with pytest.raises(TransferError, match=message) as err:
        TransferConfig(**{field: value})
    assert "\n" not in str(err.value)


# -- init from attention --------------------------------------------------------------------
def test_from_attention_passes_values_and_scores_through():
    from rfkit.training.freeze import init_from_attention

    _, model = converted()
    init_from_attention(model, MambaOperator())
    layer = model.get_decoder().layers[0].self_attn
    original = model.rf_originals[0]
    mixer, hd = layer.mixer, layer.head_dim
    v = torch.randn(5, hd)  # values of the layer's one mixer KV head
    # The skip path: out_proj(D * silu(in_proj_x v)) gives every replaced head its group's values.
    x = nn.functional.silu(v @ mixer.in_proj.weight[: mixer.d_inner].T)
    skip = (mixer.D * x) @ mixer.out_proj.weight.T
    torch.testing.assert_close(skip, v.repeat(1, len(layer.replaced_heads)), atol=1e-5, rtol=1e-5)
    # C(v_i) . B(v_j) is the query-key score predicted from the values (full rank here: N = hd).
    w = mixer.x_proj.weight
    b_rows, c_rows = w[mixer.dt_rank : mixer.dt_rank + mixer.d_state, :hd], w[mixer.dt_rank + mixer.d_state :, :hd]
    pinv = torch.linalg.pinv(original.v_proj.weight[:hd])
    m_k = original.k_proj.weight[:hd] @ pinv
    m_q = [original.q_proj.weight[h * hd : (h + 1) * hd] @ pinv for h in layer.replaced_heads]
    gram = sum(q.T @ m_k for q in m_q) / len(m_q) * hd**-0.5
    torch.testing.assert_close((v @ c_rows.T) @ (v @ b_rows.T).T, v @ gram @ v.T, atol=1e-3, rtol=1e-3)


def test_from_attention_needs_expand_two():
    from rfkit.models.operators import OperatorError
    from rfkit.training.freeze import init_from_attention

    operator = MambaOperator(expand=1)
    _, model = converted(operator=operator)
    with pytest.raises(OperatorError, match="expand >= 2"):
        init_from_attention(model, operator)


# -- teacher and distillation ---------------------------------------------------------------
def test_shared_teacher_is_the_original_and_shares_modules():
    original, model = converted()
    ids = random_ids(2, 20)
    teacher = SharedTeacher(model)
    with torch.no_grad():
        expected = original(input_ids=ids).logits
    torch.testing.assert_close(teacher(input_ids=ids, use_cache=False).logits, expected, atol=1e-6, rtol=1e-6)
    # afterwards the student is the converted model again (its mixers, not the originals)
    assert all(hasattr(layer.self_attn, "mixer") for layer in model.get_decoder().layers)
    memory = teacher.memory()
    held = sum(p.numel() * 4 for m in model.rf_originals.values() for p in m.parameters())
    assert memory["shared"] and memory["teacher_bytes"] == held < memory["full_copy_bytes"] / 2
    copied = SharedTeacher(model, share_modules=False)
    assert copied.memory()["teacher_bytes"] == memory["full_copy_bytes"]
    torch.testing.assert_close(copied(input_ids=ids, use_cache=False).logits, expected, atol=1e-6, rtol=1e-6)


def test_distillation_losses_vanish_when_student_is_teacher():
    _, model = converted()
    ids = random_ids(2, 20)
    replayed(model, ids)  # the student now computes exactly what the teacher does
    teacher = SharedTeacher(model)
    with torch.no_grad():
        student = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    reference = teacher(input_ids=ids, use_cache=False, output_hidden_states=True)
    assert float(kl_loss(student.logits, reference.logits, temperature=2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(hidden_loss(student.hidden_states, reference.hidden_states)) == pytest.approx(0.0, abs=1e-10)


def test_kl_loss_hand_computed():
    teacher = torch.tensor([[[0.0, 0.0]]])  # p = (1/2, 1/2)
    student = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))]]])  # q = (1/4, 3/4)
    expected = 0.5 * torch.log(torch.tensor(2.0)) + 0.5 * torch.log(torch.tensor(2 / 3))
    assert float(kl_loss(student, teacher)) == pytest.approx(float(expected), rel=1e-5)
    # temperature 2 on doubled logits is the same distribution, scaled by T^2
    assert float(kl_loss(2 * student, 2 * teacher, temperature=2.0)) == pytest.approx(4 * float(expected), rel=1e-5)
    mask = torch.tensor([[0]])
    assert float(kl_loss(student, teacher, mask=mask)) == 0.0


def _plain_kl(student, teacher, temperature, mask=None):
    """KL(teacher || student) at ``temperature``, the mean over the positions ``mask`` keeps, times
    T**2: one float64 expression (autograd), independent of rowwise_loss."""
    log_s = torch.log_softmax(student.double() / temperature, -1)
    log_t = torch.log_softmax(teacher.double() / temperature, -1)
    per = (log_t.exp() * (log_t - log_s)).sum(-1)
    m = torch.ones_like(per) if mask is None else mask.double()
    return (per * m).sum() / m.sum() * temperature**2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, masked", [(1.0, False), (2.0, True)])
def test_kl_loss_rowwise_equals_the_plain_expression(dtype, temperature, masked):
    """kl_loss runs a few positions at a time with its own gradient: the value and the student's
    gradient equal the one-expression KL's (autograd), across piece boundaries and masks."""
    from rfkit.training.distill import LOSS_ROWS

    torch.manual_seed(0)
    L = 2 * LOSS_ROWS + 3  # two whole pieces and a short one
    student = (torch.randn(2, L, 67, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    teacher = (torch.randn(2, L, 67, dtype=torch.float64) * 3).to(dtype)
    mask = (torch.rand(2, L) > 0.3) if masked else None

    value = kl_loss(student, teacher, temperature, mask)
    (grad,) = torch.autograd.grad(value, student)
    expected = _plain_kl(student, teacher, temperature, mask)
    (expected_grad,) = torch.autograd.grad(expected, student)
    assert value.dtype == torch.float32 and grad.dtype == dtype
    assert float(value) == pytest.approx(float(expected), rel=1e-5)
    tol = 1e-7 if dtype == torch.float32 else 1e-3
    assert torch.allclose(grad.double(), expected_grad.double(), atol=tol, rtol=0)
    if masked:  # positions outside the mask get no gradient
        assert float(grad[~mask].abs().max()) == 0.0


@pytest.mark.parametrize("dtype, teacher_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("terms", ["both", "ce", "kl"])
def test_compiled_loss_matches_its_pytorch_twin(dtype, teacher_dtype, temperature, terms):
    """The compiled CPU loss (three passes per row) against distill's PyTorch twin on the same
    strided logits (a batch's rows as the model hands them, the last position cut off): the CE and
    KL sums and the gradient, in the logits' dtype, with ignored targets and masked rows."""
    from rfkit.ops import cpu_kernels
    from rfkit.training import distill

    torch.manual_seed(2)
    B, L, V = 2, 9, 4099  # a vocabulary that is no multiple of the vector width
    logits = (torch.randn(B, L + 1, V, dtype=torch.float64) * 4).to(dtype)
    student = logits[:, :-1]
    teacher = None if terms == "ce" else (torch.randn(B, L, V, dtype=torch.float64) * 4).to(teacher_dtype)
    targets = torch.randint(0, V, (B, L))
    targets[0, :3] = -100
    ce_rows = None if terms == "kl" else (targets != -100).float() / (targets != -100).sum()
    kl_rows = None if terms == "ce" else (torch.rand(B, L) > 0.3).float() / (B * L) * temperature**2
    targets = None if terms == "kl" else targets
    assert distill._kernel_takes(student, teacher, torch.empty_like(student)) and cpu_kernels.available()
    results = []
    for path in (distill._rowwise_kernel, distill._rowwise_torch):
        grad = torch.empty_like(student)
        parts = path(student, teacher, targets, ce_rows, kl_rows, 0.7, 1.3, temperature, grad)
        results.append((parts, grad))
    (parts, grad), (want_parts, want_grad) = results
    torch.testing.assert_close(parts, want_parts, rtol=2e-5, atol=1e-6)
    assert grad.dtype == dtype
    tol = 1e-8 if dtype == torch.float32 else 1e-5  # bf16: both round the same float32 value, up to its last bit
    torch.testing.assert_close(grad.double(), want_grad.double(), atol=tol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_rowwise_loss_is_weighted_ce_plus_kl(temperature):
    """CE and KL in one pass: the total, its two terms and the gradient equal summed_nll's CE and
    the plain KL, weighted, with ignored targets (-100) and a KL mask."""
    from rfkit.training.distill import rowwise_loss
    from rfkit.training.losses import summed_nll

    torch.manual_seed(1)
    ids = torch.randint(0, 53, (2, 12))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that does not count
    student = (torch.randn(2, 12, 53, dtype=torch.float64) * 2).float().requires_grad_()
    teacher = torch.randn(2, 12, 53) * 2
    keep = labels[:, 1:] != -100
    total, ce, kl = rowwise_loss(
        student[:, :-1], targets=labels[:, 1:], teacher=teacher[:, :-1], temperature=temperature, kl_mask=keep, ce_weight=0.7, kl_weight=1.3
    )
    (grad,) = torch.autograd.grad(total, student)
    nll, n = summed_nll(student, ids, labels)
    expected_kl = _plain_kl(student[:, :-1], teacher[:, :-1], temperature, keep)
    expected = 0.7 * nll / n + 1.3 * expected_kl
    (expected_grad,) = torch.autograd.grad(expected, student)
    assert float(ce) == pytest.approx(float(nll / n), rel=1e-6) and float(kl) == pytest.approx(float(expected_kl), rel=1e-6)
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    assert not ce.requires_grad and not kl.requires_grad
    assert torch.allclose(grad, expected_grad, atol=1e-7, rtol=0)
    assert float(grad[:, -1].abs().max()) == 0.0  # the last position predicts nothing


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kl": -1}, "model.distill.kl: -1 is not allowed"),
        ({"temperature": 0}, "model.distill.temperature: 0 is not allowed"),
        ({"ce": 0, "kl": 0, "hidden": 0}, "at least one weight must be > 0"),
        ({"long_ce": -0.5}, "model.distill.long_ce: -0.5 is not allowed"),
        ({"long_ce": 0, "kl": 0}, "long_ce, kl and hidden are all 0"),
        ({"long_kl": -1}, "model.distill.long_kl: -1 is not allowed"),
        ({"long_kl": float("nan")}, "model.distill.long_kl: nan is not allowed"),
        ({"long_ce": 0, "long_kl": 0}, "long_ce, long_kl and hidden are all 0"),
        ({"ce": 0, "long_kl": 0}, "ce, long_kl and hidden are all 0"),
    ],
)
def test_distill_settings_are_checked(kwargs, message):
    with pytest.raises(DistillError, match=message):
        DistillConfig(**kwargs)


def test_long_ce_weighs_the_cross_entropy_of_long_batches_only():
    """``long_ce: 0``: a batch the interleaved loader marks ``long`` is distilled alone (KL),
    a short batch keeps ``ce``; unset, both keep ``ce``."""
    from rfkit.training.distill import training_loss

    _, model = converted()  # Mamba blocks in place of the selected heads: the KL to the teacher is not 0
    teacher = SharedTeacher(model)
    ids = random_ids(2, 16)
    config = DistillConfig(ce=1.0, kl=1.0, long_ce=0.0)
    with torch.no_grad():
        short, parts = training_loss(model, {"input_ids": ids}, config, teacher)
        long, long_parts = training_loss(model, {"input_ids": ids, "long": True}, config, teacher)
        plain, _ = training_loss(model, {"input_ids": ids, "long": True}, DistillConfig(ce=1.0, kl=1.0), teacher)
    assert float(parts["ce"]) > 0 and float(parts["kl"]) > 0
    assert float(short) == pytest.approx(float(parts["ce"] + parts["kl"]), rel=1e-6)
    assert float(long) == pytest.approx(float(long_parts["kl"]), rel=1e-6)  # no CE on the long batch
    assert float(plain) == pytest.approx(float(short), rel=1e-6)
    assert config.ce_weight({"long": False}) == 1.0 and config.ce_weight({"long": True}) == 0.0


class CountingTeacher:
    """A teacher that counts its forwards."""

    def __init__(self, teacher):
        self.teacher, self.calls = teacher, 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.teacher(**kwargs)


def test_long_kl_zero_trains_long_batches_on_cross_entropy_without_the_teacher():
    """``long_kl: 0``: a long batch's loss is its cross-entropy alone and the teacher never runs
    on it (the forward it saves is the point); a short batch keeps CE + KL; unset, the long batch
    keeps ``kl``. ``kl: 0`` with ``long_kl`` > 0 still needs the teacher."""
    from rfkit.training.distill import training_loss

    _, model = converted()
    teacher = CountingTeacher(SharedTeacher(model))
    ids = random_ids(2, 16)
    config = DistillConfig(ce=1.0, kl=1.0, long_kl=0.0)
    with torch.no_grad():
        short, parts = training_loss(model, {"input_ids": ids}, config, teacher)
        assert teacher.calls == 1
        long, long_parts = training_loss(model, {"input_ids": ids, "long": True}, config, teacher)
        assert teacher.calls == 1  # no teacher forward for the long batch
        plain, plain_parts = training_loss(model, {"input_ids": ids, "long": True}, DistillConfig(ce=1.0, kl=1.0), teacher)
        assert teacher.calls == 2
    assert float(parts["kl"]) > 0 and "kl" not in long_parts and "kl" in plain_parts
    assert float(long) == pytest.approx(float(long_parts["ce"]), rel=1e-6)
    assert float(long_parts["ce"]) == pytest.approx(float(parts["ce"]), rel=1e-6)  # the same ids, the same CE
    assert float(plain) == pytest.approx(float(short), rel=1e-6) and float(long) < float(short)
    assert config.kl_weight({"long": False}) == 1.0 and config.kl_weight({"long": True}) == 0.0
    assert config.needs_teacher and DistillConfig(kl=0.0, long_kl=0.5).needs_teacher
    assert not DistillConfig(kl=0.0).needs_teacher


# -- LoRA -----------------------------------------------------------------------------------
def test_lora_merge_gives_identical_logits_and_plain_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    from rfkit.conversion.convert import save_converted
    from rfkit.conversion.headmap import HeadMap

    _, model = converted()
    count = apply_lora(model, LoraSettings(r=4))
    assert count == 2 * 5  # qkv (packed: q, k, v named), o, gate, up, down in both converted layers
    torch.manual_seed(5)
    for _, layer in lora_layers(model):
        nn.init.normal_(layer.lora_B["default"].weight, std=0.05)  # a trained, non-zero adapter
    ids = random_ids(2, 16)
    with torch.no_grad():
        with_adapters = model(input_ids=ids, use_cache=False).logits
        teacher_view = SharedTeacher(model)(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(with_adapters, teacher_view)  # adapters change the model; the teacher ignores them
    # the teacher leaves the adapters' requires_grad as it found them (a freeze stage may hold them)
    for _, layer in lora_layers(model):
        layer.requires_grad_(False)
    SharedTeacher(model)(input_ids=ids, use_cache=False)
    assert not any(p.requires_grad for _, layer in lora_layers(model) for p in layer.parameters())
    from rfkit.conversion.policies import ExplicitHeads
    from rfkit.models.layout import AttentionLayout

    policy = ExplicitHeads(heads=SELECTED)
    head_map = HeadMap.build("tiny", AttentionLayout.from_config(model.config), None, SELECTED, policy, {})
    save_converted(model, head_map, tmp_path / "merged")
    assert lora_layers(model) == []
    with torch.no_grad():
        merged = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(merged, with_adapters, atol=1e-5, rtol=1e-5)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, with_adapters, atol=1e-5, rtol=1e-5)


def test_lora_never_targets_the_new_blocks():
    _, model = converted()
    apply_lora(model, LoraSettings(target_modules=["out_proj", "o_proj"]))
    names = [n for n, _ in lora_layers(model)]
    assert names and all(".mixer." not in n for n in names)


# -- freezing -------------------------------------------------------------------------------
def test_freeze_presets_with_lora():
    _, model = converted()
    apply_lora(model, LoraSettings(r=2))
    mixers = trainable_names(model, "mixers")
    adapters = trainable_names(model, "lora")
    assert mixers and all(".mixer." in n for n in mixers)
    assert adapters and all(".lora_" in n for n in adapters)
    assert trainable_names(model, "pretrained") == mixers | adapters
    assert trainable_names(model, "all") == set()


def test_freeze_schedule_stages():
    schedule = check_schedule([{"freeze": "mixers", "steps": 3}, {"freeze": "pretrained", "steps": 2}, {"freeze": "none"}])
    assert [stage_at(schedule, s) for s in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    closed = check_schedule([FreezeStage("mixers", 2), FreezeStage("lora", 2)])
    assert stage_at(closed, 10) == 1
    with pytest.raises(PolicyError, match=r"model.freeze_schedule\[0\].steps: only the last stage"):
        check_schedule([{"freeze": "mixers"}, {"freeze": "none"}])
    with pytest.raises(PolicyError, match=r"model.freeze_schedule\[1\].freeze: 'embeddings' is not allowed"):
        check_schedule([{"freeze": "mixers", "steps": 1}, {"freeze": "embeddings"}])


# -- through rfkit fit ----------------------------------------------------------------------
@pytest.mark.slow
def test_fit_with_transfer_distillation_lora_and_schedule(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    args = [  # the Mamba recipe: init from_attention is a Mamba block's
        "fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path, recipe=MAMBA),
        "--trainer.max_steps", "4",
        "--model.init", "from_attention",
        "--model.transfer.steps", "5",
        "--model.transfer.samples", "4",
        "--model.distill.kl", "1.0",
        "--model.distill.hidden", "0.5",
        "--model.lora.r", "2",
        "--model.gradient_checkpointing", "true",
        "--model.freeze_schedule", '[{"freeze": "mixers", "steps": 2}, {"freeze": "pretrained"}]',
    ]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert summary["train_tokens"] > 0
    assert summary["transfer"]["mean_mse_after"] < summary["transfer"]["mean_mse_before"]
    assert summary["shared"] is True and summary["teacher_bytes"] < summary["full_copy_bytes"]
    assert summary["lora_layers"] > 0
    assert summary["ppl_converted"] > 0
    model = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    assert not any("lora" in n for n, _ in model.named_parameters())


@pytest.mark.slow
def test_fit_rejects_a_shared_teacher_with_trained_shared_weights(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    args = ["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path), "--model.freeze", "none", "--model.distill.kl", "1"]
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert "model.distill.share_modules" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, field",
    [
        (["--model.transfer.steps", "-1"], "model.transfer.steps"),
        (["--model.transfer.space", "logits"], "model.transfer.space"),
        (["--model.transfer.long_source", "embedded:nope"], "model.transfer.long_source"),
        (["--model.transfer.long_seq_len", "1"], "model.transfer.long_seq_len"),
        (["--model.distill.temperature", "0"], "model.distill.temperature"),
        (["--model.lora.r", "0"], "model.lora.r"),
        (["--model.init", "identity"], "model.init"),
        (["--model.freeze_schedule", '[{"freeze": "mixers"}, {"freeze": "lora"}]'], "model.freeze_schedule[0].steps"),
    ],
)
def test_bad_quality_settings_are_one_line_before_loading(extra, field, monkeypatch, tiny_model_dir, tiny_corpus, tmp_path, capsys):
    import rfkit.conversion.convert

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rfkit.conversion.convert, "load_base_model", no_loading)
    code, _, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path), *extra], capsys)
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
    assert len(lines) == 1 and field in lines[0], err[-2000:]
    assert "Traceback" not in err


@pytest.mark.slow
def test_the_lora_control_fits_at_beta_0(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """The control for a LoRA lever: the same recipe at beta 0 trains the same adapters on the
    untouched attention, so the converted model can be compared with the adapted original."""
    args = [
        "fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path),
        "--model.policy.init_args.beta", "0",
        "--model.lora.r", "2",
        "--model.lora.alpha", "2",
    ]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert summary["replaced_heads"] == 0 and summary["lora_layers"] > 0
    assert summary["cache_bytes_per_token_converted"] == summary["cache_bytes_per_token_original"]
    assert summary["ppl_converted"] != summary["ppl_original"]  # the adapters trained
    # rfkit sweep scores it beside converted models: one trained row, no state to switch off
    out_dir = tmp_path / "sweep"
    args = [
        "sweep", "--config", SMOLLM, "--betas", "0.5", "--operators", "sink_recent(sink=4,window=16)",
        "--trained", summary["model_dir"], "--cache-length", "64", "--no-record", "--output", str(out_dir),
        *sweep_overrides(tiny_model_dir, tiny_corpus),
        "--model.dtype", "float32",  # the dtype the control was fitted and saved in
    ]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    result = json.loads((out_dir / "sweep.json").read_text())
    (control,) = [r for r in result["rows"] if r["trained"]]
    assert control["beta"] == 0 and control["cache_ratio"] == 1.0 and control["operator"] == "attention trained"
    assert control["ppl_ratio"] == pytest.approx(control["ppl"] / result["original"]["ppl"])
