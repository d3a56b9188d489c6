"""Every shipped ``rfkit fit`` recipe, run whole through the CLI with its own settings.

A recipe is a contract: its precision (``bf16-true`` over a ``model.dtype: bfloat16`` base in the
GPU recipes), freeze setting and schedule, attention transfer, LoRA, distillation, gradient or
activation checkpointing and strategy (FSDP in the 7B recipes) all run as written. A dry run
overrides only the scale:

- the base model: a tiny random model of the recipe's family saved to a directory (Llama MHA for
  ``llama2_b09*``, Qwen2 GQA with q/k/v biases for ``qwen2_*``, Llama GQA for the SmolLM2 ones);
- the data: the tiny local corpus, short blocks, few of them; the long blocks at the tiny scale;
- the length of everything: a few transfer and training steps, the freeze schedule's first
  stage one step, windows measured in tokens scaled with the blocks, one state-audit prompt of
  256 tokens;
- where it runs: ``accelerator: cpu`` with one device; FSDP through the test-only
  ``CPUFSDPStrategy`` (tests/training/test_ddp.py: Lightning refuses FSDP without a GPU), whose
  full-state checkpoint Lightning writes only from GPUs (``enable_checkpointing: false`` there).

Nothing is cast by hand. Each run saves a model that loads and generates, in the recipe's dtypes:
the base in bf16 and the new weights in float32 where the recipe loads a bf16 base. The MQAR
recipes run their own command at the tiny scale in tests/experiments/test_mqar.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, run_cli, small_tokenizer

import rfkit  # noqa: F401  (registers the converted model types)

FIT_RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("mqar"))
FAMILY = {"llama2": "llama_mha", "qwen2": "qwen2"}  # by name prefix; the rest (SmolLM2) are Llama GQA
SEQ_LEN, LONG_LEN = 96, 160  # the tiny model takes 256 positions
RECALL_GAP = 8  # data.long_recall_gap at that scale


def family_of(name: str) -> str:
    return next((f for prefix, f in FAMILY.items() if name.startswith(prefix)), "llama_gqa")


@pytest.fixture(scope="module")
def tiny_dirs(tiny_corpus, tmp_path_factory):
    """family -> a tiny random model directory (width 64, 2 layers, 320 tokens) with a small tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from helpers import TINY

    tokenizer = small_tokenizer(tiny_corpus)
    root = tmp_path_factory.mktemp("families")
    shape = dict(TINY, vocab_size=320)
    dirs = {}
    for family, model in (
        ("llama_gqa", lambda: LlamaForCausalLM(LlamaConfig(**shape, num_attention_heads=4, num_key_value_heads=2))),
        ("llama_mha", lambda: LlamaForCausalLM(LlamaConfig(**shape, num_attention_heads=4, num_key_value_heads=4))),
        ("qwen2", lambda: Qwen2ForCausalLM(Qwen2Config(**shape, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False))),
        ("mistral", lambda: MistralForCausalLM(MistralConfig(**shape, num_attention_heads=4, num_key_value_heads=2, sliding_window=None))),
    ):  # fmt: skip
        torch.manual_seed(0)
        path = root / family
        model().save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        dirs[family] = path
    return dirs


def scale_args(name: str, model_dir: Path, corpus: Path, root: Path) -> list[str]:
    """The overrides that run recipe ``name`` at the tiny scale (module docstring), nothing else."""
    recipe = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    model, data, trainer = recipe["model"], recipe.get("data") or {}, recipe["trainer"]
    data_args = data.get("init_args", data)
    args = [
        "--config", str(ROOT / "recipes" / f"{name}.yaml"),
        "--model.base_model", str(model_dir),
        "--model.policy.init_args.window", "9",  # about a tenth of the blocks, as in the recipes
        "--data.source", str(corpus), "--data.seq_len", str(SEQ_LEN), "--data.batch_size", "2",
        "--data.calibration_samples", "4", "--data.val_blocks", "2", "--data.split", "[0.1, 0.1]",
        "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
        "--model.lr_scheduler.init_args.T_max", "3",
        "--model.transfer.steps", "2", "--model.transfer.samples", "4", "--model.transfer.batch_size", "2",
    ]  # fmt: skip
    if (model.get("transfer") or {}).get("long_source"):
        args += ["--model.transfer.long_source", str(corpus), "--model.transfer.long_seq_len", str(LONG_LEN),
                 "--model.transfer.long_samples", "2"]  # fmt: skip
    policy_args = model["policy"].get("init_args") or {}
    if policy_args.get("long_source"):  # heads measured on long blocks (several lengths: as many, halving)
        lengths = policy_args.get("long_seq_len")
        scaled = [LONG_LEN // 2**i for i in reversed(range(len(lengths)))] if isinstance(lengths, list) else LONG_LEN
        args += ["--model.policy.init_args.long_source", str(corpus), "--model.policy.init_args.long_seq_len", json.dumps(scaled)]
    if data_args.get("long_source"):
        args += ["--data.long_source", str(corpus), "--data.long_seq_len", str(LONG_LEN), "--data.long_every", "1"]
    if data_args.get("long_recall"):  # the records' gap scaled with the blocks: 256 leaves no room in 160 tokens
        args += ["--data.long_recall_gap", str(RECALL_GAP)]
    if "hops" in data_args:  # HashHop fine-tuning: short chains, a handful of samples
        args += ["--data.chars", "200", "--data.train_samples", "6", "--data.val_samples", "3"]
    if model.get("freeze_schedule"):  # the same stages, the first one step long
        stages = [dict(stage) for stage in model["freeze_schedule"]]
        stages[0]["steps"] = 1
        args += ["--model.freeze_schedule", json.dumps(stages)]
    if (model["operator"].get("init_args") or {}).get("stateless_layers"):  # SmolLM2's layer numbers: the tiny
        args += ["--model.operator.init_args.stateless_layers", "[0]"]  # model's first layer without, its second with a state
    if (recipe.get("state_audit") or {}).get("max_layers"):  # the audit's prompts: one per shape and depth, within the tiny model
        args += ["--state_audit.lengths", "[288]", "--state_audit.trials", "1"]  # the long guard needs 257 with this tokenizer
    audit = recipe.get("state_audit") or {}
    if audit.get("close_layers"):  # SmolLM2's layer numbers: the tiny model's two layers, its second's first head only
        args += ["--state_audit.close_layers", "[0, 1]"] + (["--state_audit.close_heads", '{"1": [0]}'] if audit.get("close_heads") else [])
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and strategy["class_path"].endswith("FSDPStrategy"):
        args += ["--trainer.strategy.class_path", "test_ddp.CPUFSDPStrategy", "--trainer.enable_checkpointing", "false"]
    return args


def dry_run(name, tiny_dirs, tiny_corpus, root, capsys, monkeypatch, extra=(), family=None) -> dict:
    """``rfkit fit`` of recipe ``name`` at the tiny scale (in this process; an FSDP run's process
    group is torn down after it); returns its summary and saved model directory."""
    import torch.distributed as dist

    monkeypatch.setenv("RFKIT_CACHE", str(root / "cache"))
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "training"))  # test_ddp.CPUFSDPStrategy
    try:
        model_dir = tiny_dirs[family or family_of(name)]
        code, out, err = run_cli(["fit", *scale_args(name, model_dir, tiny_corpus, root), *extra], capsys)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    assert code == 0, err[-3000:]
    summary = json.loads(next(root.rglob("summary.json")).read_text())
    return {"summary": summary, "model": Path(summary["model_dir"]), "output": out + err}


def check_saved_model(model_dir: Path, recipe: dict) -> None:
    """The saved model loads with its recipe's dtypes and greedy ``generate`` continues a prompt
    with the tokens that full forwards pick."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    dtype = recipe["model"].get("dtype")
    if dtype == "auto":  # the fit ran on this CPU: bf16 where it computes bf16 natively
        from rfkit.devices import native_bf16

        dtype = "bfloat16" if native_bf16("cpu")[0] else "float32"
    base = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if ".mixer." in n else base), n  # new weights float32 beside bf16
    ids = torch.randint(0, 300, (1, 80), generator=torch.Generator().manual_seed(0))  # past the 60-token windows
    with torch.no_grad():
        model.generation_config.eos_token_id = None  # a random model may pick eos: keep going
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 84)
        full = model(out).logits[0, 79:83].argmax(-1)  # the same tokens from one full forward
    assert torch.equal(out[0, 80:], full)


@pytest.mark.slow
@pytest.mark.parametrize("name", FIT_RECIPES)
def test_recipe_runs_whole_with_its_own_settings(name, tiny_dirs, tiny_corpus, tmp_path, capsys, monkeypatch):
    recipe = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    run = dry_run(name, tiny_dirs, tiny_corpus, tmp_path, capsys, monkeypatch)
    summary = run["summary"]
    assert summary["device"] == "cpu" and summary["replaced_heads"] > 0
    assert summary["ppl_converted"] > 1 and summary["train_tokens"] > 0
    if recipe["model"].get("transfer"):
        assert summary["transfer"]["steps_run"] == 2
    if (recipe.get("state_audit") or {}).get("max_layers"):  # the audit ran, on the recipe's own settings
        audit = summary["state_audit"]
        assert audit["applied"] and audit["config"]["min_margin"] == recipe["state_audit"]["min_margin"]
        assert audit["config"]["max_layers"] == recipe["state_audit"]["max_layers"]
        for key in ("guards", "guard_depths", "heads"):
            if key in recipe["state_audit"]:
                assert audit["config"][key] == recipe["state_audit"][key]
        guards = len(audit["config"]["guards"]) * len(audit["config"]["guard_depths"])  # one trial each
        assert [p["guard"] for p in audit["prompts"]] == [False] + [True] * guards
    if (recipe.get("state_audit") or {}).get("close_layers"):  # closed by name when training ended, in the saved weights
        from safetensors.torch import load_file

        heads = {"1": [0]} if recipe["state_audit"].get("close_heads") else {}
        assert summary["closed_states"] == {"closed": [0, 1], "closed_heads": heads}
        weights = load_file(next(run["model"].glob("*.safetensors")))
        gates = {int(k.split(".layers.")[1].split(".")[0]): v for k, v in weights.items() if k.endswith("mixer.gate")}
        assert not gates[0].any() and not gates[1][0].any()
        assert gates[1][1:].all() if heads else not gates[1].any()  # the others as training left them
    else:
        assert "closed_states" not in summary
    data = recipe.get("data") or {}
    data = data.get("init_args", data)
    if data.get("long_recall"):  # the recipe's records fit the tiny long blocks: the dry run trains on some
        from rfkit.data.recall import DIGITS, RecallPlanter

        saved = yaml.safe_load((run["model"] / "config.yaml").read_text())["data"]["init_args"]
        assert saved["long_recall"] == data["long_recall"] and saved["long_recall_gap"] == RECALL_GAP
        digits = tuple(data.get("long_recall_digits", DIGITS))
        assert tuple(saved["long_recall_digits"]) == digits
        planter = RecallPlanter(small_tokenizer(tiny_corpus), data["long_recall"], RECALL_GAP, digits=digits)
        assert any(planter(torch.zeros(LONG_LEN, dtype=torch.long), row)[1].any() for row in range(4))
    read = (recipe.get("state_audit") or {}).get("read_sharpness", 1.0)
    if read != 1.0:  # read sharper than trained, in the saved model's operator record too
        assert summary["read_sharpness"]["read"] == read
        saved = json.loads((run["model"] / "config.json").read_text())["rf_operator"]["init_args"]
        assert saved["sharpness"] == read
    else:
        assert "read_sharpness" not in summary
    check_saved_model(run["model"], recipe)


@pytest.mark.slow
def test_llama2_b09_schedule_trains_the_adapters_after_the_switch_under_one_process_fsdp(
    tiny_dirs, tiny_corpus, tmp_path, capsys, monkeypatch
):
    """llama2_b09's freeze schedule (mixers alone, then the LoRA adapters join) under FSDP in one
    process: the adapters are held in the first stage and train after the switch. FSDP fixes a
    unit's requires_grad when it flattens it, so the stages hold parameters by dropping their
    gradients, as under DDP."""
    digest = tmp_path / "lora"
    run = dry_run(
        "llama2_b09", tiny_dirs, tiny_corpus, tmp_path / "run", capsys, monkeypatch,
        extra=["--trainer.callbacks+=fault_callbacks.LoraSteps", "--trainer.callbacks.path", str(digest)],
    )  # fmt: skip
    steps = json.loads(digest.read_text())
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["lora_B"] == 0  # stage 1 (mixers): B starts at 0 and is held
    assert steps[1]["lora_B"] > 0 and steps[2]["lora_B"] > steps[1]["lora_B"] * 0.5  # stage 2: trained
    assert all(s["mixer_dtypes"] == ["torch.float32"] and s["lora_dtypes"] == ["torch.float32"] for s in steps)
    assert run["summary"]["lora_layers"] > 0
    from safetensors import safe_open

    with safe_open(str(run["model"] / "model.safetensors"), "pt") as saved:
        assert not [k for k in saved.keys() if ".lora_" in k]  # merged into the saved weights


@pytest.mark.slow
def test_a_mistral_model_through_a_llama_fsdp_recipe_gets_its_own_layers_wrapped_and_checkpointed(
    tiny_dirs, tiny_corpus, tmp_path, capsys, monkeypatch, caplog
):
    """A recipe names its family's decoder layer (llama2_b09_hybrid: LlamaDecoderLayer) for FSDP
    units and activation checkpointing; a Mistral model started from it gets its own layers in
    both, with one warning each, instead of one root unit and no checkpointing."""
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    import rfkit.training.module as module

    seen = {}
    real = module.prepare_fsdp

    def recording(strategy, model):
        units = real(strategy, model)
        policy = strategy.kwargs["auto_wrap_policy"]
        seen["wrapped"] = {type(m).__name__ for m in model.modules() if policy._lambda_fn(m) is True}
        seen["checkpointed"] = strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes
        return units

    monkeypatch.setattr(module, "prepare_fsdp", recording)
    run = dry_run("llama2_b09_hybrid", tiny_dirs, tiny_corpus, tmp_path, capsys, monkeypatch, family="mistral")
    assert seen == {"wrapped": {"MistralDecoderLayer"}, "checkpointed": {MistralDecoderLayer}}
    for field in ("auto_wrap_policy", "activation_checkpointing_policy"):
        warning = f"FSDP: trainer.strategy.{field} names LlamaDecoderLayer, which this mistral model does not have; " \
                  "using its own MistralDecoderLayer"  # fmt: skip
        assert [r.getMessage() for r in caplog.records].count(warning) == 1, caplog.text
    assert json.loads((run["model"] / "config.json").read_text())["model_type"] == "rf_mistral"
    check_saved_model(run["model"], yaml.safe_load((ROOT / "recipes" / "llama2_b09_hybrid.yaml").read_text()))
