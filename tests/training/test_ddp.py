"""Distributed runs on CPU with gloo: sharded head profiling, ``rfkit fit`` under DDP, and the
FSDP settings of the 7B recipes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import FSDPStrategy

from rfkit.conversion.profile import profile_heads

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(window=4, alpha=0.5035, exclude_first_token=True, chunk=8)
BATCH, LENGTH = 2, 24
POLICY = dict(window=4, alpha=0.5035, beta=0.5)  # for profile_for
SHARDS = (4, 5, 1)  # even, odd (rank 0 gets one more batch) and a single batch (rank 1 gets none)
WORKER_TIMEOUT = 120  # seconds for the spawned ranks; the gloo timeout is shorter, so a hang fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibration(n: int, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 128, (BATCH, LENGTH), generator=g)} for _ in range(n)]


class StubData:
    """The datamodule surface ``profile_for`` uses, over fixed calibration batches."""

    def __init__(self, n: int):
        self.batches = calibration(n)
        self.calibration = torch.cat([b["input_ids"] for b in self.batches])

    def setup(self, stage=None):
        pass

    def describe(self):
        return {"stub": True}

    def fingerprint(self):
        return "stub-data"

    def calibration_dataloader(self):
        return self.batches


def _profile_worker(rank: int, world: int, port: int, out: str, caches: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from helpers import tiny_model

        import rfkit.conversion.convert
        import rfkit.conversion.policies
        from rfkit.conversion.policies import RecencyRatioPolicy

        model = tiny_model()
        result = {str(n): asdict(profile_heads(model, calibration(n), progress=False, **SETTINGS)) for n in SHARDS}

        # profile_for: the ranks agree on reusing the cache; only rank 0 writes it
        calls = []
        real = rfkit.conversion.policies.profile_heads  # what RecencyRatioPolicy.make_profile calls
        rfkit.conversion.policies.profile_heads = lambda *a, **k: calls.append(1) or real(*a, **k)
        os.environ["RFKIT_CACHE"] = caches[rank]  # a cache per rank, as on nodes without shared storage
        policy = RecencyRatioPolicy(**POLICY)
        data = StubData(5)
        steps = []
        first, _ = rfkit.conversion.convert.profile_for(model, "tiny", policy, data)
        steps.append(len(calls))  # profiled: no cache anywhere
        files = cached_files(caches[rank])
        again, _ = rfkit.conversion.convert.profile_for(model, "tiny", policy, data)
        steps.append(len(calls))  # profiled again: rank 1's cache has no file, so nobody reuses
        dist.barrier()
        if rank == 1:
            for name in cached_files(caches[0]):
                target = Path(caches[1]) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(caches[0]) / name, target)
        dist.barrier()
        reused, _ = rfkit.conversion.convert.profile_for(model, "tiny", policy, data)
        steps.append(len(calls))  # every rank has it now: reused
        result["profile_for"] = {
            "calls": steps,
            "files_after_first": files,
            "profiles": [asdict(p) for p in (first, again, reused)],
        }
        # measured-loss ranking: each rank streams every other unit, the increases are all-reduced
        result["streamed"] = streamed_profile(model)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def streamed_profile(model) -> dict:
    """The measured-loss record and selection of :class:`StreamedLossPolicy` on 3 calibration
    batches (world size 2: rank 1 measures the odd units)."""
    from rfkit.conversion.streamed_loss import StreamedLossPolicy
    from rfkit.models.layout import AttentionLayout

    policy = StreamedLossPolicy(sink=1, recent=4, blocks=3 * BATCH, **POLICY)
    profile = policy.make_profile(model, calibration(3), progress=False)
    selected = policy.select(AttentionLayout.from_config(model.config), profile)
    return {"measured": profile.meta["measured"], "selected": [sorted(int(h) for h in heads) for heads in selected]}


def cached_files(cache: str) -> list[str]:
    """The profile files under cache root ``cache``, relative to it."""
    return sorted(str(p.relative_to(cache)) for p in Path(cache).rglob("*.json"))


def run_ranks(fn, world: int, *args) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` ranks, forked from this process: they start
    with its imports (a spawned rank spends 10 s importing torch and transformers on the 2-core
    CI machine). Each rank sets its own threads, environment and process group."""
    context = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + WORKER_TIMEOUT
    try:
        while not context.join(timeout=1):  # raises with the worker's traceback if one failed
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish within {WORKER_TIMEOUT} s (a collective on some ranks only?)")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()


@pytest.mark.slow
def test_profile_heads_in_two_processes_equals_one_process(tmp_path):
    from helpers import tiny_model

    from rfkit.conversion.policies import RecencyRatioPolicy

    caches = [str(tmp_path / "cache0"), str(tmp_path / "cache1")]
    run_ranks(_profile_worker, 2, str(tmp_path), caches)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    model = tiny_model()
    for n in SHARDS:
        single = asdict(profile_heads(model, calibration(n), progress=False, **SETTINGS))
        for got in (r[str(n)] for r in ranks):
            assert got["rai"] == single["rai"], n  # RA-I exactly
            assert got["samples"] == single["samples"] == n * BATCH
            assert got["seq_len"] == single["seq_len"] == LENGTH  # also on the rank that saw no batch
            for key in ("rr_mean", "entropy_mean"):
                torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(single[key]), atol=2e-6, rtol=0)
        assert ranks[0][str(n)] == ranks[1][str(n)]  # every rank returns the same profile
        assert len({v for row in single["rai"] for v in row}) > 2  # counts that can differ, not all 0

    # profile_for under DDP
    ref = asdict(profile_heads(model, calibration(5), progress=False, **RecencyRatioPolicy(**POLICY).profile_settings()))
    for rank, result in enumerate(ranks):
        found = result["profile_for"]
        assert found["calls"] == [1, 2, 2], rank  # profiled, profiled (one rank lacked the file), reused
        for profile in found["profiles"]:
            assert profile["rai"] == ref["rai"] and profile["samples"] == 10
    assert len(ranks[0]["profile_for"]["files_after_first"]) == 1  # rank 0 wrote the cache file
    assert ranks[1]["profile_for"]["files_after_first"] == []  # rank 1 did not

    # the measured-loss policy: units split over the ranks, every rank the one-process numbers
    single = streamed_profile(model)
    deltas = [d for row in single["measured"]["delta"] for d in row]
    assert len(deltas) >= 4 and len(set(deltas)) == len(deltas)  # units that rank differently
    for result in ranks:
        got = result["streamed"]
        torch.testing.assert_close(torch.tensor(got["measured"]["delta"]), torch.tensor(single["measured"]["delta"]), atol=2e-6, rtol=0)
        assert got["measured"]["baseline_loss"] == pytest.approx(single["measured"]["baseline_loss"], abs=1e-6)
        assert got["selected"] == single["selected"]
    assert ranks[0]["streamed"] == ranks[1]["streamed"]  # the same numbers on both ranks


def run_fit(args: list[str], cache: Path, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``rfkit fit ARGS`` in a fresh interpreter (Lightning's DDP launcher starts rank 1 by
    running the same command again); the whole process group is killed on timeout."""
    # verbose: the DDP test reads Lightning's "GLOBAL_RANK: 1" info line, which rfkit hides by default
    env = dict(os.environ, RFKIT_CACHE=str(cache), PYTHONUNBUFFERED="1", RFKIT_VERBOSE="1")
    # this directory for --trainer.strategy test_ddp.CPUFSDPStrategy, tests/ for fault_callbacks
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)  # a fresh launch, never a worker of some outer job
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfkit.cli", "fit", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"rfkit fit did not finish within {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def streamed_policy(corpus) -> list[str]:
    """The beta 0.9 GPU hybrids' head ranking (``StreamedLossPolicy`` on long blocks of two
    lengths) at the tiny scale: every fit here ranks heads this way, so the distributed runs also
    check that each rank streams its share of the KV groups and all write the one-process map."""
    return [
        "--model.policy", "rfkit.policies.StreamedLossPolicy", "--model.policy.init_args.beta", "0.5",
        "--model.policy.init_args.recent", "8", "--model.policy.init_args.long_source", str(corpus),
        "--model.policy.init_args.long_seq_len", "[48, 96]", "--model.policy.init_args.blocks", "[2, 1]",
    ]  # fmt: skip


def fit_run(name: str, root: Path, tiny_model_dir, tiny_corpus, *extra: str, in_process: bool = False) -> dict:
    """One ``rfkit fit`` of the tiny recipe (``tiny_args`` of test_cli) under ``root``; the run's
    summary, head map and output (none in process), after checking that exactly one summary was
    written. A distributed run needs its own interpreter (Lightning launches rank 1 by running
    the command again); the single-process run it is compared with does not."""
    from helpers import run_in_process, tiny_args

    run_root = root / name
    args = [*tiny_args(tiny_model_dir, tiny_corpus, run_root), "--model.reuse_profile", "false", *streamed_policy(tiny_corpus), *extra]
    if in_process:
        run_in_process(["fit", *args], root / "cache")
        output = ""
    else:
        done = run_fit(args, root / "cache", root)
        assert done.returncode == 0, done.stderr[-4000:]
        output = done.stdout + done.stderr
    summaries = sorted(run_root.rglob("summary.json"))
    assert len(summaries) == 1, summaries  # rank 0 alone writes it
    run = summaries[0].parent
    return {
        "summary": json.loads(summaries[0].read_text()),
        "head_map": json.loads((run / "head_map.json").read_text()),
        "dir": run,
        "output": output,
    }


@pytest.fixture(scope="module")
def single_run(tiny_model_dir, tiny_corpus, tmp_path_factory):
    """The tiny fit in one process: what the distributed runs are compared with."""
    return fit_run("single", tmp_path_factory.mktemp("fits"), tiny_model_dir, tiny_corpus, in_process=True)


CPU2 = ["--trainer.devices", "2", "--trainer.accelerator", "cpu"]


def check_distributed_run(run: dict, single: dict) -> None:
    assert "GLOBAL_RANK: 1" in run["output"]  # really two processes
    assert run["output"].count("rfkit fit: done") == 1
    assert single["summary"]["train_tokens"] == 2 * 32 + 96  # max_steps 2: a batch of 2 x 32 tokens, a long block of 96
    assert run["summary"]["train_tokens"] == 2 * single["summary"]["train_tokens"]  # both ranks' tokens
    assert run["head_map"]["selected"] == single["head_map"]["selected"]
    assert run["head_map"]["rai"] == single["head_map"]["rai"]  # the all-reduced profile
    # the measured-loss ranking: the ranks split the KV groups, the increases are all-reduced
    measured, one = run["head_map"]["measured"], single["head_map"]["measured"]
    assert measured["seq_len"] == one["seq_len"] == [48, 96] and measured["blocks"] == one["blocks"]
    for length in ("48", "96"):  # each length's own increases, then their combination
        got, want = measured["by_length"][length]["delta"], one["by_length"][length]["delta"]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-6, rtol=0)
        assert len({d for row in want for d in row}) > 2  # increases that rank, not all equal
    torch.testing.assert_close(torch.tensor(measured["delta"]), torch.tensor(one["delta"]), atol=1e-4, rtol=0)
    assert run["head_map"]["samples"] == single["head_map"]["samples"] == 4
    assert run["summary"]["replaced_heads"] == single["summary"]["replaced_heads"] == 4


@pytest.mark.slow
def test_fit_under_ddp_writes_one_summary_counting_both_ranks(single_run, tiny_model_dir, tiny_corpus, tmp_path):
    """Also with a freeze schedule that unfreezes LoRA adapters at step 2: they are all-reduced
    like the rest, so the ranks stay identical. DDP only reduces gradients of parameters that
    required them when it wrapped the model, so the stages hold parameters by dropping their
    gradients instead of switching requires_grad."""
    prefix = tmp_path / "digest"
    run = fit_run(
        "ddp", tmp_path, tiny_model_dir, tiny_corpus, "--trainer.strategy", "ddp", *CPU2,
        "--model.lora.r", "2", "--model.freeze_schedule", "[{freeze: mixers, steps: 1}, {freeze: pretrained}]",
        "--trainer.callbacks+=fault_callbacks.ParamDigest", "--trainer.callbacks.prefix", str(prefix),
    )  # fmt: skip
    check_distributed_run(run, single_run)
    assert (run["dir"] / "model" / "model.safetensors").is_file()
    ranks = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and any(".lora_B." in n for n in ranks[0])
    for name, value in ranks[0].items():
        assert ranks[1][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert any(v[1] > 0 for n, v in ranks[0].items() if ".lora_B." in n)  # the adapters did train (B starts at 0)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU with gloo, for these tests: Lightning refuses FSDP without a
    GPU (it checks for this exact class), and torch's FSDP needs ``device_id=cpu`` there."""

    def _setup_model(self, model):
        from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs,
        )  # fmt: skip
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model


@pytest.mark.slow
def test_fit_under_fsdp_saves_the_gathered_model(single_run, tiny_model_dir, tiny_corpus, tmp_path, monkeypatch):
    """FSDP with the 7B recipes' settings (decoder-layer wrapping and activation checkpointing,
    full sharding), on 2 CPU processes: the summary gathers the sharded weights (LoRA merged)
    into a saved model that computes exactly the perplexity the sharded model measured."""
    from transformers import AutoModelForCausalLM

    from rfkit.data import TextDataModule
    from rfkit.evals.perplexity import evaluate_perplexity

    layer = "[transformers.models.llama.modeling_llama.LlamaDecoderLayer]"
    run = fit_run(
        "fsdp", tmp_path, tiny_model_dir, tiny_corpus, *CPU2,
        "--trainer.strategy", "test_ddp.CPUFSDPStrategy",
        "--trainer.strategy.auto_wrap_policy", layer,
        "--trainer.strategy.activation_checkpointing_policy", layer,
        "--trainer.enable_checkpointing", "false",  # FSDP's full checkpoint offloads to CPU: GPU only
        "--model.lora.r", "2",
    )  # fmt: skip
    check_distributed_run(run, single_run)
    # 7 targets per layer; a converted layer packs q/k/v into one qkv_proj with one adapter
    adapters = sum(5 if heads else 7 for heads in run["head_map"]["selected"])
    assert adapters < 14 and f"merged {adapters} LoRA adapters" in run["output"]
    saved = AutoModelForCausalLM.from_pretrained(str(run["dir"] / "model")).eval()
    assert not any(".lora_" in name for name, _ in saved.named_parameters())
    data = TextDataModule(
        source=str(tiny_corpus), tokenizer=str(tiny_model_dir), seq_len=32, batch_size=2, calibration_samples=4,
        val_blocks=4, split=[0.1, 0.1],
    )  # fmt: skip
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))  # the run's tokenised blocks
    ppl = evaluate_perplexity(saved, data.val_dataloader())
    assert ppl == pytest.approx(run["summary"]["ppl_converted"], rel=1e-5)  # measured through the sharded model


@pytest.mark.parametrize(
    "recipe, layer",
    [
        ("llama2_b09", "transformers.models.llama.modeling_llama.LlamaDecoderLayer"),
        ("qwen2_7b_b09", "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer"),
        ("llama2_b09_hybrid", "transformers.models.llama.modeling_llama.LlamaDecoderLayer"),
        ("qwen2_7b_b09_hybrid", "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer"),
    ],
)
def test_7b_recipes_parse_to_a_real_fsdp_strategy(recipe, layer, monkeypatch):
    from importlib import import_module

    from helpers import parse_recipe
    from jsonargparse import Namespace
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    config = parse_recipe(recipe, monkeypatch)
    layer_class = getattr(import_module(layer.rsplit(".", 1)[0]), layer.rsplit(".", 1)[1])
    spec = config.trainer.strategy
    assert isinstance(spec, Namespace) and spec.class_path == "lightning.pytorch.strategies.FSDPStrategy"
    args = spec.init_args
    assert args.auto_wrap_policy == {layer_class}  # classes, not their import paths as strings
    assert args.activation_checkpointing_policy == {layer_class}
    assert args.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert args.state_dict_type == "full"
    assert config.trainer.precision == "bf16-true" and config.trainer.accelerator == "gpu"
    assert config.model.gradient_checkpointing is False  # the strategy checkpoints the layers instead
    assert config.model.dtype == "bfloat16"

    strategy = FSDPStrategy(**args.as_dict())  # what the trainer gets (building it needs no GPU)
    for policy in (strategy.kwargs["auto_wrap_policy"], strategy._activation_checkpointing_kwargs["auto_wrap_policy"]):
        assert isinstance(policy, ModuleWrapPolicy) and policy._module_classes == {layer_class}
    assert strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert strategy._state_dict_type == "full" and strategy.kwargs["use_orig_params"] is True


def test_the_shared_teacher_swaps_attention_inside_layer_wrappers():
    """FSDP and activation checkpointing wrap each decoder layer; an assignment to the wrapper's
    ``self_attn`` would leave the student's attention in place, and the teacher would compute the
    student. The swap goes to the wrapped layer."""
    from helpers import random_ids, tiny_model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from rfkit.conversion.convert import convert
    from rfkit.conversion.policies import ExplicitHeads
    from rfkit.models.operators import MambaOperator
    from rfkit.training.teacher import SharedTeacher

    original = tiny_model("llama")
    ids = random_ids()
    with torch.no_grad():
        want = original(input_ids=ids).logits
    from rfkit.conversion.convert import build_head_map

    head_map = build_head_map(original, "tiny", ExplicitHeads([[0, 1], [2, 3]]))
    model = convert(original, head_map, MambaOperator()).eval()
    for mixer in (m for n, m in model.named_modules() if n.endswith(".mixer")):
        torch.nn.init.normal_(mixer.out_proj.weight, std=0.5)  # a student that differs from the original
    layers = model.get_decoder().layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    teacher = SharedTeacher(model)
    with torch.no_grad():
        student = model(input_ids=ids).logits
        got = teacher(input_ids=ids).logits
    assert not torch.allclose(student, want, atol=1e-3)
    torch.testing.assert_close(got, want)
    assert not any(n.startswith("self_attn") for layer in layers for n, _ in layer.named_children())
