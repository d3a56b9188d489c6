"""Head maps as artifacts: provenance, FromHeadMap (file / URL), model cards, resolved configs."""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import SMOLLM, run_cli, tiny_args, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

import rfkit.conversion.convert
import rfkit.conversion.policies
import rfkit.training.module  # noqa: F401  (bound to rfkit.conversion.convert's functions before any test patches them)
from rfkit.conversion.convert import build_head_map, fingerprint_model
from rfkit.conversion.headmap import HeadMap, config_sha256, head_map_cache_path
from rfkit.conversion.model_card import model_card
from rfkit.conversion.policies import ExplicitHeads, FromHeadMap
from rfkit.errors import RFKitError
from rfkit.models.layout import AttentionLayout, LayoutError

SELECTED = [[0, 1], [2, 3]]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("rfkit: error:")]


def policy_arg(path) -> list[str]:
    return ["--model.policy", json.dumps({"class_path": "rfkit.conversion.policies.FromHeadMap", "init_args": {"path": str(path)}})]


def tiny_head_map(name: str = "tiny", selected=SELECTED, **fields) -> HeadMap:
    model = tiny_model("llama")
    layout = AttentionLayout.from_config(model.config)
    head_map = HeadMap.build(name, layout, None, selected, ExplicitHeads(selected), {}, fingerprint_model(model, name))
    for key, value in fields.items():
        setattr(head_map, key, value)
    return head_map


@pytest.fixture
def no_profiling(monkeypatch):
    """Fail the test if a calibration profile is computed or read from the profile cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("a calibration profile was computed or loaded")

    monkeypatch.setattr(rfkit.conversion.policies, "profile_heads", refuse)  # what make_profile calls
    monkeypatch.setattr(rfkit.conversion.convert, "load_profile", refuse)


# -- fingerprints ---------------------------------------------------------------------------------


def test_fingerprint_is_stable_and_follows_config_and_weights(tiny_model_dir, tmp_path):
    a = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    b = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager")
    fp = fingerprint_model(a, str(tiny_model_dir))
    assert fp == fingerprint_model(b, str(tiny_model_dir))  # the attention implementation is not the model
    assert len(fp["config_sha256"]) == 64 and len(fp["weights"]) == 64

    # the same config built in memory (no _name_or_path, transformers_version, architectures, dtype)
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    fresh = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "dtype")})
    assert config_sha256(fresh) == fp["config_sha256"]
    fresh.rf_selected = [[0], []]  # rf_* keys are conversion state, not the model
    assert config_sha256(fresh) == fp["config_sha256"]
    fresh.rms_norm_eps = 1e-5
    assert config_sha256(fresh) != fp["config_sha256"]

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last MiB is hashed
    weights.write_bytes(bytes(data))
    changed = fingerprint_model(a, str(other))
    assert changed["config_sha256"] == fp["config_sha256"] and changed["weights"] != fp["weights"]
    assert fingerprint_model(tiny_model("llama"), "no-such-org/no-such-model")["weights"] is None


def test_head_maps_without_provenance_still_load(tmp_path):
    old = {"model": "m", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "window": 4, "alpha": 0.5, "beta": 0.5,
           "exclude_first_token": True, "seq_len": 32, "samples": 4, "rai": [], "rr_mean": [], "selected": SELECTED,
           "policy": {"class_path": "x.Y"}, "data": {}, "rfkit_version": "0.0.1"}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    head_map = HeadMap.load(tmp_path / "old.json")
    assert head_map.model_fingerprint is None and head_map.created is None and head_map.source is None
    new = tiny_head_map()
    assert new.created.endswith("+00:00") and new.model_fingerprint["weights"] is None  # an in-memory model


# -- FromHeadMap -----------------------------------------------------------------------------------


def test_from_head_map_file_reproduces_the_selection_and_keeps_provenance(tmp_path, caplog, no_profiling):
    made = tiny_head_map(rai=[[3, 1, 0, 2], [0, 0, 4, 4]], window=4, samples=4, data={"source": "docs.jsonl"})
    made.save(tmp_path / "hm.json")
    policy = FromHeadMap(str(tmp_path / "hm.json"))
    assert policy.beta == 0.5 and policy.profile_settings() is None and not policy.needs_profile
    assert policy.describe()["path"] == str(tmp_path / "hm.json")

    with caplog.at_level(logging.WARNING, logger="rfkit.conversion.convert"):
        same = build_head_map(tiny_model("llama"), "tiny", policy)
    assert not caplog.records
    assert same.selected == SELECTED and same.rai == made.rai and same.window == 4 and same.samples == 4
    assert same.policy == made.policy and same.data == made.data and same.created == made.created
    assert same.model_fingerprint == made.model_fingerprint
    sha = hashlib.sha256((tmp_path / "hm.json").read_bytes()).hexdigest()
    assert same.source == {"path": str((tmp_path / "hm.json").resolve()), "sha256": sha, "model": "tiny"}

    # another model of the same shape: used, with a warning
    with caplog.at_level(logging.WARNING, logger="rfkit.conversion.convert"):
        other = build_head_map(tiny_model("mistral"), "tiny-mistral", policy)
    assert other.selected == SELECTED and other.model == "tiny-mistral"
    assert any("differs" in r.getMessage() and "layout matches" in r.getMessage() for r in caplog.records)

    with pytest.raises(LayoutError) as err:
        build_head_map(tiny_model("llama", num_heads=8, num_kv_heads=4), "wide", policy)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.policy.path: the head map is for (layers, heads, kv_heads) = (2, 4, 2)")
    assert "hm.json" in message and message.endswith("this model has (2, 8, 4)")


@pytest.mark.parametrize(
    "content, detail",
    [
        ("{not json", "not JSON"),
        ('{"num_layers": 2, "num_heads": 4}', "missing num_kv_heads, selected"),
        ('{"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "selected": [[0], [9]]}', "selected[1]"),
        ("[1, 2]", "not an object"),
    ],
)
def test_a_file_that_is_not_a_head_map_is_one_line(tmp_path, content, detail):
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(RFKitError) as err:
        FromHeadMap(str(tmp_path / "bad.json"))
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.policy.path: ") and "is not a head map" in message
    assert detail in message


class _Server:
    def __init__(self, root: Path):
        self.requests: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self):
                server.requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


@contextmanager
def serve(root: Path):
    server = _Server(root)
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def test_from_head_map_downloads_a_url_once(tmp_path, monkeypatch, no_profiling):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "www").mkdir()
    tiny_head_map().save(tmp_path / "www" / "hm.json")
    (tmp_path / "www" / "page.html").write_text("<html>not a head map</html>")
    with serve(tmp_path / "www") as server:
        url = f"{server.url}/hm.json"
        policy = FromHeadMap(url)
        assert policy.head_map.selected == SELECTED
        cached = head_map_cache_path(url)
        assert cached.parent == tmp_path / "cache" / "head_maps"
        assert cached.read_bytes() == (tmp_path / "www" / "hm.json").read_bytes()
        FromHeadMap(url)  # from the cache
        assert server.requests == ["/hm.json"]

        with pytest.raises(RFKitError) as err:
            FromHeadMap(f"{server.url}/missing.json")
        assert str(err.value) == f"model.policy.path: cannot download {server.url}/missing.json: HTTP 404 File not found"
        with pytest.raises(RFKitError) as err:
            FromHeadMap(f"{server.url}/page.html")
        assert "is not a head map" in str(err.value) and "\n" not in str(err.value)
        assert not head_map_cache_path(f"{server.url}/page.html").exists()  # a bad download is not cached
    head_map = build_head_map(tiny_model("llama"), "tiny", policy)
    sha = hashlib.sha256((tmp_path / "www" / "hm.json").read_bytes()).hexdigest()
    assert head_map.source == {"url": url, "sha256": sha, "model": "tiny"} and head_map.selected == SELECTED

    dead = f"{server.url}/hm2.json"  # the server is gone
    with pytest.raises(RFKitError) as err:
        FromHeadMap(dead)
    message = str(err.value)
    assert message.startswith(f"model.policy.path: cannot download {dead}: ") and "\n" not in message
    assert FromHeadMap(url).head_map.selected == SELECTED  # downloaded once: no server needed


def test_from_head_map_reads_file_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    tiny_head_map().save(tmp_path / "hm.json")
    url = (tmp_path / "hm.json").as_uri()
    assert FromHeadMap(url).source["url"] == url and head_map_cache_path(url).exists()


# -- through the CLI -------------------------------------------------------------------------------


@pytest.mark.slow
def test_missing_head_map_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rfkit.conversion.convert, "load_base_model", no_loading)
    missing = tmp_path / "nowhere" / "head_map.json"
    code, out, err = run_cli(["fit", "--config", SMOLLM, *policy_arg(missing)], capsys)
    assert code == 2 and "Traceback" not in err
    assert error_lines(err) == [
        f"rfkit: error: model.policy.path: '{missing}' does not exist; "
        "allowed: a head_map.json file or an http(s):// or file:// URL"
    ]
    (tmp_path / "bad.json").write_text("{")
    code, out, err = run_cli(["convert", "--config", SMOLLM, *policy_arg(tmp_path / "bad.json")], capsys)
    assert code == 2 and len(error_lines(err)) == 1 and "is not a head map: not JSON" in err


@pytest.mark.slow
def test_a_head_map_for_another_model_exits_2_with_one_line(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    wrong = tmp_path / "big.json"
    layout = AttentionLayout("llama", 30, 9, 3, 64, 576)
    HeadMap.build("big-model", layout, None, [[0, 1, 2]] + [[]] * 29, ExplicitHeads([[0, 1, 2]]), {}).save(wrong)
    args = tiny_args(tiny_model_dir, tiny_corpus, tmp_path)
    code, out, err = run_cli(["convert", *args, *policy_arg(wrong), "--output", str(tmp_path / "x")], capsys)
    assert code == 2 and "Traceback" not in err
    assert error_lines(err) == [
        f"rfkit: error: model.policy.path: the head map is for (layers, heads, kv_heads) = (30, 9, 3) "
        f"('{wrong}', made for big-model); this model has (2, 4, 2)"
    ]
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_profile_then_convert_from_the_map_without_profiling(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch):
    args = tiny_args(tiny_model_dir, tiny_corpus, tmp_path)
    made = tmp_path / "made"
    code, out, err = run_cli(["profile", *args, "--output", str(made / "head_map.json"), "--report", "false"], capsys)
    assert code == 0, err
    source = HeadMap.load(made / "head_map.json")
    assert source.model_fingerprint["weights"] and source.created and source.source is None
    entropy = [e for layer in source.entropy_mean for e in layer]  # the profile's entropy travels with the map
    assert len(source.entropy_mean) == 2 and len(entropy) == 8 and all(0.0 <= e <= 1.0 for e in entropy)
    config = (made / "config.yaml").read_text()  # the resolved recipe beside the map
    assert "RecencyRatioPolicy" in config and "window: 4" in config and str(tiny_corpus) in config

    def refuse(*a, **k):
        raise AssertionError("a calibration profile was computed or loaded")

    monkeypatch.setattr(rfkit.conversion.policies, "profile_heads", refuse)  # what make_profile calls
    monkeypatch.setattr(rfkit.conversion.convert, "load_profile", refuse)
    sha = hashlib.sha256((made / "head_map.json").read_bytes()).hexdigest()
    ways = {"policy": policy_arg(made / "head_map.json"), "arg": ["--model.head_map", str(made / "head_map.json")]}
    for name, extra in ways.items():
        out_dir = tmp_path / name
        code, out, err = run_cli(["convert", *args, *extra, "--output", str(out_dir)], capsys)
        assert code == 0, err
        used = HeadMap.load(out_dir / "head_map.json")
        assert used.selected == source.selected and used.rai == source.rai and used.rr_mean == source.rr_mean
        assert used.entropy_mean == source.entropy_mean
        assert (used.policy, used.data, used.model_fingerprint) == (source.policy, source.data, source.model_fingerprint)
        assert used.source == {"path": str((made / "head_map.json").resolve()), "sha256": sha, "model": str(tiny_model_dir)}
        converted = AutoModelForCausalLM.from_pretrained(str(out_dir))
        assert converted.config.rf_selected == source.selected
        card = (out_dir / "README.md").read_text()
        assert card.startswith("---\nlibrary_name: transformers\ntags: [rfkit, recurformer, hybrid, custom_code]\n---\n")
        assert "trust_remote_code=True" in card and (out_dir / "modeling_rfkit.py").is_file()  # loads without rfkit
        assert "- Replaced query heads: 4 of 8 (50.0%)" in card and "- Replaced KV groups" in card
        assert f"sha256 `{sha}`" in card
        # rfkit convert measures the original's perplexity and both caches, not the converted
        # model's perplexity (that is rfkit fit's): the card says so rather than inventing it
        results = card.split("## Measured results", 1)[1].split("##", 1)[0]
        assert "| KV cache bytes per token | 512 | 256 | 0.5000 |" in results and "- Parameters added: " in results
        assert [line for line in results.splitlines() if "perplexity" in line][0].endswith("| not measured | not measured |")
        config = (out_dir / "config.yaml").read_text()
        assert config in card  # the recipe section
        assert ("FromHeadMap" in config) == (name == "policy")
    assert converted(torch.randint(0, 100, (1, 8))).logits.shape[:2] == (1, 8)
    # rfkit profile takes the map the same two ways as rfkit convert: no profile, the same heads
    for name, extra in ways.items():
        again = tmp_path / f"profile_{name}" / "head_map.json"
        code, out, err = run_cli(["profile", *args, *extra, "--output", str(again), "--report", "false"], capsys)
        assert code == 0, err
        kept = HeadMap.load(again)
        assert kept.selected == source.selected and kept.rr_mean == source.rr_mean
        assert kept.source == {"path": str((made / "head_map.json").resolve()), "sha256": sha, "model": str(tiny_model_dir)}


@pytest.mark.slow
def test_fit_model_card_reports_the_summary(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    code, out, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path)], capsys)
    assert code == 0, err
    summary_path = next(tmp_path.rglob("summary.json"))
    summary = json.loads(summary_path.read_text())
    run = summary_path.parent
    card = (run / "model" / "README.md").read_text()
    ppl = summary["ppl_original"], summary["ppl_converted"], summary["ppl_ratio"]
    assert f"| validation perplexity | {ppl[0]:.4f} | {ppl[1]:.4f} | {ppl[2]:.4f} |" in card
    cache = summary["cache_bytes_per_token_original"], summary["cache_bytes_per_token_converted"]
    assert f"| KV cache bytes per token | {round(cache[0]):,} | {round(cache[1]):,} | {summary['cache_ratio']:.4f} |" in card
    assert f"- Parameters added: {summary['params_added']:,}; removed: {summary['params_removed']:,}" in card
    assert (run / "model" / "config.yaml").read_text() == (run / "config.yaml").read_text()
    assert "## Recipe" in card and "RecencyRatioPolicy" in card
    head_map = HeadMap.load(run / "head_map.json")
    assert head_map.model_fingerprint["config_sha256"] in card


# -- the model card --------------------------------------------------------------------------------


def test_model_card_front_matter_and_partial_metrics():
    card = model_card(tiny_head_map("HuggingFaceTB/SmolLM2-135M"), metrics={"ppl_original": 12.5, "ppl_ratio": None})
    front = "---\nlibrary_name: rfkit\nbase_model: HuggingFaceTB/SmolLM2-135M\ntags: [rfkit, recurformer, hybrid]\n---\n"
    assert card.startswith(front)
    assert "| validation perplexity | 12.5000 | not measured | not measured |" in card
    assert "KV cache bytes" not in card and "Parameters added" not in card and "## Recipe" not in card
    assert "import rfkit" in card and "AutoModelForCausalLM.from_pretrained(" in card
    local = model_card(tiny_head_map("/models/tiny"))
    assert "base_model" not in local and "Not measured." in local
    assert "| query heads (of 4) | 2 | 2 |" in local and "| KV groups (of 2) | 1 | 1 |" in local
    assert "```yaml\na: 1\n```" in model_card(tiny_head_map(), config_text="a: 1\n")
