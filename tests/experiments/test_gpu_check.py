"""The GPU check's own machinery (benchmarks/gpu/): its step runner, its one-line refusals, and
that the carry, the rehearsal's fresh environment and the check agree on what the GPU machine
lacks. The whole check runs in CI as its rehearsal (`make gpu-rehearsal`, called by .ci/run)."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def check():
    return load_script("benchmarks/gpu/check.py")


def test_a_step_that_hangs_is_killed_at_its_timeout_with_its_children(check, tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True); time.sleep(60)\n"
    )
    with open(tmp_path / "log", "w") as log:
        code, ended = check.run_command([sys.executable, "-c", script], dict(), 3, log)
    assert code is None and "timeout" in ended
    assert "started" in (tmp_path / "log").read_text()
    import os

    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # the whole process group went, not only the step
        for _ in range(50):
            os.kill(child, 0)
            import time

            time.sleep(0.1)


def test_pytest_counts_read_the_closing_line(check):
    text = "....F\nFAILED tests/cuda/x.py::t\n3 passed, 1 failed, 2 deselected in 4.2s\n"
    assert check.pytest_counts(text) == {"passed": 3, "failed": 1, "deselected": 2}
    assert check.pytest_counts("no closing line") == {}


def test_bad_input_gets_one_line_and_exit_2(check, tmp_path, capsys):
    assert check.main(["--carry", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no carry" in err[0] and "make gpu-carry" in err[0]
    (tmp_path / "carry").mkdir()
    (tmp_path / "carry" / "manifest.json").write_text(json.dumps({"commit": "x", "versions": {}}))
    args = ["--carry", str(tmp_path / "carry"), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")]
    assert check.main([*args, "--only", "tabel2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tabel2" in err[0] and "table2" in err[0]


def test_every_step_runs_in_both_modes_with_the_same_scripts(check, tmp_path):
    gpu = check.plan("gpu", "python3", tmp_path, tmp_path / "w", tmp_path / "o")
    cpu = check.plan("cpu", "python3", tmp_path, tmp_path / "w", tmp_path / "o")
    assert [s.name for s in gpu] == [s.name for s in cpu]
    assert [s.name for s in gpu][:2] == ["environment", "bootstrap"] and gpu[1].critical
    for g, c in zip(gpu, cpu):
        if "cpu" not in g.modes:  # the CPU baseline of the fit exists only beside a GPU
            assert g.name == "fit_cpu"
            continue
        scripts = lambda step: [  # noqa: E731
            next((a for a in cmd if a.endswith((".py", "pytest"))), cmd[0]) for cmd in step.commands if cmd[0] != "nvidia-smi"
        ]
        assert scripts(g) == scripts(c), g.name  # the rehearsal runs the very scripts the GPU runs
        # each step bounded (the budget, 540 s, bounds the whole: a step gets at most what is left)
        assert sum(s.timeout["gpu"] for s in gpu) <= 1600


def test_the_carry_and_the_rehearsal_agree_on_what_the_gpu_machine_lacks():
    carry = load_script("benchmarks/gpu/carry.py")
    fresh = load_script("benchmarks/gpu/fresh_env.py")
    brought = {fresh.normalise(name) for name, _ in carry.MISSING}
    assert brought == (fresh.CARRIED - {"rfkit"}) | fresh.REPLACED_BY_CARRY
    assert not fresh.CARRIED & fresh.GPU_IMAGE  # the image really lacks what the carry brings
    assert fresh.REPLACED_BY_CARRY <= fresh.GPU_IMAGE  # and has older versions of these


def test_the_image_versions_env_has_what_rfkit_needs_that_the_carry_does_not_bring(tmp_path, capsys):
    """benchmarks/gpu/image_env.py installs the GPU image's versions of what the image has: every
    runtime dependency of rfkit is there or in the carry, and everything it pins is in the image.
    A Python of another minor version is one line and exit 2, before anything is built."""
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    image = load_script("benchmarks/gpu/image_env.py")
    carry = load_script("benchmarks/gpu/carry.py")
    fresh = load_script("benchmarks/gpu/fresh_env.py")
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    needs = {fresh.normalise(r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip())
             for r in project["dependencies"]}  # fmt: skip
    installed = {fresh.normalise(n) for n in [*image.PINNED, *image.UNPINNED]}
    brought = {fresh.normalise(name) for name, _ in carry.MISSING}
    assert needs <= installed | brought, needs - installed - brought
    assert {fresh.normalise(n) for n in image.PINNED} <= fresh.GPU_IMAGE
    assert not {fresh.normalise(n) for n in image.PINNED} & brought  # the carry's versions are CI's, not pinned here

    not_312 = sys.executable if sys.version_info[:2] != (3, 12) else None
    if not_312:
        assert image.main(["--target", str(tmp_path / "env"), "--python", not_312]) == 2
        assert capsys.readouterr().err.strip() == (
            "image env: --python: no Python 3.12 found (the GPU image's); give one with --python")
        assert not (tmp_path / "env").exists() and not (tmp_path / "env.building").exists()
