"""HashHop: the generator, the h_gq scorer, ``rfkit data hashhop``, the fine-tuning data module,
``evaluate_hashhop`` and ``rfkit eval hashhop`` on tiny random models, and their bad input."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
import yaml
from helpers import run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from rfkit.evals.hashhop import evaluate_hashhop, parse_chain, per_hop_accuracy, score
from rfkit.evals.hashhop_finetune import HashHopDataModule
from rfkit.evals.hashhop_samples import format_completion, generate_samples, make_sample
from rfkit.hub import SourceError

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "smollm2_hashhop_b05.yaml")
PLAIN = re.compile(r"^([A-Za-z]+) = ([A-Za-z]+)$")
QUOTED = re.compile(r"^([A-Za-z]+) = '([A-Za-z]+)'$")


def assignment_lines(prompt: str) -> list[str]:
    """The prompt's assignment lines (everything before the blank line)."""
    body, _, _ = prompt.partition("\n\n")
    return body.split("\n")


# ------------------------------------------------------------------------------- generator


@pytest.mark.parametrize("hops,hash_len,chars", [(16, 8, 6144), (4, 8, 1024), (3, 5, 400)])
def test_sample_format_chain_recoverable_and_hashes_distinct(hops, hash_len, chars):
    s = make_sample(random.Random(7), hash_len=hash_len, hops=hops, chars=chars)
    chain = s["chain"]
    assert len(chain) == hops + 1 and all(len(h) == hash_len for h in chain)
    links, ends, hashes = {}, set(), []
    for line in assignment_lines(s["prompt"]):
        m = PLAIN.match(line) or QUOTED.match(line)
        assert m, line
        assert m.group(1) not in links
        links[m.group(1)] = m.group(2)
        hashes += [m.group(1), m.group(2)]
        if QUOTED.match(line):
            ends.add(m.group(2))
    assert len(links) == s["lines"]
    # follow the lines from h0: exactly the chain, and the last link is the quoted one
    walked = [chain[0]]
    while walked[-1] in links:
        walked.append(links[walked[-1]])
    assert walked == chain and chain[-1] in ends
    assert f"{chain[-2]} = '{chain[-1]}'" in s["prompt"]
    # every chain ends in exactly one quoted line: no hash is both quoted and a left side
    assert not ends & links.keys()
    # all hashes distinct: each occurs at most twice (as a value, then as the next left side)
    assert len(set(hashes)) == len(links) + len(ends)
    assert all(len(h) == hash_len for h in hashes)
    # prompt: lines, question, then the completion start "h0 =" (no trailing space)
    assert s["prompt"].endswith(f"\n{chain[0]} =")
    assert chars - (2 * hash_len + 6) <= len(s["prompt"]) <= chars
    assert s["completion"] == " " + " = ".join(chain[1:-1]) + f" = '{chain[-1]}'"


def test_samples_are_deterministic_shuffled_and_distinct_per_seed_and_split():
    a = generate_samples(3, seed=5, hops=4, chars=600)
    assert a == generate_samples(3, seed=5, hops=4, chars=600)
    assert generate_samples(5, seed=5, hops=4, chars=600)[:3] == a  # sample i independent of n
    assert a[0]["prompt"] != a[1]["prompt"]
    assert generate_samples(1, seed=6, hops=4, chars=600)[0]["chain"] != a[0]["chain"]
    assert generate_samples(1, seed=5, split="train", hops=4, chars=600)[0]["chain"] != a[0]["chain"]
    assert [s["index"] for s in a] == [0, 1, 2] and a[0]["seed"] == 5
    # shuffled: the queried chain's lines are not in chain order at the top
    lines = assignment_lines(a[0]["prompt"])
    assert lines[:4] != [f"{x} = {y}" for x, y in zip(a[0]["chain"], a[0]["chain"][1:4])]


def test_a_short_target_still_holds_the_whole_queried_chain():
    s = make_sample(random.Random(0), hops=5, chars=10)
    assert s["lines"] == 5 and len(s["chain"]) == 6


@pytest.mark.parametrize("kw", [{"hops": 0}, {"chars": 0}, {"hash_len": 1}])
def test_make_sample_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        make_sample(random.Random(0), **kw)


# ------------------------------------------------------------------------------- scoring

TARGET = ["aaaa", "bbbb", "cccc", "dddd", "eeee"]  # h0 and 4 hops


@pytest.mark.parametrize(
    "text,chain,value",
    [
        (" bbbb = cccc = dddd = 'eeee'", TARGET, 1.0),
        ("bbbb=cccc=dddd='eeee'", TARGET, 1.0),
        ("  bbbb =\n cccc  = dddd = \"eeee\"\nThe answer is eeee.", TARGET, 1.0),
        (" aaaa = bbbb = cccc = dddd = 'eeee' = ffff", TARGET, 1.0),  # repeated h0 dropped, stops at the quote
        (" bbbb = cccc = xxxx = 'eeee'", ["aaaa", "bbbb", "cccc", "xxxx", "eeee"], 0.5),
        (" bbbb = cccc, dddd = eeee", ["aaaa", "bbbb", "cccc"], 0.5),  # a comma ends the chain
        (" bbbb = 'cccc' = dddd", ["aaaa", "bbbb", "cccc"], 0.5),  # a quoted hash ends it
        (" zzzz = cccc = dddd = 'eeee'", ["aaaa", "zzzz", "cccc", "dddd", "eeee"], 0.0),  # wrong first hop
        (" 12 % !", ["aaaa"], 0.0),
        ("", ["aaaa"], 0.0),
        (" = bbbb = cccc", ["aaaa", "bbbb", "cccc"], 0.5),  # leading "=" allowed
    ],
)
def test_parse_chain_and_score_by_hand(text, chain, value):
    pred = parse_chain(text, "aaaa")
    assert pred == chain
    assert score(pred, TARGET) == value


def test_score_counts_hops_after_h0_and_ignores_extra():
    assert score(["aaaa", "bbbb"], TARGET) == 0.25
    assert score(["aaaa", "bbbb", "cccc", "dddd", "eeee", "ffff"], TARGET) == 1.0
    assert score(["wrong", "bbbb"], TARGET) == 0.25  # h0 is given, never scored


def test_per_hop_accuracy_by_hand():
    # chains of 4 hops right through 0, 2 and 4 hops, and a 2-hop chain right through 1
    rows = [{"target": TARGET, "score": 0.0}, {"target": TARGET, "score": 0.5}, {"target": TARGET, "score": 1.0},
            {"target": TARGET[:3], "score": 0.5}]  # fmt: skip
    assert per_hop_accuracy(rows) == [3 / 4, 2 / 4, 1 / 3, 1 / 3]


def test_teacher_forced_targets_score_h_gq_one():
    samples = generate_samples(10, seed=3, hops=16, chars=2000)
    scores = [score(parse_chain(s["completion"], s["chain"][0]), s["chain"]) for s in samples]
    assert sum(scores) / len(scores) == 1.0
    assert format_completion(samples[0]["chain"]) == samples[0]["completion"]


# ------------------------------------------------------------------------------- rfkit data


def test_data_cli_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "hh.jsonl"
    code, stdout, err = run_cli(
        ["data", "hashhop", "--n", "3", "--out", str(out), "--hops", "3", "--chars", "500", "--seed", "4"], capsys
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and "3 samples" in stdout
    assert rows == json.loads(json.dumps(generate_samples(3, seed=4, hops=3, chars=500)))
    assert all(len(r["chain"]) == 4 and r["prompt"].endswith(f"{r['chain'][0]} =") for r in rows)


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--hops", "0"], "--hops: must be >= 1"),
        (["--n", "0"], "--n: must be >= 1"),
        (["--hash-len", "1"], "--hash-len: must be >= 2"),
        (["--chars", "0"], "--chars: must be >= 1"),
        (["--hops", "x"], "--hops"),
    ],
)
def test_data_cli_bad_input_is_one_line(tmp_path, capsys, extra, flag):
    code, _, err = run_cli(["data", "hashhop", "--n", "2", "--out", str(tmp_path / "a.jsonl"), *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and flag in err, err
    assert not (tmp_path / "a.jsonl").exists()


def test_data_cli_missing_directory(tmp_path, capsys):
    code, _, err = run_cli(["data", "hashhop", "--n", "2", "--out", str(tmp_path / "no" / "a.jsonl")], capsys)
    assert code == 2 and err.count("\n") == 1 and "--out: directory" in err


# ------------------------------------------------------------------------------- data module


def small_module(model_dir, corpus, **kw):
    args = {
        "source": str(corpus), "tokenizer": str(model_dir), "seq_len": 32, "batch_size": 2, "calibration_samples": 4,
        "val_blocks": 4, "split": (0.1, 0.1), "hops": 3, "chars": 300, "train_samples": 6, "val_samples": 3, "seed": 1,
    }  # fmt: skip
    args.update(kw)
    return HashHopDataModule(**args)


def test_data_module_labels_only_the_completion(tiny_model_dir, tiny_corpus):
    dm = small_module(tiny_model_dir, tiny_corpus)
    dm.setup("fit")
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    samples = generate_samples(6, seed=1, split="train", hops=3, chars=300)
    by_prompt = {tuple(tok(s["prompt"])["input_ids"]): s for s in samples}
    batches = list(dm.train_dataloader())
    assert len(batches) == 3
    seen = 0
    for batch in batches:
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert ids.shape == mask.shape == labels.shape and ids.shape[0] == 2
        assert mask.sum(1).max() == ids.shape[1]  # padded to the longest in the batch
        for row in range(2):
            n = int(mask[row].sum())
            assert mask[row, :n].all() and not mask[row, n:].any()  # right padding
            prompt_len = next(len(p) for p in by_prompt if ids[row, : len(p)].tolist() == list(p))
            s = by_prompt[tuple(ids[row, :prompt_len].tolist())]
            completion = tok(s["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert ids[row, prompt_len:n].tolist() == completion
            assert (labels[row, :prompt_len] == -100).all() and (labels[row, n:] == -100).all()
            assert labels[row, prompt_len:n].tolist() == completion
            assert tok.decode(completion[:-1]) == s["completion"]
            seen += 1
    assert seen == 6
    # shuffled deterministically by seed
    again = small_module(tiny_model_dir, tiny_corpus)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again.train_dataloader()))
    # calibration and validation stay on the parent's text blocks
    calib = next(iter(dm.calibration_dataloader()))
    assert set(calib) == {"input_ids"} and calib["input_ids"].shape[1] == 32
    assert next(iter(dm.val_dataloader()))["input_ids"].shape[1] == 32
    val = list(dm.hashhop_val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in val) == 3 and "labels" in val[0]
    info = dm.describe()
    assert info["hashhop"]["hops"] == 3 and info["seq_len"] == 32 and info["hashhop"]["train_tokens"] > 0
    assert dm.fingerprint() == small_module(tiny_model_dir, tiny_corpus, hops=5).fingerprint()


def test_data_module_mixes_settings_one_setting_per_batch(tiny_model_dir, tiny_corpus):
    """hops/chars as lists: the samples split evenly over the settings, each setting drawn from
    seed + j, and every training batch holds one setting only (no short sample padded long)."""
    kw = {"hops": [2, 3, 2], "chars": [200, 300, 400], "train_samples": 13, "val_samples": 4, "batch_size": 2}
    dm = small_module(tiny_model_dir, tiny_corpus, **kw)
    assert dm.settings() == [(2, 200), (3, 300), (2, 400)]
    dm.setup("fit")
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # 13 samples: 5 + 4 + 4; setting j draws split "train" from seed 1 + j
    setting_of = {}
    for j, (n, (hops, chars)) in enumerate(zip((5, 4, 4), dm.settings())):
        for s in generate_samples(n, seed=1 + j, split="train", hops=hops, chars=chars):
            setting_of[tuple(tok(s["prompt"])["input_ids"])] = j
    assert len(setting_of) == 13 and len(dm.hashhop_train) == 13
    batches = list(dm.train_dataloader())
    assert len(batches) == 2 + 2 + 2  # per setting floor(n / 2); the odd sample of setting 0 is dropped
    seen, order = [], []
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert ids.shape[0] == 2 and mask.sum(1).max() == ids.shape[1]
        settings = set()
        for row in range(2):
            prompt = next(p for p in setting_of if ids[row, : len(p)].tolist() == list(p))
            settings.add(setting_of[prompt])
            seen.append(prompt)
        assert len(settings) == 1  # one setting per batch
        order.append(settings.pop())
    assert len(set(seen)) == 12 and sorted(order) == [0, 0, 1, 1, 2, 2]
    assert order != sorted(order)  # the batches are shuffled, not setting after setting
    again = small_module(tiny_model_dir, tiny_corpus, **kw)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again.train_dataloader()))
    # a resumed run skips the batches it already trained on (the sampler counts whole batches)
    again.resume_at(0, 4)
    assert [b["input_ids"].tolist() for b in again.train_dataloader()] == [b["input_ids"].tolist() for b in batches[4:]]
    assert sum(b["input_ids"].shape[0] for b in dm.hashhop_val_dataloader()) == 4
    assert dm.describe()["hashhop"]["hops"] == [2, 3, 2]
    # one number is shared by every setting
    assert small_module(tiny_model_dir, tiny_corpus, hops=2, chars=[200, 300]).settings() == [(2, 200), (2, 300)]
    # a single setting keeps the plain loader (the samples and order of runs made before lists)
    single = small_module(tiny_model_dir, tiny_corpus, hops=[3], chars=300)
    plain = small_module(tiny_model_dir, tiny_corpus)
    assert [b["input_ids"].tolist() for b in single.train_dataloader()] == [b["input_ids"].tolist() for b in plain.train_dataloader()]


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"hops": [2, 0]}, "data.hops[1]: must be an integer >= 1"),
        ({"hops": []}, "data.hops: an empty list"),
        ({"hops": [2, 3], "chars": [200, 300, 400]}, "data.chars: 3 settings but data.hops has 2"),
        ({"hops": [2, 3, 2], "train_samples": 2}, "data.train_samples: must be >= the number of settings (3), got 2"),
        ({"hops": [2, 3], "chars": [300, 10**7], "hash_len": 2}, "data.hash_len: 2 letters give"),
    ],
)
def test_data_module_rejects_bad_mixed_settings(tiny_model_dir, tiny_corpus, kw, message):
    with pytest.raises(SourceError, match=re.escape(message)):
        small_module(tiny_model_dir, tiny_corpus, **kw)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"hops": 0}, "data.hops: must be an integer >= 1"),
        ({"chars": -1}, "data.chars: must be an integer >= 1"),
        ({"hash_len": 1}, "data.hash_len: must be >= 2"),
        ({"train_samples": 0}, "data.train_samples"),
        ({"seq_len": 1}, "data.seq_len"),  # the parent's checks still run
    ],
)
def test_data_module_rejects_bad_settings(tiny_model_dir, tiny_corpus, kw, message):
    with pytest.raises(SourceError, match=re.escape(message)):
        small_module(tiny_model_dir, tiny_corpus, **kw)


# ------------------------------------------------------------------------------- recipes


def test_the_two_hashhop_recipes_parse_and_train_the_same_way():
    """smollm2_hashhop_b05 (hybrid) and smollm2_hashhop_mamba_b05 (the paper's Mamba) differ only
    in the operator, its transfer and the run directory, so their h_gq compare like for like."""
    from rfkit.config.lightning_cli import make_cli
    from rfkit.operators import HybridOperator, MambaOperator

    parsed = {}
    for name in ("smollm2_hashhop_b05", "smollm2_hashhop_mamba_b05"):
        cli = make_cli(["--config", str(ROOT / "recipes" / f"{name}.yaml")], run=False, trainer_defaults={"logger": False, "enable_checkpointing": False})
        dm = cli.datamodule
        assert isinstance(dm, HashHopDataModule) and (dm.hops, dm.hash_len, dm.chars) == (2, 8, 512)
        assert cli.model.freeze == "none" and cli.model.policy.beta == 0.5
        assert cli.trainer.max_steps * dm.batch_size == dm.train_samples  # every sample seen once
        parsed[name] = cli
    assert isinstance(parsed["smollm2_hashhop_b05"].model.operator, HybridOperator)
    assert isinstance(parsed["smollm2_hashhop_mamba_b05"].model.operator, MambaOperator)

    hybrid, mamba = (yaml.safe_load((ROOT / "recipes" / f"{n}.yaml").read_text()) for n in parsed)
    assert hybrid["model"]["lr_scheduler"]["init_args"]["T_max"] == hybrid["trainer"]["max_steps"]
    for config in (hybrid, mamba):
        for key in ("operator", "transfer"):
            del config["model"][key]
        del config["trainer"]["default_root_dir"]
    assert hybrid == mamba


def test_the_long_hashhop_recipe_is_the_default_operator_on_the_longer_settings():
    """smollm2_hashhop_long_b05 (issue 26's HashHop at longer prompts) fine-tunes the same way as
    smollm2_hashhop_b05 but with the default recipe's operator and transfer, on the three settings."""
    from rfkit.config.lightning_cli import make_cli

    cli = make_cli(["--config", str(ROOT / "recipes" / "smollm2_hashhop_long_b05.yaml")], run=False, trainer_defaults={"logger": False, "enable_checkpointing": False})
    dm = cli.datamodule
    assert dm.settings() == [(2, 512), (4, 1024), (2, 2048)]
    samples_per_step = dm.batch_size * cli.trainer.accumulate_grad_batches
    assert samples_per_step == 4  # as smollm2_hashhop_b05, in two batches of 2 (memory)
    assert cli.trainer.max_steps * samples_per_step == dm.train_samples and dm.train_samples % (3 * dm.batch_size) == 0
    long, short, default = (yaml.safe_load((ROOT / "recipes" / f"{n}.yaml").read_text()) for n in ("smollm2_hashhop_long_b05", "smollm2_hashhop_b05", "smollm2_b05"))
    assert long["model"]["operator"] == default["model"]["operator"]
    assert long["model"]["transfer"] == default["model"]["transfer"]
    assert long["model"]["lr_scheduler"]["init_args"]["T_max"] == long["trainer"]["max_steps"]
    for config in (long, short):
        for key in ("operator", "transfer", "lr_scheduler"):
            del config["model"][key]
        for key in ("hops", "chars", "train_samples", "val_samples", "batch_size"):
            del config["data"]["init_args"][key]
        for key in ("default_root_dir", "max_steps", "val_check_interval", "accumulate_grad_batches"):
            config["trainer"].pop(key, None)
    assert long == short  # policy, freezing, optimiser and the rest: the same fine-tune


# ------------------------------------------------------------------------------- evaluation


@pytest.mark.slow
def test_evaluate_hashhop_on_a_tiny_random_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    samples = generate_samples(3, hops=2, chars=200)
    result = evaluate_hashhop(model, tok, samples, batch_size=2, max_new_tokens=6)
    assert 0.0 <= result["h_gq"] <= 1.0 and result["n"] == 3 and result["max_new_tokens"] == 6
    for row, s in zip(result["samples"], samples):
        assert row["target"] == s["chain"] and row["prediction"][0] == s["chain"][0]
        assert row["score"] == score(row["prediction"], row["target"])
        assert isinstance(row["text"], str)
    assert result["h_gq"] == pytest.approx(sum(r["score"] for r in result["samples"]) / 3)


@pytest.mark.slow
def test_fit_on_hashhop_then_eval_cli_on_the_saved_model(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """The recipe's data section trains on HashHop (tiny overrides), the fit saves the model,
    and ``rfkit eval hashhop`` scores it, generated and from a ``rfkit data`` file."""
    root = tmp_path / "run"
    code, _, err = run_cli(
        ["fit", "--config", RECIPE, "--model.base_model", str(tiny_model_dir),
         "--model.policy.init_args.window", "4", "--data.source", str(tiny_corpus), "--data.seq_len", "32",
         "--data.batch_size", "2", "--data.calibration_samples", "4", "--data.val_blocks", "4",
         "--data.split", "[0.1, 0.1]", "--data.hops", "2", "--data.chars", "200", "--data.train_samples", "4",
         "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(root),
         "--trainer.enable_progress_bar", "false"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(next(root.rglob("summary.json")).read_text())
    assert summary["train_tokens"] > 2 * 2 * 60  # two batches of two ~90-token HashHop samples, not 32-token blocks
    model_dir = next(root.rglob("model"))
    assert (model_dir / "head_map.json").exists()

    out = tmp_path / "hh.json"
    code, stdout, err = run_cli(
        ["eval", "hashhop", "--model", str(model_dir), "--samples", "2", "--hops", "2", "--chars", "200",
         "--max-new-tokens", "5", "--batch-size", "2", "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert 0.0 <= result["h_gq"] <= 1.0 and len(result["samples"]) == 2
    assert result["original"] is False and result["converted"] is True and result["hops"] == [2]
    assert set(result["samples"][0]) >= {"prediction", "target", "score"}
    assert "h_gq" in stdout and str(model_dir) in stdout

    data = tmp_path / "test.jsonl"
    assert run_cli(["data", "hashhop", "--n", "3", "--hops", "2", "--chars", "200", "--out", str(data)], capsys)[0] == 0
    code, _, err = run_cli(
        ["eval", "hashhop", "--model", str(model_dir), "--original", "--data", str(data), "--json", str(out)], capsys
    )
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["original"] is True and result["n"] == 3 and result["data"] == str(data)
    assert [r["target"] for r in result["samples"]] == [json.loads(x)["chain"] for x in data.read_text().splitlines()]


@pytest.fixture
def weightless_dir(tiny_model_dir, tmp_path):
    """The tiny model's config and tokenizer without weights: any attempt to load it fails."""
    path = tmp_path / "noweights"
    path.mkdir()
    for f in tiny_model_dir.iterdir():
        if not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, path / f.name)
    return path


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--chars", "1024", "--hops", "4"], "--chars: a prompt of 1024 characters is up to"),  # context 256 of the tiny model
        (["--samples", "0"], "--samples: must be >= 1"),
        (["--hops", "0"], "--hops: must be >= 1"),
        (["--data", "/nonexistent/hh.jsonl"], "--data: file"),
        (["--batch-size", "0"], "--batch-size: must be >= 1"),
    ],
)
def test_eval_cli_bad_input_is_one_line_before_loading(weightless_dir, tmp_path, capsys, extra, message):
    code, _, err = run_cli(
        ["eval", "hashhop", "--model", str(weightless_dir), "--json", str(tmp_path / "o.json"), *extra], capsys
    )
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert "max_position_embeddings 256" in err or "--chars" not in message


def test_eval_cli_rejects_a_file_that_is_not_hashhop(weightless_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n')
    code, _, err = run_cli(["eval", "hashhop", "--model", str(weightless_dir), "--data", str(bad)], capsys)
    assert code == 2 and err.count("\n") == 1 and "line 1 is not a HashHop sample" in err
    bad.write_text("{oops\n")
    code, _, err = run_cli(["eval", "hashhop", "--model", str(weightless_dir), "--data", str(bad)], capsys)
    assert code == 2 and "line 1 is not valid JSON" in err
