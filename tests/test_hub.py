"""What rfkit.hub reads once and keeps: a tokenizer's size per file, the embedded model's licence in
its dequantised copy's card."""

import json

from rfkit import hub


def test_tokenizer_size_is_read_again_when_the_file_changes(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    assert hub.tokenizer_size(tmp_path) == 2
    assert hub.tokenizer_size(tmp_path) == 2  # kept
    path.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": [{"id": 9}]}))
    assert hub.tokenizer_size(tmp_path) == 10  # a new size and time: read again
    path.unlink()
    assert hub.tokenizer_size(tmp_path) is None


def test_the_embedded_licence_is_read_from_the_gguf_once_into_the_copys_card(tmp_path, monkeypatch):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path))
    reads = []
    monkeypatch.setattr(hub, "_gguf_license", lambda: reads.append(1) or "apache-2.0")
    copy = hub.embedded_model_dir()
    assert hub.model_license(hub.EMBEDDED_MODEL) == "apache-2.0" and reads == [1]  # no copy yet: the GGUF
    assert not copy.exists()  # nothing written where no copy is
    copy.mkdir(parents=True)
    (copy / "config.json").write_text("{}")  # a copy dequantised before copies had a card
    assert hub.model_license(hub.EMBEDDED_MODEL) == "apache-2.0" and reads == [1, 1]
    card = (copy / "README.md").read_text()
    assert card.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\nlicense: apache-2.0\n---\n")
    assert hub.model_license(hub.EMBEDDED_MODEL) == "apache-2.0" and reads == [1, 1]  # from the card now
