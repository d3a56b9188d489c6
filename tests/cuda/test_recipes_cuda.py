"""Every GPU recipe (``llama2_b09*``, ``qwen2_*``) run whole through the CLI on the device with its own
precision (``bf16-true`` over a bf16 base, float32 new weights), freeze setting and schedule,
transfer, LoRA and strategy: tests/test_recipe_dry_runs.py's dry run at the tiny scale, with
``--trainer.accelerator gpu`` on CUDA and the recipe's own Lightning ``FSDPStrategy`` on one GPU
(its full-state ``last.ckpt`` written), where the CPU dry run swaps in the test-only
``CPUFSDPStrategy`` and turns checkpointing off. The CPU twin keeps exactly the CPU dry run's
settings (accelerator cpu, ``CPUFSDPStrategy``) and runs two of the recipes, one under FSDP and
one on a single device; ``RFKIT_CUDA_TWIN_RECIPES=all`` runs all of them there too.

Each run's summary names the device it ran on; its last checkpoint, where one is written, holds
the CUDA generator on CUDA; its saved model loads in the recipe's dtypes and greedy ``generate`` on
the device picks what one full forward picks."""

from __future__ import annotations

import math
import os

import pytest
import test_recipe_dry_runs as dry_runs
import torch
import yaml
from cuda_models import TOLERANCE, assert_greedy
from helpers import ROOT
from test_recipe_dry_runs import check_saved_model, dry_run, tiny_dirs  # noqa: F401  (tiny_dirs: a fixture)

from rfkit.training.checkpointing import RNG_KEY

pytestmark = pytest.mark.cuda

GPU_RECIPES = sorted(p.stem for glob in ("llama2_b09*.yaml", "qwen2_*.yaml") for p in (ROOT / "recipes").glob(glob))
#: the twin's two: FSDP with LoRA and a freeze schedule (Mamba), one device with gradient checkpointing (hybrid)
TWIN_RECIPES = ["llama2_b09", "qwen2_05b_b05_hybrid"]
ALL = torch.cuda.is_available() or os.environ.get("RFKIT_CUDA_TWIN_RECIPES") == "all"
CPU_ONLY = {"--trainer.strategy.class_path": "test_ddp.CPUFSDPStrategy", "--trainer.enable_checkpointing": "false"}


def on_device(args: list[str], device: torch.device) -> list[str]:
    """``scale_args``' overrides for ``device``: unchanged on the CPU twin; on CUDA the recipe's own
    accelerator (gpu) and strategy (the CPU stand-in for FSDP and its checkpointing switch
    dropped: the recipe's FSDPStrategy runs, on the one device ``scale_args`` asks for)."""
    if device.type != "cuda":
        return list(args)
    out, i = [], 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) else None
        if flag == "--trainer.accelerator":
            out += [flag, "gpu"]
            i += 2
        elif CPU_ONLY.get(flag, object()) == value:
            i += 2
        else:
            out.append(flag)
            i += 1
    assert out.count("gpu") == 1 and not any("CPUFSDP" in a for a in out)
    return out


def test_the_gpu_recipes_are_the_six_shipped_ones():
    assert GPU_RECIPES == [
        "llama2_b09", "llama2_b09_hybrid", "qwen2_05b_b05", "qwen2_05b_b05_hybrid",
        "qwen2_7b_b09", "qwen2_7b_b09_hybrid",
    ]  # fmt: skip
    assert set(TWIN_RECIPES) <= set(GPU_RECIPES)


def test_on_device_swaps_the_cpu_overrides_for_the_recipes_own(tmp_path):
    args = dry_runs.scale_args("llama2_b09", tmp_path, tmp_path / "docs.jsonl", tmp_path)
    assert on_device(args, torch.device("cpu")) == args
    gpu = on_device(args, torch.device("cuda"))
    assert gpu[gpu.index("--trainer.accelerator") + 1] == "gpu" and gpu[gpu.index("--trainer.devices") + 1] == "1"
    assert "--trainer.strategy.class_path" not in gpu and "--trainer.enable_checkpointing" not in gpu
    assert len(gpu) == len(args) - 4  # nothing else touched


@pytest.mark.slow
@pytest.mark.parametrize("name", GPU_RECIPES if ALL else TWIN_RECIPES)
def test_gpu_recipe_runs_whole_on_the_device(
    name, device, tiny_dirs, tiny_corpus, tmp_path, capsys, monkeypatch  # noqa: F811  (tiny_dirs: the imported fixture)
):
    recipe = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    real = dry_runs.scale_args
    monkeypatch.setattr(dry_runs, "scale_args", lambda *a, **kw: on_device(real(*a, **kw), device))
    run = dry_run(name, tiny_dirs, tiny_corpus, tmp_path, capsys, monkeypatch)
    summary = run["summary"]
    assert summary["device"].split(":")[0] == device.type, summary["device"]  # "cuda:0" on the GPU
    assert summary["replaced_heads"] > 0 and summary["train_tokens"] > 0
    assert math.isfinite(summary["ppl_converted"]) and summary["ppl_converted"] > 1
    if recipe["model"].get("transfer"):
        assert summary["transfer"]["steps_run"] == 2
    fsdp = str((recipe["trainer"].get("strategy") or {}).get("class_path", "")).endswith("FSDPStrategy")
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file() == (device.type == "cuda" or not fsdp)  # the CPU stand-in for FSDP writes none
    if last.is_file():
        states = torch.load(last, map_location="cpu", weights_only=True)[RNG_KEY]
        assert ("cuda" in states) == (device.type == "cuda")
    dtype = torch.bfloat16 if recipe["model"].get("dtype") == "bfloat16" else torch.float32
    if device.type == "cpu":  # the CPU dry run's own check: exact argmax on this CPU
        check_saved_model(run["model"], recipe)
    generates_on(device, run["model"], dtype)


def generates_on(device: torch.device, model_dir, dtype: torch.dtype) -> None:
    """The saved model loads with the base in ``dtype`` and float32 new weights (as
    ``check_saved_model`` checks) and, on ``device``, greedy ``generate`` picks what one full
    forward picks there (up to bf16 near-ties: cuda_models.assert_greedy; another machine's
    kernels may break an exact tie of ``check_saved_model``'s the other way)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).to(device).eval()
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if ".mixer." in n else dtype) and p.device.type == device.type, n
    model.generation_config.eos_token_id = None  # a random model may pick eos: keep going
    ids = torch.randint(0, 300, (1, 80), generator=torch.Generator().manual_seed(0)).to(device)  # past the windows
    new = 12
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
        )
        assert out.sequences.shape == (1, 80 + new)
        full = model(out.sequences).logits[:, 79 : 79 + new]
    assert_greedy(full, torch.stack(out.logits, 1), out.sequences[:, 80:], TOLERANCE[dtype], clear=0.5)
