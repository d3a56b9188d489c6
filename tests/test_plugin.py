"""The example plugin package (examples/plugin), installed for real and used through the CLI.

The packages are installed offline into temporary directories (``pip install --target``) and
every check that imports them runs in a process of its own with that directory first on its
path, as ``PYTHONPATH`` would put it: its ``.dist-info`` is what makes the ``rfkit.plugins``
entry point visible, and nothing the plugins define leaks into this test process. The processes
are forked from this one (``helpers.forked_run``: no 10 s interpreter start each).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers import forked_run

from rfkit.cli import main

pytestmark = pytest.mark.slow  # every test here installs the plugin with pip first

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugin"

# The docs page whose "Write your own policy" section shows a complete policy. The tests run
# that code as it stands on the page (read from it, not copied here), so the page cannot drift.
DOCS_PAGE = ROOT / "docs" / "extending.md"
POLICY_SECTION = "## Write your own policy"


def docs_policy() -> str:
    """The first ```python block of the "Write your own policy" section of ``DOCS_PAGE``."""
    text = DOCS_PAGE.read_text()
    assert f"\n{POLICY_SECTION}\n" in text, f"{DOCS_PAGE.name} has no '{POLICY_SECTION}' section"
    section = text.split(f"\n{POLICY_SECTION}\n", 1)[1].split("\n## ", 1)[0]
    assert "```python\n" in section, f"the '{POLICY_SECTION}' section of {DOCS_PAGE.name} has no ```python block"
    code = section.split("```python\n", 1)[1]
    assert "\n```" in code, f"the ```python block of '{POLICY_SECTION}' is not closed"
    return code.split("\n```", 1)[0] + "\n"


def with_plugins(fn, *args, sites: list[Path], cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    """``fn(*args)`` in a process of its own, in ``cwd``, with the installed ``sites`` first on
    its path; its exit code, stdout and stderr."""

    def child():
        os.chdir(cwd)
        sys.path[:0] = [str(site) for site in sites]
        fn(*args)

    return forked_run(child, env={"RFKIT_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "RFKIT_LOG": "WARNING"})


def run_script(code: str, *argv: str) -> None:
    """``python -c CODE ARGV...`` in this (forked) process."""
    sys.argv = ["-c", *argv]
    sys.modules.pop("my_policies", None)  # the script writes and imports its own
    exec(compile(code, "<checks>", "exec"), {"__name__": "__main__"})


def pip_install(src: Path, target: Path) -> Path:
    """Install the package at ``src`` into ``target``: no index, no build isolation (the
    environment's setuptools builds it), no dependencies (rfkit is already here). The build
    writes into its source tree, so a copy is built."""
    work = target.parent / f"{src.name}-build"
    shutil.copytree(src, work, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--quiet", "--target", str(target), str(work)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(target.glob("*.dist-info/entry_points.txt")), "no entry points installed"
    return target


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    return pip_install(PLUGIN, tmp_path_factory.mktemp("plugin") / "site")


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> Path:
    """A plugin package whose module fails to import (a missing dependency)."""
    root = tmp_path_factory.mktemp("broken")
    src = root / "plugin"
    (src / "rfkit_broken_plugin").mkdir(parents=True)
    (src / "pyproject.toml").write_text(
        textwrap.dedent("""\
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "rfkit-broken-plugin"
            version = "0.0.1"

            [project.entry-points."rfkit.plugins"]
            broken = "rfkit_broken_plugin"

            [tool.setuptools]
            packages = ["rfkit_broken_plugin"]
        """)
    )
    (src / "rfkit_broken_plugin" / "__init__.py").write_text("import rfkit_missing_dependency  # not installed\n")
    return pip_install(src, root / "site")


def tiny_recipe(model_dir, corpus, root: Path) -> Path:
    """A recipe naming the plugin's classes by short name, sized for the tiny model."""
    recipe = {
        "seed_everything": 0,
        "model": {
            "base_model": str(model_dir),
            "policy": {"class_path": "EntropyPolicy", "init_args": {"beta": 0.5, "window": 4}},
            "operator": {"class_path": "EMAOperator", "init_args": {"expand": 1}},
            "freeze": "pretrained",
            "transfer": {"steps": 3, "samples": 4, "batch_size": 2, "seq_len": 16, "readout": "lstsq"},
        },
        "data": {"source": str(corpus), "seq_len": 32, "batch_size": 2, "calibration_samples": 4, "val_blocks": 4,
                 "split": [0.1, 0.1]},
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": 2, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "default_root_dir": str(root)},
    }  # fmt: skip
    path = root / "entropy_ema.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# Run in the checks' process after MIXER_CHECKS (one process for both), on the folder
# `rfkit convert` wrote: sys.argv[2], empty when the conversion failed
RELOAD = """
import rfkit  # registers the converted model types
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

out = sys.argv[2]
if out:
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    saved, state = load_file(out + "/model.safetensors"), model.state_dict()
    mixers = {n: m for n, m in model.named_modules() if type(m).__name__ == "EMAMixer"}
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        step = model(ids[:, :8], use_cache=True)  # prefill, then one token at a time through EMAMixer.step
        cache, logits = step.past_key_values, [step.logits]
        for t in range(8, 12):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache, logits = step.past_key_values, logits + [step.logits]
    res["reload"] = {
        "type": type(model).__name__,
        "mixers": sorted(mixers),
        "mixer_type": sorted({type(m).__module__ + "." + type(m).__name__ for m in mixers.values()}),
        "differs_from_file": [k for k, v in saved.items() if not torch.equal(state[k], v)],
        "not_in_file": [k for k in state if ".mixer." in k and k not in saved],
        "out_proj_max": max(float(m.out_proj.weight.detach().abs().max()) for m in mixers.values()),
        "shape": list(full.shape),
        "finite": bool(torch.isfinite(full).all()),
        "decode_vs_full": float((torch.cat(logits, 1) - full).abs().max()),
    }
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def converted(plugin_site, tiny_model_dir, tiny_corpus, tmp_path_factory):
    """``rfkit convert`` of the tiny model with the plugin's classes named by short name."""
    root = tmp_path_factory.mktemp("plugin-convert")
    recipe = tiny_recipe(tiny_model_dir, tiny_corpus, root)
    out = root / "converted"
    args = ["convert", "--config", str(recipe), "--output", str(out)]
    proc = with_plugins(main, args, sites=[plugin_site], cwd=root, cache=root / "cache")
    return proc, out


def test_short_names_from_an_installed_plugin_drive_a_conversion(converted):
    proc, out = converted
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["rf_operator"]["class_path"] == "rfkit_entropy_plugin.EMAOperator"
    assert config["rf_operator"]["init_args"] == {"expand": 1, "max_timescale": 256.0, "zero_init_output": True}
    head_map = json.loads((out / "head_map.json").read_text())
    assert head_map["policy"]["class_path"] == "rfkit_entropy_plugin.EntropyPolicy"
    assert head_map["policy"]["prefer"] == "high" and head_map["window"] == 4
    assert sum(map(len, head_map["selected"])) == 4  # beta 0.5 of 2 layers x 2 KV groups, 2 heads each
    assert config["rf_selected"] == head_map["selected"]
    # a plugin's operator: the folder carries no code of its own (it loads where the plugin is), and says so
    assert "auto_map" not in config and not (out / "modeling_rfkit.py").exists()
    assert "carries no code of its own (its operator rfkit_entropy_plugin.EMAOperator is a plugin's" in proc.stderr
    assert "library_name: rfkit\n" in (out / "README.md").read_text()


def test_the_converted_model_reloads_with_its_plugin_operator(converted, mixer_checks):
    proc, _out = converted
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = mixer_checks["reload"]
    assert got["type"] == "RecurFormerLlamaForCausalLM"
    assert got["mixer_type"] == ["rfkit_entropy_plugin.EMAMixer"] and got["mixers"]
    assert got["differs_from_file"] == [] and got["not_in_file"] == []  # the reloaded weights are the saved ones
    assert got["out_proj_max"] > 0  # the transfer's read-out solve wrote the zero-initialised out_proj
    assert got["shape"][:2] == [2, 12] and got["finite"]
    assert got["decode_vs_full"] < 1e-4  # prefill + step() decoding matches one full forward


MIXER_CHECKS = """
import json
import torch
from rfkit_entropy_plugin import EMAOperator, EntropyPolicy
from rfkit.models.layout import AttentionLayout
from rfkit.conversion.policies import PolicyError
from rfkit.conversion.profile import HeadProfile

res = {}
torch.manual_seed(0)
mixer = EMAOperator(expand=2, zero_init_output=False).build(16, 24, layer_idx=0)
x = torch.randn(2, 70, 16)  # longer than one 64-token chunk
with torch.no_grad():
    res["zero_init"] = float(EMAOperator().build(16, 24, 0).out_proj.weight.abs().max())
    full, (h_full,) = mixer(x, return_states=True)
    res["plain_vs_states"] = float((mixer(x) - full).abs().max())
    out, state = mixer(x[:, :5], return_states=True)
    outs = [out]
    for t in range(5, 70):
        out, *state = mixer.step(x[:, t : t + 1], *state)
        outs.append(out)
    res["step_vs_forward"] = float((torch.cat(outs, 1) - full).abs().max())
    res["step_state"] = float((state[0] - h_full).abs().max())
    # left padding (3 pad tokens in row 0, none in row 1), from a fresh state and continuing one
    pad = torch.randn(2, 3, 16) * 10
    xp = torch.cat([pad, x], 1)
    mask = torch.ones(2, 73)
    mask[0, :3] = 0
    xp[1] = torch.cat([x[1], torch.randn(3, 16)])  # row 1: unpadded, 73 real tokens
    _, (h_row1,) = mixer(xp[1:], return_states=True)
    out_p, (h_p,) = mixer(xp, return_states=True, mask=mask)
    res["pad_state"] = max(float((h_p[0] - h_full[0]).abs().max()), float((h_p[1] - h_row1[0]).abs().max()))
    res["pad_out"] = float((out_p[0, 3:] - full[0]).abs().max())
    h0 = torch.randn(2, mixer.d_inner)
    _, (h_a,) = mixer(x[:, :10], h0, return_states=True)
    pad_first = torch.cat([torch.zeros(2, 3), torch.ones(2, 10)], 1)
    _, (h_b,) = mixer(torch.cat([pad, x[:, :10]], 1), h0, return_states=True, mask=pad_first)
    res["pad_state_continued"] = float((h_a - h_b).abs().max())
    _, (h_c,) = mixer(pad, h0, return_states=True, mask=torch.zeros(2, 3))
    res["pad_state_unchanged"] = float((h_c - h0).abs().max())
    bytes_ = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = mixer.to(dtype)
        _, states = m(x.to(dtype), return_states=True)
        _, *stepped = m.step(x[:, :1].to(dtype), *states)
        bytes_[str(dtype)] = [m.state_bytes(2, dtype), sum(t.numel() * t.element_size() for t in states),
                              sum(t.numel() * t.element_size() for t in stepped)]
    res["state_bytes"] = bytes_

# the policy on a hand-made profile: 2 layers, 4 query heads in 2 KV groups
layout = AttentionLayout("llama", 2, 4, 2, 16, 64)
ent = [[0.9, 0.8, 0.1, 0.2], [0.5, 0.5, 0.95, 0.7]]
profile = HeadProfile(window=4, alpha=0.5, exclude_first_token=True, seq_len=32, samples=4,
                      rai=[[0] * 4] * 2, rr_mean=[[0.0] * 4] * 2, entropy_mean=ent)
res["kv_high"] = EntropyPolicy(beta=0.5).select(layout, profile)  # group means 0.85, 0.15, 0.5, 0.825
res["kv_low"] = EntropyPolicy(beta=0.25, prefer="low").select(layout, profile)
res["head_high"] = EntropyPolicy(beta=0.25, granularity="query_head").select(layout, profile)
res["settings"] = EntropyPolicy(window=7).profile_settings()
for bad in (dict(prefer="sideways"), dict(window=0), dict(granularity="layer")):
    try:
        EntropyPolicy(**bad)
    except PolicyError as err:
        res.setdefault("bad", []).append(str(err))
try:
    EntropyPolicy().select(layout, HeadProfile(window=4, alpha=0.5, exclude_first_token=True, seq_len=32,
                                               samples=4, rai=[], rr_mean=[]))
except PolicyError as err:
    res["no_entropy"] = str(err)

# the docs' example policy, as my_policies.py in the working directory
import sys
from pathlib import Path

Path("my_policies.py").write_text(DOCS_POLICY)
sys.path.insert(0, ".")
from my_policies import RecentHeads

profile.rr_mean = [[0.9, 0.2, 0.85, 0.1], [0.9, 0.79, 0.8, 0.3]]
policy = RecentHeads(threshold=0.8, window=8)
res["docs"] = [policy.select(layout, profile), policy.beta, policy.profile_settings()]
# named in a recipe: the CLI parses its arguments against the signature
from rfkit.config.lightning_cli import make_cli

cli = make_cli(["--config", sys.argv[1], "--model.policy", "my_policies.RecentHeads",
                "--model.policy.init_args.threshold", "0.7"], run=False)
res["docs_cli"] = [type(cli.model.policy).__name__, cli.model.policy.threshold, cli.model.policy.window]
"""


@pytest.fixture(scope="module")
def mixer_checks(plugin_site, converted, tiny_model_dir, tiny_corpus, tmp_path_factory) -> dict:
    """MIXER_CHECKS, then RELOAD on the converted folder, in one process where the plugin is installed."""
    cwd = tmp_path_factory.mktemp("plugin-checks")
    recipe = tiny_recipe(tiny_model_dir, tiny_corpus, cwd)
    convert, out = converted
    folder = str(out) if convert.returncode == 0 else ""
    code = f"DOCS_POLICY = {docs_policy()!r}\n{MIXER_CHECKS}{RELOAD}"
    proc = with_plugins(run_script, code, str(recipe), folder, sites=[plugin_site], cwd=cwd, cache=cwd / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_nothing_the_plugins_define_reaches_this_process(converted, mixer_checks):
    """The checks ran in processes of their own: the plugin's modules, imported there, are not
    here (a test process that had them would pass without the installed entry point)."""
    assert mixer_checks["reload"]["mixer_type"] == ["rfkit_entropy_plugin.EMAMixer"]  # imported in the child
    assert not {"rfkit_entropy_plugin", "my_policies"} & set(sys.modules)


def test_ema_mixer_step_decoding_equals_one_full_forward(mixer_checks):
    assert mixer_checks["zero_init"] == 0.0  # zero_init_output: a fresh conversion silences the heads
    assert mixer_checks["plain_vs_states"] == 0.0
    assert mixer_checks["step_vs_forward"] < 1e-5
    assert mixer_checks["step_state"] < 1e-5


def test_ema_mixer_pad_tokens_leave_the_state_untouched(mixer_checks):
    assert mixer_checks["pad_state"] < 1e-5  # a left-padded chunk ends in the unpadded chunk's state
    assert mixer_checks["pad_out"] < 1e-5  # and gives the same outputs on the real tokens
    assert mixer_checks["pad_state_continued"] < 1e-5  # also when continuing from a state
    assert mixer_checks["pad_state_unchanged"] == 0.0  # an all-pad chunk changes nothing


def test_ema_mixer_state_bytes_are_the_bytes_of_its_state(mixer_checks):
    for dtype, (predicted, forward_state, step_state) in mixer_checks["state_bytes"].items():
        assert predicted == forward_state == step_state, dtype
    assert mixer_checks["state_bytes"]["torch.float32"][0] == 2 * 32 * 4  # batch 2, d_inner 2 x 16, float32


def test_entropy_policy_ranks_units_by_entropy(mixer_checks):
    assert mixer_checks["kv_high"] == [[0, 1], [2, 3]]  # the two most diffuse KV groups
    assert mixer_checks["kv_low"] == [[2, 3], []]  # the most focused group
    assert mixer_checks["head_high"] == [[0], [2]]  # 2 of 8 query heads: 0.95 and 0.9
    assert mixer_checks["settings"] == {"window": 7, "alpha": 0.5, "exclude_first_token": True}
    prefer, window, granularity = mixer_checks["bad"]
    assert prefer.startswith("model.policy.prefer: 'sideways' is not allowed")
    assert window.startswith("model.policy.window:") and granularity.startswith("model.policy.granularity:")
    assert mixer_checks["no_entropy"].startswith("model.policy: EntropyPolicy needs attention entropy")
    assert "\n" not in mixer_checks["no_entropy"]


def test_the_docs_show_this_policy_in_under_30_lines():
    code = docs_policy()
    assert "class RecentHeads(HeadSelectionPolicy):" in code  # the class the checks below import
    assert "from rfkit.policies import" in code  # the public import path, as plugins use it
    assert len(code.strip().splitlines()) < 30


def test_docs_example_policy_selects_from_the_profile(mixer_checks):
    selected, beta, settings = mixer_checks["docs"]
    assert selected == [[], [0, 2]]  # layer 0 kept; RR >= 0.8 in layer 1
    assert beta == 2 / 8
    assert settings == {"window": 8, "alpha": 0.8, "exclude_first_token": True}
    # named by class_path on the command line; window 4 is carried over from the recipe's policy
    # (jsonargparse keeps the init_args that the new class also takes)
    assert mixer_checks["docs_cli"] == ["RecentHeads", 0.7, 4]


def test_a_plugin_that_fails_to_import_stops_the_cli_with_one_line(
    plugin_site, broken_site, tiny_model_dir, tiny_corpus, tmp_path
):
    recipe = tiny_recipe(tiny_model_dir, tiny_corpus, tmp_path)
    args = ["fit", "--config", str(recipe)]
    proc = with_plugins(main, args, sites=[plugin_site, broken_site], cwd=tmp_path, cache=tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "rfkit: error: plugin 'broken' from package 'rfkit-broken-plugin' failed to import: "
        "No module named 'rfkit_missing_dependency'"
    ]
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing ran
