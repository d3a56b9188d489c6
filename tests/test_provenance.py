"""Result files name the command, date, commit and wall time that produced them (rfkit.provenance)."""

from __future__ import annotations

import json
import re

from helpers import ROOT, run_cli

import rfkit.devices as devices
from rfkit.provenance import command_line, git_state, machine, provenance, stamp


def test_the_command_reads_as_the_user_typed_it():
    assert command_line(["/venv/bin/rfkit", "eval", "ppl", "--model", "a dir"]) == "rfkit eval ppl --model 'a dir'"
    assert command_line([str(ROOT / "benchmarks" / "quality.py"), "--betas", "0.5"]) == "python benchmarks/quality.py --betas 0.5"
    assert command_line(["/elsewhere/script.py"]) == "python /elsewhere/script.py"


def test_the_block_has_command_date_commit_and_wall_time():
    block = provenance(wall_seconds=12.34, command="rfkit fit --config x.yaml")
    assert block["command"] == "rfkit fit --config x.yaml" and block["wall_seconds"] == 12.3
    assert re.fullmatch(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", block["date"])
    commit, dirty = git_state()
    if (ROOT / ".git").exists():  # a clone: the commit checked out
        assert re.fullmatch(r"[0-9a-f]{40}", commit) and isinstance(dirty, bool)
    assert block["commit"] == commit


def test_the_block_names_the_machine_its_threads_and_bf16_features(monkeypatch):
    import torch

    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16", "sse2"})
    said = machine()
    assert f"{torch.get_num_threads()} threads" in said and said.endswith("amx_bf16, avx512_bf16")
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"sse2"})  # no bf16 feature: none listed
    assert "bf16" not in machine()
    assert provenance(wall_seconds=1, command="x")["machine"] == machine()


def test_a_result_is_stamped_once_unless_it_is_rewritten():
    result = stamp({"x": 1}, command="rfkit a", wall_seconds=1)
    first = dict(result["provenance"])
    stamp(result, command="rfkit b", wall_seconds=2)
    assert result["provenance"] == first
    stamp(result, command="rfkit b", wall_seconds=2, replace=True)
    assert result["provenance"]["command"] == "rfkit b" and result["provenance"]["wall_seconds"] == 2


def test_an_eval_writes_its_command_into_its_json(tmp_path, capsys, tiny_model_dir, tiny_corpus):
    out = tmp_path / "ppl.json"
    args = ["eval", "ppl", "--model", str(tiny_model_dir), "--source", str(tiny_corpus), "--mode", "blocks",
            "--block-size", "32", "--val-blocks", "2", "--json", str(out)]  # fmt: skip
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    block = json.loads(out.read_text())["provenance"]
    assert block["command"].startswith("rfkit eval ppl --model ") and block["command"].endswith(str(out))
    assert block["wall_seconds"] is not None and block["wall_seconds"] >= 0

