"""Faults during `rfkit fit`: kill -9 and resume, NaN stops, atomic checkpoints, determinism.

The runs are real: the tiny Llama and corpus of conftest.py through the SmolLM2 recipe, in a
forked child of the test process where a process has to die (``helpers.forked``: the same code
as a fresh ``rfkit`` process, without its 10 s of imports). ``fault_callbacks.py`` records
losses or injects the fault at a chosen optimizer step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import MAMBA, forked, run_cli, run_in_process, tiny_args

from rfkit.cli import main

from rfkit.training.checkpointing import AtomicCheckpointIO, read_meta

STEPS, EVERY, KILL_AT = 8, 2, 5  # checkpoints after steps 2, 4, 6; the kill comes after step 5
# A resumed run replays the same batches on the same weights and optimizer state, so on one
# machine its losses and final perplexity equal the uninterrupted run's; the tolerance allows
# only for float reassociation (measured difference: 0).
RTOL = 1e-5


class Payload:
    """An arbitrary object: unpickling it would run this module's code."""


def fit_args(model_dir, corpus, root, *extra):
    # The Mamba recipe: its blocks start from a seeded random init, so a different seed must
    # change the first losses (a hybrid block starts closed, the same for every seed).
    return [
        "fit", *tiny_args(model_dir, corpus, root, recipe=MAMBA),
        "--trainer.max_steps", str(STEPS),
        "--trainer.val_check_interval", str(STEPS),
        "--model.lr_scheduler.init_args.T_max", str(STEPS),
        "--model.reuse_profile", "false",  # so a resumed run that profiled would show it
        "--checkpoint.every_n_train_steps", str(EVERY),
        *extra,
    ]  # fmt: skip


def record(path) -> list[str]:
    return ["--trainer.callbacks+=fault_callbacks.LossRecorder", "--trainer.callbacks.path", str(path)]


def losses(path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, Path(path).read_text().splitlines())}


def summary(root) -> dict:
    return json.loads(next(Path(root).rglob("summary.json")).read_text())


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tiny_corpus, tmp_path_factory):
    """One whole run: its directory, losses and summary."""
    base = tmp_path_factory.mktemp("whole")
    run_in_process(fit_args(tiny_model_dir, tiny_corpus, base / "run", *record(base / "losses.jsonl")), base / "cache")
    return {"root": base / "run", "losses": losses(base / "losses.jsonl"), "summary": summary(base / "run"), "cache": base / "cache"}


@pytest.mark.slow
def test_kill_9_mid_training_then_ckpt_path_last_resumes_to_the_same_result(uninterrupted, tiny_model_dir, tiny_corpus, tmp_path, caplog):
    root, marker, lost = tmp_path / "run", tmp_path / "hung", tmp_path / "losses.jsonl"
    hang = ["--trainer.callbacks+=fault_callbacks.HangAt", "--trainer.callbacks.step", str(KILL_AT), "--trainer.callbacks.marker", str(marker)]
    log = tmp_path / "killed.log"
    env = {"RFKIT_CACHE": str(uninterrupted["cache"]), "RFKIT_LOG": "INFO"}
    args = fit_args(tiny_model_dir, tiny_corpus, root, *record(lost), *hang)
    proc = forked(main, args, env=env, stdout=log)
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.is_alive(), log.read_text()[-3000:]
        assert time.time() < deadline, "the run never reached the kill step"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # kill -9: no handler, no cleanup
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL

    # after the crash: the last checkpoint is whole, nothing else was half written
    ckpts = root / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]  # no temporary files beside it
    checkpoint = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 4  # the kill came after step 5: step 5 is lost and redone
    assert not list(root.rglob("summary.json")) and not list(root.rglob("model"))
    assert not [p for p in root.rglob("*") if p.name.startswith(".")]  # no temporary files or directories

    # the checkpoint holds the architecture: head map and operator, as plain data
    meta = read_meta(ckpts / "last.ckpt")
    whole_map = json.loads(next(uninterrupted["root"].rglob("head_map.json")).read_text())
    assert meta["head_map"]["selected"] == whole_map["selected"]
    assert meta["operator"]["class_path"] == "rfkit.operators.MambaOperator"  # what the recipe writes
    assert meta["data_position"] == {"epoch": 0, "batches": 4}
    assert any(".mixer." in key for key in checkpoint["state_dict"])

    # the same command with --ckpt_path last
    with caplog.at_level("INFO", logger="rfkit"):
        run_in_process(fit_args(tiny_model_dir, tiny_corpus, root, *record(lost), "--ckpt_path", "last"), uninterrupted["cache"])
    said = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("rfkit"))
    assert "rebuilt the converted model from checkpoint" in said
    assert "profiling heads" not in said and "reusing head profile" not in said  # no profiling
    assert "transfer: train" not in said  # and no attention transfer: the weights come from the checkpoint

    whole, after = uninterrupted["losses"], losses(lost)
    assert sorted(after) == list(range(1, STEPS + 1))  # steps 5..8 recorded again by the resumed run
    for step in range(1, STEPS + 1):
        assert after[step] == pytest.approx(whole[step], rel=RTOL), step
    got, want = summary(root), uninterrupted["summary"]
    for key in ("ppl_converted", "ppl_original", "cache_bytes_per_token_converted", "replaced_heads", "train_tokens"):
        assert got[key] == pytest.approx(want[key], rel=RTOL), key
    assert json.loads(next(root.rglob("head_map.json")).read_text())["selected"] == whole_map["selected"]
    assert got["wall_seconds"] > meta["wall_seconds"]  # the killed run's time counts too


@pytest.mark.slow
def test_same_seed_gives_the_same_head_map_and_losses(uninterrupted, tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))  # profiled afresh, not read from the other run's cache
    code, _, err = run_cli(fit_args(tiny_model_dir, tiny_corpus, tmp_path / "again", *record(tmp_path / "l.jsonl")), capsys)
    assert code == 0, err
    again = json.loads(next((tmp_path / "again").rglob("head_map.json")).read_text())
    whole = json.loads(next(uninterrupted["root"].rglob("head_map.json")).read_text())
    assert again["selected"] == whole["selected"] and again["rai"] == whole["rai"]
    assert again["rr_mean"] == whole["rr_mean"]
    first = losses(tmp_path / "l.jsonl")
    assert [first[s] for s in range(1, STEPS + 1)] == pytest.approx([uninterrupted["losses"][s] for s in range(1, STEPS + 1)], rel=RTOL)

    # a different seed changes the new blocks' initialisation and so the losses (the check can fail)
    code, _, err = run_cli(
        fit_args(tiny_model_dir, tiny_corpus, tmp_path / "other", *record(tmp_path / "o.jsonl"), "--seed_everything", "1"), capsys
    )
    assert code == 0, err
    other = losses(tmp_path / "o.jsonl")
    assert other[1] != pytest.approx(first[1], rel=1e-4)


@pytest.mark.slow
def test_nan_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    root = tmp_path / "run"
    poison = ["--trainer.callbacks+=fault_callbacks.PoisonAt", "--trainer.callbacks.step", "5"]
    code, out, err = run_cli(fit_args(tiny_model_dir, tiny_corpus, root, *poison), capsys)
    assert code == 1  # a run that failed, not bad input (2)
    line = err.strip().splitlines()[-1]
    assert line.startswith("rfkit: error: training: the loss is nan at step 6")
    assert str(root / "checkpoints" / "last.ckpt") in line and "(step 4)" in line and "--ckpt_path last" in line
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values() if t.is_floating_point())
    assert not list(root.rglob("summary.json")) and not list(root.rglob("model"))


def test_infinite_gradients_stop_before_the_optimizer_step(tiny_model_dir, tiny_corpus, tmp_path):
    """A finite loss with inf gradients would write inf into the weights and the next checkpoint."""
    from rfkit.training.checkpointing import TrainingDiverged
    from rfkit.training.module import RecurFormerModule

    module = RecurFormerModule(base_model=str(tiny_model_dir))
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1.0, float("inf"), 0.0])
    optimizer = torch.optim.SGD([param], lr=0.1)
    with pytest.raises(TrainingDiverged, match="gradient norm is inf"):
        module.on_before_optimizer_step(optimizer)
    param.grad = torch.ones(3)
    module.on_before_optimizer_step(optimizer)  # finite: no error


def test_atomic_checkpoint_io_leaves_the_previous_checkpoint_whole_when_a_write_dies(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(4)}, path)

    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        Path(f).write_bytes(Path(f).read_bytes()[:10])  # a truncated file, then the process "dies"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError):
        io.save_checkpoint({"step": 2, "w": torch.zeros(4)}, path)
    monkeypatch.undo()
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # the temporary file is gone
    kept = io.load_checkpoint(path)
    assert kept["step"] == 1 and torch.equal(kept["w"], torch.ones(4))


def test_checkpoints_load_with_weights_only(tmp_path):
    """A checkpoint that needs unpickling of arbitrary objects is refused by the loader."""
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "obj": Payload()}, path)
    with pytest.raises(Exception, match="[Ww]eights only"):
        AtomicCheckpointIO().load_checkpoint(path)
    from rfkit.training.checkpointing import CheckpointError

    with pytest.raises(CheckpointError, match="cannot read"):
        read_meta(path)


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_operator(uninterrupted, tiny_model_dir, tiny_corpus, tmp_path, capsys):
    ckpt = uninterrupted["root"] / "checkpoints" / "last.ckpt"
    root = tmp_path / "run"
    args = fit_args(tiny_model_dir, tiny_corpus, root, "--ckpt_path", str(ckpt), "--model.operator.init_args.d_state", "8")
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"rfkit: error: --ckpt_path: '{ckpt}' was trained with another model.operator "
        "(d_state: checkpoint 16, recipe 8); resume with the recipe that made it"
    )
    assert not root.exists()  # refused before anything was written


def killed_writer(target: Path, marker: Path) -> None:
    """Half of a model written into an atomic directory, then a hang (the test kills it)."""
    from rfkit.atomic import atomic_directory

    with atomic_directory(target) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half a model")
        marker.write_text("writing")
        time.sleep(600)


@pytest.mark.slow
def test_a_writer_killed_mid_directory_leaves_no_target_and_the_next_write_clears_its_leftovers(tmp_path):
    target, marker = tmp_path / "model", tmp_path / "writing"
    proc = forked(killed_writer, target, marker)
    deadline = time.time() + 60
    while not marker.exists():
        assert proc.is_alive() and time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    assert not target.exists()  # never a half-written model directory
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".model.tmp-")]
    assert len(leftovers) == 1 and f"-{proc.pid}-" in leftovers[0]  # hidden, and named after its writer

    from rfkit.atomic import atomic_directory

    with atomic_directory(target) as tmp:
        (tmp / "model.safetensors").write_bytes(b"a whole model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "writing"]  # the killed writer's copy is gone
    assert (target / "model.safetensors").read_bytes() == b"a whole model"


def hybrid_args(model_dir, corpus, root, *extra):
    """The default (hybrid) recipe with window dropout on every training forward, so each step
    draws from the blocks' random streams; deterministic algorithms."""
    return [
        "fit", *tiny_args(model_dir, corpus, root),
        "--model.operator.init_args.window", "6",
        "--model.operator.init_args.window_dropout", "1.0",
        "--trainer.deterministic", "true",
        "--model.reuse_profile", "false",  # the same random draws before conversion in every run
        "--trainer.max_steps", str(STEPS),
        "--trainer.val_check_interval", str(STEPS),
        "--model.lr_scheduler.init_args.T_max", str(STEPS),
        "--checkpoint.every_n_train_steps", str(EVERY),
        *extra,
    ]  # fmt: skip


def saved_weights(root) -> dict:
    from safetensors.torch import load_file

    (path,) = Path(root).rglob("model.safetensors")
    return load_file(str(path))


@pytest.mark.slow
def test_a_crash_then_resume_with_window_dropout_ends_with_the_same_weights_exactly(tiny_model_dir, tiny_corpus, tmp_path):
    """Every random stream training reads (here the hybrid's window dropout) is in the checkpoint:
    a fit that dies after a checkpoint and is resumed ends with the uninterrupted fit's weights
    and perplexity, bit for bit. The fit dies in this process (fault_callbacks.CrashAt: the
    blocks and their streams are built anew on resume, as after a kill); a real kill -9 of a
    process is test_kill_9_mid_training_then_ckpt_path_last_resumes_to_the_same_result."""
    from fault_callbacks import Crash

    cache = tmp_path / "cache"
    whole_root = tmp_path / "whole"
    run_in_process(hybrid_args(tiny_model_dir, tiny_corpus, whole_root), cache)

    root = tmp_path / "run"
    crash = ["--trainer.callbacks+=fault_callbacks.CrashAt", "--trainer.callbacks.step", str(KILL_AT)]
    with pytest.raises(Crash):
        run_in_process(hybrid_args(tiny_model_dir, tiny_corpus, root, *crash), cache)
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 4
    streams = checkpoint["rfkit_random_states"]["modules"]
    assert streams and all(name.endswith(".mixer") for name in streams)  # one per hybrid block

    run_in_process(hybrid_args(tiny_model_dir, tiny_corpus, root, "--ckpt_path", "last"), cache)
    want, got = saved_weights(whole_root), saved_weights(root)
    assert sorted(got) == sorted(want)
    trained = [key for key in want if ".mixer." in key]
    assert trained
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert summary(root)["ppl_converted"] == summary(whole_root)["ppl_converted"]
