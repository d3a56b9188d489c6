"""What rfkit.hub reads once and keeps: a tokenizer's size per file, the embedded model's licence in
its dequantised copy's card, one parse of the GGUF for the whole dequantising."""

import json

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def _tiny_llama_gguf(path):
    """A whole Llama GGUF (a 29-token GPT-2 style vocabulary, one layer of width 8, float32 tensors,
    a licence field): what transformers needs to build a tokenizer and a model from it."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_license("mit")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens = ["<|endoftext|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120", "ab"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (len(tokens), 8), "output_norm": (8,), "blk.0.attn_norm": (8,), "blk.0.ffn_norm": (8,),
              "blk.0.attn_q": (8, 8), "blk.0.attn_k": (4, 8), "blk.0.attn_v": (4, 8), "blk.0.attn_output": (8, 8),
              "blk.0.ffn_gate": (16, 8), "blk.0.ffn_up": (16, 8), "blk.0.ffn_down": (8, 16)}  # fmt: skip
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_dequantising_parses_the_gguf_once(tmp_path, monkeypatch):
    """transformers parses the GGUF for the tokenizer, the config and the weights, and the card reads
    its licence from it: four parses of every field (42.7 s against 24.2 s for the embedded file), one now.
    transformers also builds gguf's tensor-name map once per module of the model (25.0 s against
    15.9 s with one map): one now. The copy is the whole model all the same, and the reader and the
    name map are gguf's own again afterwards."""
    source = tmp_path / "package" / "tiny.gguf"
    source.parent.mkdir()
    _tiny_llama_gguf(source)
    monkeypatch.setattr(hub, "embedded_gguf", lambda: source)
    monkeypatch.chdir(tmp_path)  # not the GGUF's folder: transformers looks for gguf_file in the working folder first
    reader_class, parses = gguf.GGUFReader, []
    init = reader_class.__init__

    def counting(self, path, *a, **k):
        parses.append(path)
        init(self, path, *a, **k)

    monkeypatch.setattr(reader_class, "__init__", counting)
    build_map, maps = gguf.get_tensor_name_map, []

    def counting_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return build_map(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)

    hub._materialise_embedded_model(tmp_path / "copy")
    assert len(parses) == 1
    assert gguf.GGUFReader is reader_class
    reader_class(source)
    assert len(parses) == 2  # outside the dequantising a reader parses again
    # one name map for every module of the model (transformers asks at each: 20 in this one),
    # and gguf's own function again afterwards
    assert len(maps) == 1 and maps[0][1] == 1
    assert gguf.get_tensor_name_map is counting_map

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "copy"))
    direct = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    for (name, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(str(tmp_path / "copy"))("ab a").input_ids == [28, 27, 1]
    assert "license: mit" in (tmp_path / "copy" / "README.md").read_text()
