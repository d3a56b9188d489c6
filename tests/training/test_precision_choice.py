"""``model.dtype: auto``: bf16 where the device computes it natively, float32 elsewhere, chosen
before anything is built and said in the run's first lines (rfkit.config.preflight.choose_precision,
rfkit.devices.native_bf16). The CPU's flags are faked both ways, so both branches run on any CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli, tiny_args
from jsonargparse import Namespace

import rfkit.devices as devices
from rfkit.config.preflight import choose_precision


def config(dtype="auto", precision=None, accelerator="cpu") -> Namespace:
    return Namespace(model=Namespace(dtype=dtype), trainer=Namespace(precision=precision, accelerator=accelerator))


@pytest.mark.parametrize(
    "flags, native",
    [({"fpu", "avx512f", "amx_bf16", "amx_tile"}, True), ({"fpu", "avx512_bf16"}, True), ({"fp", "asimd", "bf16"}, True),
     ({"fpu", "avx2", "avx512f"}, False), (set(), False)],
)  # fmt: skip
def test_native_bf16_reads_the_cpu_flags(flags, native, monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: flags)
    found, why = devices.native_bf16("cpu")
    assert found is native
    assert ("natively" in why) is native and ("no native bf16" in why) is not native


def test_the_cpu_flags_are_this_machines_own():
    flags = devices.cpu_flags()
    text = open("/proc/cpuinfo").read()
    assert flags and all(flag in text for flag in flags)


def test_cuda_without_a_gpu_is_not_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.native_bf16("cuda") == (False, "no CUDA device is available")


@pytest.mark.parametrize(
    "accelerator, cuda, want",
    [("cpu", True, "cpu"), ("gpu", False, "cuda"), ("cuda", False, "cuda"), ("auto", True, "cuda"), ("auto", False, "cpu"),
     (None, False, "cpu"), ("mps", False, "mps")],
)  # fmt: skip
def test_the_trainers_accelerator_names_the_device(accelerator, cuda, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert devices.accelerator_device_type(accelerator) == want


def test_auto_chooses_bf16_where_the_cpu_computes_it_and_float32_elsewhere(monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"amx_bf16"})
    c = config()
    line = choose_precision(c)
    assert (c.model.dtype, c.trainer.precision) == ("bfloat16", "bf16-true")
    assert "amx_bf16" in line and "--model.dtype float32" in line  # why, and how to pin the other
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2"})
    c = config()
    line = choose_precision(c)
    assert (c.model.dtype, c.trainer.precision) == ("float32", "32-true")
    assert "no native bf16" in line and "--model.dtype bfloat16" in line


@pytest.mark.parametrize("precision, dtype", [("bf16-true", "bfloat16"), ("16-true", "float16"), ("32-true", "float32"), ("bf16-mixed", "float32")])
def test_a_pinned_trainer_precision_decides_the_weights(precision, dtype, monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"amx_bf16"})  # the CPU's choice is not asked
    c = config(precision=precision)
    assert "pinned" in choose_precision(c)
    assert (c.model.dtype, c.trainer.precision) == (dtype, precision)


def test_a_pinned_model_dtype_is_left_alone(monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"amx_bf16"})
    c = config(dtype="float32", precision="32-true")
    assert choose_precision(c) is None and (c.model.dtype, c.trainer.precision) == ("float32", "32-true")


@pytest.mark.slow
@pytest.mark.parametrize("flags, dtype, precision", [({"avx512_bf16"}, torch.bfloat16, "bf16-true"), ({"avx2"}, torch.float32, "32-true")])
def test_a_fit_with_auto_says_what_it_chose_and_runs_it(flags, dtype, precision, tiny_model_dir, tiny_corpus, tmp_path, capsys, caplog, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(devices, "cpu_flags", lambda: flags)
    args = tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "run")
    caplog.set_level("INFO", logger="rfkit")
    code, out, err = run_cli(["fit", *args, "--model.dtype", "auto", "--trainer.precision", "null"], capsys)
    assert code == 0, err[-2000:]
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("rfkit")]
    said = [i for i, line in enumerate(lines) if line.startswith("precision")]
    assert len(said) == 1 and precision in lines[said[0]]
    assert said[0] < next(i for i, line in enumerate(lines) if line.startswith("load"))  # before the model loads
    summary = json.loads(next((tmp_path / "run").rglob("summary.json")).read_text())
    assert precision in summary["precision"]
    saved = next((tmp_path / "run").rglob("config.yaml")).read_text()
    assert f"precision: {precision}" in saved and "dtype: auto" not in saved  # the run is reproducible as chosen
    card = (Path(summary["model_dir"]) / "README.md").read_text()
    assert f"- Precision: {precision}" in card  # the model card says how its weights are kept
    model = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    kinds = {p.dtype for n, p in model.named_parameters() if ".mixer." not in n}
    assert kinds == {dtype}  # the base as chosen; the new weights stay float32
    assert {p.dtype for n, p in model.named_parameters() if ".mixer." in n} == {torch.float32}
