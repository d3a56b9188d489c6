"""``rfkit eval lm-eval``: the in-process lm-evaluation-harness bridge, offline.

The standard tasks need hub datasets, so the runs use the local multiple-choice task in
``tests/fixtures/lm_eval/`` (8 questions, a JSONL read by the ``json`` dataset builder).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import ROOT, float32_copy, run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from rfkit.conversion import evaluations

TASKS = ROOT / "tests" / "fixtures" / "lm_eval"
TASK = "rfkit_tiny_mc"
INSTALL = 'lm-eval is not installed; install the eval extra: pip install "rfkit[eval]"'


@pytest.fixture
def offline(monkeypatch):
    """No network, and the working directory the task's relative data_files expect."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(ROOT)


@pytest.fixture
def no_model_load(monkeypatch):
    import rfkit.config.loading

    monkeypatch.setattr(rfkit.config.loading, "load_model", lambda *a, **k: pytest.fail("the model must not load"))


def reference_accuracy(model_dir, limit: int | None = None) -> float:
    """Accuracy by hand: the choice whose continuation " choice" has the highest summed
    log-likelihood after "Question: ...\\nAnswer:" (lm-eval's multiple_choice ``acc``)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    docs = [json.loads(line) for line in (TASKS / "tiny_mc.jsonl").read_text().splitlines() if line.strip()]
    right = 0
    for doc in docs[:limit]:
        context = f"Question: {doc['question']}\nAnswer:"
        n_ctx = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        scores = []
        for choice in doc["choices"]:
            ids = torch.tensor([tokenizer(context + " " + choice, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            scores.append(sum(float(logp[t - 1, ids[0, t]]) for t in range(n_ctx, ids.shape[1])))
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    return right / len(docs[:limit])


def test_missing_lm_eval_is_one_line_with_the_install_hint(tiny_model_dir, monkeypatch, capsys, no_model_load):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    code, _, err = run_cli(["eval", "lm-eval", "--model", str(tiny_model_dir), "--tasks", "hellaswag"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"rfkit eval: error: {INSTALL}"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", " , "], "--tasks: give at least one task"),
        (["--tasks", TASK, "--include-path", "/no/such/dir"], "--include-path: '/no/such/dir' is not a directory"),
        (["--tasks", TASK, "--limit", "2.5"], "--limit: must be a whole number >= 1 or a fraction in (0, 1)"),
        (["--tasks", TASK, "--limit", "0"], "--limit: must be a whole number"),
        (["--tasks", TASK, "--num-fewshot", "-1"], "--num-fewshot: must be an integer >= 0"),
        (["--tasks", TASK, "--batch-size", "0"], "--batch-size: must be an integer >= 1"),
        (["--tasks", TASK, "--device", "tpu"], "--device: 'tpu' is not allowed"),
    ],
)
def test_bad_flags_are_one_line_before_anything_loads(tiny_model_dir, args, message, capsys, no_model_load):
    code, _, err = run_cli(["eval", "lm-eval", "--model", str(tiny_model_dir), *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.slow
def test_unknown_tasks_are_named_before_the_model_loads(tiny_model_dir, capsys, no_model_load, offline):
    code, _, err = run_cli(
        ["eval", "lm-eval", "--model", str(tiny_model_dir), "--tasks", f"hellaswag,helaswag,{TASK},no_such_task",
         "--include-path", str(TASKS)], capsys)  # fmt: skip
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "unknown task(s) helaswag, no_such_task " in lines[0]  # hellaswag and the local task are known
    assert "helaswag -> hellaswag" in lines[0] and "--include-path" in lines[0] and "lm-eval --tasks list" in lines[0]


def test_local_tasks_are_found_without_indexing_lm_evals_own(offline):
    from rfkit.evals.lm_eval import task_manager

    local = task_manager(str(TASKS), [TASK])  # every name a task of the include path: that folder alone
    assert TASK in local.all_subtasks and "hellaswag" not in local.all_tasks
    full = task_manager(str(TASKS), ["hellaswag", TASK])  # one of lm-eval's own: the full index
    assert full is not local and {"hellaswag", TASK} <= set(full.all_tasks)
    assert task_manager(str(TASKS), [TASK]) is local and task_manager(str(TASKS), ["hellaswag"]) is full  # kept per process


@pytest.mark.slow
def test_local_task_on_the_tiny_model_matches_the_accuracy_by_hand(tiny_model_dir, tmp_path, capsys, offline):
    out = tmp_path / "lm.json"
    code, stdout, err = run_cli(
        ["eval", "lm-eval", "--model", str(tiny_model_dir), "--tasks", TASK, "--include-path", str(TASKS),
         "--batch-size", "4", "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    acc = result["results"][TASK]["acc,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= result["results"][TASK]["acc_norm,none"] <= 1.0
    assert result["n-samples"][TASK] == {"original": 8, "effective": 8}
    assert acc == pytest.approx(reference_accuracy(tiny_model_dir))
    assert result["tasks"] == [TASK] and result["converted"] is False and result["lm_eval_version"]
    assert result["configs"][TASK]["dataset_path"] == "json"
    assert f"|{TASK}|" in stdout.replace(" ", "") and "acc" in stdout


@pytest.mark.slow
def test_converted_model_with_limit(converted_dir, tmp_path, capsys, offline):
    out = tmp_path / "lm.json"
    # a copy (the score goes onto the model's card), in float32: on the tiny random model two choices
    # can score within bf16's rounding, where lm-eval's padded batches and the reference's single
    # sequences would pick differently
    model = float32_copy(converted_dir, tmp_path / "model")
    code, _, err = run_cli(
        ["eval", "lm-eval", "--model", str(model), "--tasks", TASK, "--include-path", str(TASKS),
         "--limit", "5", "--batch-size", "2", "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["converted"] is True and result["limit"] == 5
    assert result["n-samples"][TASK] == {"original": 8, "effective": 5}
    assert result["results"][TASK]["acc,none"] == pytest.approx(reference_accuracy(model, limit=5))
    (entry,) = evaluations.load(model).values()
    assert entry["rows"][f"{TASK} acc"] == {"converted": result["results"][TASK]["acc,none"]}
    assert not any("stderr" in measure for measure in entry["rows"])
