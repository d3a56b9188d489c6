"""What a newcomer sees: the end screen of ``rfkit fit``, the step-counting bar, one line per
phase, and no third-party noise."""

import json
import sys

import pytest
from helpers import run_cli, tiny_args

from rfkit.training.progress import Phases, format_seconds
from rfkit.training.report import final_screen, summary_table

WIDTH = 100


@pytest.mark.slow
def test_tiny_fit_ends_with_the_table_the_path_and_the_next_commands(tiny_model_dir, tiny_corpus, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    args = tiny_args(tiny_model_dir, tiny_corpus, "run")
    args[args.index("--trainer.enable_progress_bar") + 1] = "true"
    with caplog.at_level("INFO", logger="rfkit"):
        code, out, err = run_cli(["fit", *args], capsys)
    assert code == 0, err
    screen = out[out.index("rfkit fit: done in") :]
    lines = screen.splitlines()
    summary_path = next(tmp_path.rglob("summary.json"))
    summary = json.loads(summary_path.read_text())
    model_dir = summary_path.parent / "model"
    shown = str(model_dir.relative_to(tmp_path))  # paths inside the working directory are shown relative

    # the table: perplexity and cache, original / converted / ratio, as summary.json has them
    ppl = next(line for line in lines if line.strip().startswith("perplexity"))
    assert ppl.split()[1:] == [f"{summary['ppl_original']:,.2f}", f"{summary['ppl_converted']:,.2f}", f"{summary['ppl_ratio']:.3f}"]
    cache = next(line for line in lines if "KV cache bytes/token" in line)
    assert cache.split()[-1] == f"{summary['cache_ratio']:.3f}" == "0.500"
    assert any(line.split() == ["heads", "replaced", "4", "of", "8", "query", "heads"] for line in lines)
    assert any(line.split()[:2] == ["training", "tokens"] and line.split()[2] == f"{summary['train_tokens']:,}" for line in lines)
    # where the model is, and what to run next with that path filled in
    assert f"  model    {shown}" in lines
    assert f"  rfkit eval ppl --model {shown}" in screen and f"  rfkit bench cache --model {shown}" in screen
    assert f"    path = {shown!r}" in lines and "AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)" in screen
    assert "import rfkit" not in screen
    assert model_dir.is_dir()
    # short: nothing wider than the terminal, no per-layer JSON on screen (it is in summary.json)
    assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    assert "mse_before" not in out and "mse_before" in json.dumps(summary["transfer"])

    # progress in optimizer steps, not "Epoch 0/-2"; one line per phase; no third-party chatter
    assert "train (steps)" in out and "2/2" in out and "/-2" not in out + err
    phase_lines = [r.getMessage() for r in caplog.records if r.name == "rfkit"]
    for name in ("load", "profile", "measure", "convert", "transfer", "train", "save"):
        assert any(line.split()[0] == name and line.split()[2] in ("s", "min") for line in phase_lines), name
        assert summary["phases"][name] >= 0
    for noise in ("Tip:", "tensorboardX", "GPU available", "LeafSpec", "deprecated"):
        assert noise not in err, noise


@pytest.mark.slow
def test_lightnings_model_summary_epoch_and_validation_bars_show_only_with_verbose(
    tiny_model_dir, tiny_corpus, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    screens = {}
    for flags in ([], ["--verbose"]):
        args = tiny_args(tiny_model_dir, tiny_corpus, f"run{len(flags)}")
        args[args.index("--trainer.enable_progress_bar") + 1] = "true"
        args[args.index("--trainer.max_steps") + 1] = "1"
        args[args.index("--trainer.val_check_interval") + 1] = "1"  # a validation run after the step
        args += ["--trainer.num_sanity_val_steps", "1"]  # and a sanity check before it
        with monkeypatch.context() as streams:
            streams.setattr(sys, "stderr", sys.stdout)  # one stream, in the order a terminal shows it
            code, out, err = run_cli([*flags, "fit", *args], capsys)
        assert code == 0, out + err
        screens[bool(flags)] = out + err
    quiet, verbose = screens[False], screens[True]
    assert "train (steps)" in quiet and "rfkit fit: done" in quiet  # rfkit's own bar and end screen
    for lightning in ("Total FLOPs", "Total params", "Name", "Epoch 0", "Training:", "Validation", "Sanity Checking"):
        assert lightning not in quiet, lightning
    assert "val_loss=" in quiet  # the validation loss still shows, on the step bar
    # the step bar closes with the last step: it is not drawn again below the converted model's
    # measurement, which runs in on_train_end
    after_measure = quiet[quiet.index("perplexity (converted)") :]
    assert "train (steps)" not in after_measure
    assert "Total params" in verbose and "Name" in verbose and "Epoch 0" in verbose
    assert "Validation DataLoader 0" in verbose and "Sanity Checking" in verbose


def test_the_table_shows_only_what_was_measured():
    rows = summary_table({"ppl_original": 15.81, "replaced_heads": 135, "total_heads": 270})
    assert any(r.split() == ["perplexity", "15.81", "-", "-"] for r in rows)
    assert not any("KV cache" in r or "training tokens" in r for r in rows)
    screen = final_screen({"replaced_heads": 1, "total_heads": 2}, "convert", None, None)
    assert screen.splitlines()[1] == "rfkit convert: done" and "next:" not in screen


def test_phases_log_once_each_and_an_inner_phase_is_not_counted_twice(caplog):
    clock = iter([0.0, 10.0, 14.0, 20.0])  # train starts at 0; measure runs 10..14 inside it; train ends at 20
    phases = Phases()
    import rfkit.training.progress as progress

    real = progress.time.perf_counter
    progress.time.perf_counter = lambda: next(clock)
    try:
        with caplog.at_level("INFO", logger="rfkit"):
            phases.start("train")
            with phases("measure", "the converted model"):
                pass
            phases.end("train", "2 steps")
    finally:
        progress.time.perf_counter = real
    assert phases.seconds == {"measure": 4.0, "train": 16.0}
    assert [r.getMessage().split() for r in caplog.records] == [
        ["measure", "4.0", "s", "the", "converted", "model"],
        ["train", "16.0", "s", "2", "steps"],
    ]
    assert (format_seconds(59.94), format_seconds(125), format_seconds(3725)) == ("59.9 s", "2 min 05 s", "1 h 02 min")


def test_rfkit_info_lines_read_as_rfkit_and_other_records_keep_their_level_and_name():
    import logging

    from rfkit.output import _Format

    def record(name, level, msg):
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    assert _Format().format(record("rfkit", logging.INFO, "load      0.1 s")) == "rfkit: load      0.1 s"
    assert _Format().format(record("rfkit.data", logging.WARNING, "slow")) == "WARNING rfkit.data: slow"
    assert _Format().format(record("lightning.pytorch", logging.INFO, "GPU")) == "INFO lightning.pytorch: GPU"
