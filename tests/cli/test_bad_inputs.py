"""Bad input: one line on stderr naming the field, exit code 2, no traceback, nothing written.

Every case runs ``rfkit`` in process on the tiny model and corpus (``load_base_model`` raises,
so a case that loads a model before refusing fails); one runs the real console script. The
full-disk case is the one that fails mid-run (a write of ``rfkit convert``), so it is allowed
the run's own output before its single error line, and must leave no partial directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMOLLM, run_cli, tiny_args

import rfkit.training.module  # noqa: F401  (imported before any test replaces rfkit.conversion.convert.load_base_model)

ERROR = "rfkit: error: "


# ---------------------------------------------------------------------------------- helpers


def listing(root: Path) -> list[str]:
    """Every path under ``root`` (relative), to compare before and after a run."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def assert_one_line(code: int, out: str, err: str, *words: str, prefix: str = ERROR) -> str:
    """Exit code 2, exactly one non-empty stderr line (the error), no traceback, ``words`` in it."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert "Traceback" not in out + err, err
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(prefix), line
    for word in words:
        assert word in line, (word, line)
    return line


def fake_hub_cache(cache: Path, model_dir: Path, repo: str, weights: str = "incomplete") -> Path:
    """A Hugging Face hub cache as huggingface_hub lays it out (``models--org--name`` with
    ``refs/main``, ``blobs/`` and ``snapshots/<commit>/`` symlinks into the blobs), for
    ``repo`` with the files of ``model_dir``. ``weights``: ``"incomplete"`` leaves the weight
    blob as ``<sha256>.incomplete`` with a third of its bytes and no snapshot link (what an
    interrupted download leaves), ``"complete"`` links it, ``"none"`` has no weights at all."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    blobs, snapshot = repo_dir / "blobs", repo_dir / "snapshots" / commit
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    if weights == "complete":
        names.append("model.safetensors")
    for name in names:
        data = (model_dir / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else hashlib.sha1(data).hexdigest()
        (blobs / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / name)
    if weights == "incomplete":
        data = (model_dir / "model.safetensors").read_bytes()
        (blobs / f"{hashlib.sha256(data).hexdigest()}.incomplete").write_bytes(data[: len(data) // 3])
    return repo_dir


@pytest.fixture
def no_loading(monkeypatch):
    """Fail any case that loads a model before refusing its input (every command loads through
    :func:`rfkit.pipeline.load`, which looks ``load_base_model`` up when it runs)."""
    import rfkit.conversion.convert

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rfkit.conversion.convert, "load_base_model", load)


@pytest.fixture
def inputs(tmp_path, tiny_model_dir):
    """Broken inputs under ``tmp_path/inputs``; created before the listing is taken."""
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "empty.jsonl").write_bytes(b"")
    (d / "no_text_field.jsonl").write_text("".join(json.dumps({"title": f"t{i}", "body": "words"}) + "\n" for i in range(3)))
    (d / "blank_texts.jsonl").write_text("".join(json.dumps({"title": f"t{i}", "text": " "}) + "\n" for i in range(3)))
    (d / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    (d / "bad.yaml").write_text("model:\n  base_model: [unclosed\n  policy: : :\n")
    (d / "list.yaml").write_text("- model\n- data\n")
    (d / "a_file").write_text("not a directory\n")
    (d / "garbage.ckpt").write_text("garbage, not a checkpoint\n")
    truncated = d / "truncated-model"  # an interrupted copy: half of the weights file
    shutil.copytree(tiny_model_dir, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    broken = d / "broken-config-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text('{"model_type": "llama",')
    (d / "config-only-model").mkdir()
    shutil.copy(tiny_model_dir / "config.json", d / "config-only-model" / "config.json")
    wide = d / "small-vocab-model"  # the tiny model's weights, a config that says vocab_size 128
    shutil.copytree(tiny_model_dir, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "vocab_size": 128}))
    return d


# ---------------------------------------------------------------------------------- the cases

# (id, subcommand, extra args, words the line must hold); "{in}" is the inputs directory,
# "{tmp}" the test's tmp_path. Every case runs `rfkit SUB <tiny recipe> EXTRA` with its run
# directory at {tmp}/runs.
CASES = [
    # wrong types
    ("type-str-for-int", "fit", ["--data.seq_len", "abc"], ["data.seq_len: expected an integer, got 'abc'"]),
    ("type-list-for-int", "fit", ["--data.batch_size", "[2]"], ["data.batch_size: expected an integer, got [2]"]),
    ("type-list-for-float", "fit", ["--model.policy.init_args.alpha", "[0.1, 0.2]"], ["model.policy.alpha: expected a number"]),
    ("type-float-for-list", "fit", ["--data.split", "0.5"], ["data.split: expected a list"]),
    ("type-str-for-trainer-int", "fit", ["--trainer.max_steps", "ten"], ["trainer.max_steps: expected an integer, got 'ten'"]),
    ("type-float-for-int", "fit", ["--model.policy.init_args.window", "3.5"], ["model.policy.window: expected an integer"]),
    ("type-str-for-bool", "fit", ["--model.policy.init_args.allow_all_heads", "maybe"], ["model.policy.allow_all_heads: expected true or false"]),
    # unknown keys
    ("unknown-model-key", "fit", ["--model.nonsense", "1"], ["model.nonsense: unknown option", "base_model"]),
    ("unknown-data-key", "fit", ["--data.init_args.seq_lenn", "5"], ["data.seq_lenn: unknown option (nearest: seq_len)"]),
    # bad enum values
    ("enum-dtype", "fit", ["--model.dtype", "float64"], ["model.dtype: 'float64' is not allowed; allowed: auto, float32, bfloat16, float16"]),
    ("enum-granularity", "fit", ["--model.policy.init_args.granularity", "heads"], ["model.policy.granularity", "allowed: kv_group, query_head"]),
    ("enum-accelerator", "fit", ["--trainer.accelerator", "tpu9"], ["trainer.accelerator: 'tpu9' is not allowed; allowed:", "cpu"]),
    # negative steps
    ("negative-max-steps", "fit", ["--trainer.max_steps", "-5"], ["trainer.max_steps: -5 is not allowed", "-1 for no limit"]),
    ("negative-transfer-steps", "fit", ["--model.transfer.steps", "-3"], ["model.transfer.steps: -3 is not allowed"]),
    # recipe files
    ("malformed-yaml", "fit", ["--config", "{in}/bad.yaml"], ["--config: cannot read", "bad.yaml' as YAML", "line 3"]),
    ("yaml-not-a-mapping", "fit", ["--config", "{in}/list.yaml"], ["--config:", "holds a YAML list, not a recipe"]),
    ("missing-recipe-file", "fit", ["--config", "{in}/no_such_recipe.yaml"], ["--config:", "no_such_recipe.yaml' does not exist; recipes:"]),
    # policy and operator
    ("bad-policy-class", "fit", ["--model.policy.class_path", "rfkit.conversion.policies.NoSuchPolicy"], ["model.policy: class 'rfkit.conversion.policies.NoSuchPolicy' cannot be used"]),
    ("operator-unknown-arg", "fit", ["--model.operator.init_args.feature_dims", "4"], ["model.operator.feature_dims: unknown option (nearest: feature_dim)"]),
    ("operator-bad-value", "fit", ["--model.operator.init_args.feature_dim", "3"], ["model.operator.feature_dim: 3 is not allowed"]),
    # beta = 1 without the opt-in
    ("beta-1-without-opt-in", "fit", ["--model.policy.init_args.beta", "1"],
     ["model.policy.init_args.beta: 1.0 replaces every attention head", "destroys quality", "model.policy.init_args.allow_all_heads: true"]),  # fmt: skip
    # model
    ("missing-model-path", "fit", ["--model.base_model", "{tmp}/no/such/model"], ["model.base_model: path", "does not exist"]),
    ("model-not-a-hub-id", "fit", ["--model.base_model", "not a model"], ["model.base_model: 'not a model' is neither an existing local path nor a hub model id"]),
    ("model-weights-truncated", "fit", ["--model.base_model", "{in}/truncated-model"],
     ["model.base_model: the weights of", "model.safetensors is truncated", "download them again"]),  # fmt: skip
    ("model-without-weights", "fit", ["--model.base_model", "{in}/config-only-model"],
     ["model.base_model:", "has no weights (model.safetensors missing)"]),  # fmt: skip
    ("model-config-not-json", "fit", ["--model.base_model", "{in}/broken-config-model"], ["model.base_model: cannot read", "config.json"]),
    ("tokenizer-larger-than-vocab", "fit", ["--model.base_model", "{in}/small-vocab-model"],
     ["model.base_model / data.tokenizer:", "49152 token ids", "vocab_size 128", "out of range"]),  # fmt: skip
    ("seq-len-beyond-context", "fit", ["--data.seq_len", "512"], ["data.seq_len: 512 tokens is beyond the context", "max_position_embeddings 256", "<= 256"]),
    # data
    ("missing-data-file", "fit", ["--data.source", "{in}/no_such.jsonl"], ["data.source: path", "does not exist"]),
    ("empty-data-file", "fit", ["--data.source", "{in}/empty.jsonl"], ["data.source: file", "is empty (0 bytes)"]),
    ("jsonl-without-text-field", "fit", ["--data.source", "{in}/no_text_field.jsonl"],
     ["data.text_field: field 'text' missing in no_text_field.jsonl line 1 (fields: body, title)"]),  # fmt: skip
    ("data-not-utf8", "fit", ["--data.source", "{in}/latin1.jsonl"], ["data.source: latin1.jsonl is not UTF-8 text"]),
    ("jsonl-with-blank-texts", "fit", ["--data.source", "{in}/blank_texts.jsonl"], ["data.source:", "contains no documents"]),
    # long blocks in training (data.long_source)
    ("long-data-missing", "fit", ["--data.long_source", "{in}/no_such.jsonl"], ["data.long_source: path", "does not exist"]),
    ("long-data-empty", "fit", ["--data.long_source", "{in}/empty.jsonl"], ["data.long_source: file", "is empty (0 bytes)"]),
    ("long-data-beyond-context", "fit", ["--data.long_seq_len", "512"],
     ["data.long_seq_len: 512 tokens is beyond the context", "max_position_embeddings 256", "<= 256"]),  # fmt: skip
    ("long-every-zero", "fit", ["--data.long_every", "0"], ["data.long_every: must be an integer >= 1, got 0"]),
    ("long-recall-negative", "fit", ["--data.long_recall", "-1"], ["data.long_recall: must be an integer >= 0, got -1"]),
    ("long-recall-without-long-source", "fit", ["--data.long_source", "null", "--data.long_recall", "4"], ["data.long_recall: plants records", "set data.long_source"]),
    ("long-recall-max-gap-below-gap", "fit", ["--data.long_recall_max_gap", "10"], ["data.long_recall_max_gap: must be an integer >= data.long_recall_gap (256) or null, got 10"]),
    ("long-recall-digits-out-of-order", "fit", ["--data.long_recall_digits", "[6, 3]"],
     ["data.long_recall_digits: must be two integers [fewest, most] with 1 <= fewest <= most, got [6, 3]"]),  # fmt: skip
    ("long-recall-digits-zero", "fit", ["--data.long_recall_digits", "[0, 3]"],
     ["data.long_recall_digits: must be two integers [fewest, most] with 1 <= fewest <= most, got [0, 3]"]),  # fmt: skip
    ("recall-weight-without-records", "fit", ["--model.distill.recall", "1"],
     ["model.distill.recall: 1", "planted by data.long_recall, which is 0"]),  # fmt: skip
    ("policy-recall-negative", "fit", ["--model.policy", "rfkit.policies.StreamedLossPolicy", "--model.policy.init_args.recall", "-1"],
     ["model.policy.recall: -1 is not allowed", "integer >= 0"]),  # fmt: skip
    ("policy-recall-weight-negative", "fit", ["--model.policy", "rfkit.policies.StreamedLossPolicy", "--model.policy.init_args.recall_weight", "-0.5"],
     ["model.policy.recall_weight: -0.5 is not allowed", "finite number >= 0"]),  # fmt: skip
    ("position-jitter-negative", "fit", ["--model.position_jitter", "-1"], ["model.position_jitter: must be an integer >= 0, got -1"]),
    # outputs that cannot be written (root ignores permission bits: these are truly unwritable)
    ("root-dir-under-a-file", "fit", ["--trainer.default_root_dir", "{in}/a_file/run"],
     ["trainer.default_root_dir: cannot create", "a_file' is a file, not a directory"]),  # fmt: skip
    ("root-dir-under-proc", "fit", ["--trainer.default_root_dir", "/proc/rfkit-bad-input/run"],
     ["trainer.default_root_dir: cannot write '/proc/rfkit-bad-input/run'"]),  # fmt: skip
    ("convert-output-under-a-file", "convert", ["--output", "{in}/a_file/converted"], ["--output: cannot create", "is a file, not a directory"]),
    ("convert-output-is-a-file", "convert", ["--output", "{in}/a_file"], ["--output:", "exists and is a file; give a directory"]),
    ("profile-output-under-proc", "profile", ["--output", "/proc/rfkit-bad-input/head_map.json"], ["--output: cannot write '/proc/rfkit-bad-input/head_map.json'"]),
    ("convert-device-unknown", "convert", ["--device", "tpu"], ["--device: 'tpu' is not allowed; allowed: cpu, cuda, cuda:N"]),
    # checkpoints
    ("ckpt-missing", "validate", ["--ckpt_path", "{in}/none.ckpt"], ["--ckpt_path:", "none.ckpt' does not exist"]),
    ("ckpt-not-a-checkpoint", "validate", ["--ckpt_path", "{in}/garbage.ckpt"], ["--ckpt_path:", "is not a PyTorch checkpoint"]),
]


@pytest.mark.parametrize("sub, extra, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    sub, extra, words, tiny_model_dir, tiny_corpus, inputs, tmp_path, capsys, no_loading
):
    fill = lambda s: s.replace("{in}", str(inputs)).replace("{tmp}", str(tmp_path))  # noqa: E731
    runs = tmp_path / "runs"
    args = [sub, *tiny_args(tiny_model_dir, tiny_corpus, runs), "--model.transfer", "null", *map(fill, extra)]
    if sub in ("convert", "profile") and "--output" not in extra:
        args += ["--output", str(tmp_path / "out")]
    before = listing(tmp_path)
    code, out, err = run_cli(args, capsys)
    assert_one_line(code, out, err, *map(fill, words))
    assert not runs.exists()  # no run directory
    assert listing(tmp_path) == before  # no output, no partial or temporary file


@pytest.mark.parametrize(
    "variable,value,line",
    [
        ("RFKIT_WINDOW_BACKEND", "fast", "RFKIT_WINDOW_BACKEND: 'fast' is not allowed; allowed: torch, flex"),
        ("RFKIT_STATE_BACKEND", "cuda", "RFKIT_STATE_BACKEND: 'cuda' is not allowed; allowed: torch, triton"),
    ],
)
def test_an_unknown_mixer_backend_is_refused_before_any_model_loads(
    variable, value, line, tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch, no_loading
):
    monkeypatch.setenv(variable, value)
    before = listing(tmp_path)
    code, out, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs")], capsys)
    assert_one_line(code, out, err, line)
    assert listing(tmp_path) == before


def test_hub_model_not_in_the_cache_while_offline(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch, no_loading):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    before = listing(tmp_path)
    args = ["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--model.base_model", "someorg/not-cached"]
    code, out, err = run_cli(args, capsys)
    assert_one_line(code, out, err, "model.base_model: 'someorg/not-cached' is not in the Hugging Face cache",
                    str(tmp_path / "hub"), "HF_HUB_OFFLINE=1")  # fmt: skip
    assert listing(tmp_path) == before


def test_interrupted_hub_download_while_offline(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch, no_loading):
    repo = fake_hub_cache(tmp_path / "hf" / "hub", tiny_model_dir, "someorg/tiny-llama", weights="incomplete")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the cache is $HF_HOME/hub
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    before = listing(tmp_path)
    args = ["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--model.base_model", "someorg/tiny-llama"]
    code, out, err = run_cli(args, capsys)
    line = assert_one_line(code, out, err, "model.base_model: the download of 'someorg/tiny-llama' is incomplete",
                           "rerun online", "delete the partial file")  # fmt: skip
    assert str(next((repo / "blobs").glob("*.incomplete"))) in line
    assert listing(tmp_path) == before


def test_a_complete_hub_cache_passes_the_preflight(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch, no_loading):
    """The same cache with its weights linked is accepted offline: the run gets as far as
    loading the model (which the fixture refuses), and no further check objects."""
    fake_hub_cache(tmp_path / "hub", tiny_model_dir, "someorg/tiny-llama", weights="complete")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from rfkit.config.lightning_cli import make_cli
    from rfkit.hub import check_hub_model

    assert check_hub_model("someorg/tiny-llama") == next((tmp_path / "hub").rglob("snapshots/*"))
    args = [*tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--model.base_model", "someorg/tiny-llama"]
    cli = make_cli(args, run=False)
    assert cli.model.base_model == "someorg/tiny-llama"


@pytest.mark.slow
def test_beta_1_with_the_opt_in_warns_and_runs(tiny_model_dir, tiny_corpus, tmp_path, capsys, caplog):
    out_dir = tmp_path / "all_heads"
    args = ["convert", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--model.transfer", "null",
            "--model.policy.init_args.beta", "1", "--model.policy.init_args.allow_all_heads", "true",
            "--output", str(out_dir)]  # fmt: skip
    with caplog.at_level("WARNING", logger="rfkit.conversion.policies"):
        code, out, err = run_cli(args, capsys)
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.name == "rfkit.conversion.policies"]
    assert any("every attention head" in w and "destroys quality" in w for w in warnings), warnings
    head_map = json.loads((out_dir / "head_map.json").read_text())
    assert head_map["selected"] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert head_map["policy"]["allow_all_heads"] is True


@pytest.mark.slow
def test_full_disk_while_converting_leaves_nothing(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch):
    """ENOSPC half-way through writing the weights: one line naming the output, exit 2, and
    neither the output directory nor its temporary sibling left behind."""
    import transformers.modeling_utils

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)  # a partial file, as a real full disk leaves
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    parent = tmp_path / "out"
    parent.mkdir()
    target = parent / "nested" / "converted"  # its parent is created by the write, and removed again
    args = ["convert", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--model.transfer", "null",
            "--output", str(target)]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 2 and "Traceback" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith(ERROR)]
    assert errors == [f"{ERROR}no space left on device while writing '{target}'; nothing partial was kept there: "
                      "free some space or choose another location"]  # fmt: skip
    assert err.strip().splitlines()[-1] == errors[0]  # the error is the run's last word
    assert listing(parent) == []  # no converted/, no .converted.tmp-*, no nested/


def test_the_disk_full_error_is_still_an_oserror(tmp_path, monkeypatch):
    """Code that tolerates failed cache writes (``except OSError``) keeps doing so."""
    from rfkit.atomic import atomic_write
    from rfkit.errors import DiskFullError, RFKitError

    def write(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError) as caught:
        atomic_write(tmp_path / "new" / "x.json", write)
    assert isinstance(caught.value, OSError) and isinstance(caught.value, RFKitError)
    assert caught.value.errno == errno.ENOSPC and "x.json" in str(caught.value)
    assert listing(tmp_path) == []


@pytest.mark.slow
def test_real_console_script(tiny_model_dir, tiny_corpus, tmp_path):
    """The installed ``rfkit`` script behind an interrupted hub download (offline, its cache given
    by HF_HOME, which huggingface_hub reads when the process starts): exactly one line, exit 2,
    nothing written. Every other refusal takes the same path in process (CASES above,
    tests/cli/test_cli.py), where it costs no interpreter start (10 s on the CI machine)."""
    exe = Path(sys.executable).with_name("rfkit")
    fake_hub_cache(tmp_path / "hf" / "hub", tiny_model_dir, "someorg/tiny-llama", weights="incomplete")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    runs = tmp_path / "runs"
    before = listing(tmp_path)
    args = ["fit", *tiny_args(tiny_model_dir, tiny_corpus, runs), "--model.base_model", "someorg/tiny-llama"]
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    words = ["model.base_model: the download of 'someorg/tiny-llama' is incomplete", "rerun online"]
    assert_one_line(done.returncode, done.stdout, done.stderr, *words)
    assert not runs.exists() and listing(tmp_path) == before


def test_bench_with_a_recipe_whose_model_is_missing(tmp_path, capsys, no_loading):
    """`rfkit bench` reads its own arguments, then the recipe's: a recipe naming a model path that
    does not exist is refused in the recipe's field, under bench's own prefix."""
    recipe = tmp_path / "missing_model.yaml"
    recipe.write_text(Path(SMOLLM).read_text().replace("embedded:smollm2-135m-instruct", str(tmp_path / "no-model")))
    before = listing(tmp_path)
    code, out, err = run_cli(["bench", "cache", "--model", str(recipe), "--json", str(tmp_path / "bench.json")], capsys)
    assert_one_line(code, out, err, "model.base_model: path", "does not exist", prefix="rfkit bench: error: ")
    assert listing(tmp_path) == before


def test_sweep_sets_the_opt_in_for_its_beta_1_rows_and_warns_once(caplog):
    """``rfkit sweep --betas ...,1`` keeps working: its beta 1 rows carry allow_all_heads, and
    the sweep warns once (the rows run without a recipe-level error)."""
    from rfkit.conversion.policies import RecencyRatioPolicy, check_all_heads
    from rfkit.experiments.sweep import _policy_at, warn_all_heads

    recipe_policy = RecencyRatioPolicy(beta=0.5)
    row = _policy_at(recipe_policy, 1.0)
    assert row.allow_all_heads and not recipe_policy.allow_all_heads and not _policy_at(recipe_policy, 0.5).allow_all_heads
    with caplog.at_level("WARNING"):
        assert warn_all_heads([0.0, 0.5, 1.0]) and not warn_all_heads([0.0, 0.9])
        assert check_all_heads(row)  # allowed, with the policy's own warning
    sweep_warnings = [r.getMessage() for r in caplog.records if r.name == "rfkit.experiments.sweep"]
    assert len(sweep_warnings) == 1 and "destroys quality" in sweep_warnings[0]


def test_profile_device_cuda_without_one_is_one_line(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch, no_loading):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, whatever this one has
    args = ["profile", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--device", "cuda:0",
            "--output", str(tmp_path / "out" / "head_map.json")]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert_one_line(code, out, err, "--device: cuda was asked for but no CUDA device is available")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["fit", "validate", "test", "profile", "convert", "sweep"])
def test_an_eval_recipe_given_to_a_fit_command_names_the_command_to_use(command, capsys, no_loading):
    mqar = str(Path(SMOLLM).parent / "mqar_smoke.yaml")
    args = [command, "--config", mqar] + (["--betas", "0.5"] if command == "sweep" else [])
    code, out, err = run_cli(args, capsys)
    prefix = "rfkit sweep: error: " if command == "sweep" else ERROR
    assert_one_line(code, out, err, f"is an 'rfkit eval mqar' recipe, not one for rfkit {command}",
                    f"run rfkit eval mqar --config {mqar}", prefix=prefix)  # fmt: skip


@pytest.mark.parametrize("config", [SMOLLM, "smollm2_b05"])
def test_a_fit_recipe_given_to_eval_mqar_names_rfkit_fit(config, capsys, no_loading):
    code, out, err = run_cli(["eval", "mqar", "--config", config], capsys)
    assert_one_line(code, out, err, "is an 'rfkit fit' recipe", f"run rfkit fit --config {config}", prefix="rfkit eval: error: ")


def test_every_packaged_recipe_is_read_as_the_kind_the_catalogue_lists():
    from rfkit.config.catalog import describe, recipe_kind, recipe_names, recipe_path

    for name in recipe_names():
        assert recipe_kind(recipe_path(name)) == describe(name)["kind"], name
