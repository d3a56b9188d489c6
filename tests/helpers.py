"""What the tests share: tiny random models (2 layers, width 64), the in-process CLI runner, forked
children where a test needs a process of its own, the overrides that run a SmolLM2 recipe on
them, packing Q/K/V as a mixer's input, and a window mixer's training step through its two paths.

Imported by name (``from helpers import run_cli``): pytest puts tests/ on sys.path (rootdir
conftest, prepend import mode). Fixtures live in conftest.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import rfkit  # noqa: F401  (registers the converted model types)
from rfkit.cli import main

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
)


def tiny_model(family: str = "llama", num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(TINY, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw, use_sliding_window=False))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw, sliding_window=None))
    else:
        raise ValueError(family)
    return model.eval()


def random_ids(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=g)


ROOT = Path(__file__).resolve().parents[1]
# MQAR recipes are `rfkit eval mqar` configs (tested in test_mqar.py), not LightningCLI fit recipes
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("mqar"))
SMOLLM = str(ROOT / "recipes" / "smollm2_b05.yaml")
MAMBA = str(ROOT / "recipes" / "smollm2_mamba_b05.yaml")  # the paper's Mamba-only operator


def parse_recipe(name: str, monkeypatch):
    """Recipe ``name`` (a file in recipes/, without ``.yaml``) as ``rfkit fit --config NAME``
    parses it (class paths imported and typed), without instantiating anything: a GPU recipe's
    FSDPStrategy refuses this machine's CPU accelerator. Returns the parsed config namespace."""
    import rfkit.config.lightning_cli

    class ParseOnly(rfkit.config.lightning_cli.RFKitCLI):
        def instantiate_classes(self):
            pass

        def after_instantiate_classes(self):
            pass

    monkeypatch.setattr(rfkit.config.lightning_cli, "RFKitCLI", ParseOnly)  # make_cli builds the CLI class it finds here
    return rfkit.config.lightning_cli.make_cli(["--config", str(ROOT / "recipes" / f"{name}.yaml")], run=False).config


def run_cli(args, capsys):
    """Run ``rfkit`` in process; returns (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def run_in_process(args, cache) -> None:
    """``rfkit ARGS`` in this process with ``RFKIT_CACHE=cache``, for module-scoped fixtures and
    runs whose output is not read (no interpreter start-up: a few seconds saved per run); fails
    the test on a non-zero exit. A run in process ends exactly where one in a fresh interpreter
    ends (tests/training/test_faults.py compares the weights bit for bit)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RFKIT_CACHE", str(cache))
        try:
            main(list(args))
        except SystemExit as exit:
            assert exit.code in (0, None), f"rfkit {args[0]} exited with {exit.code}"


def forked(fn, *args, env: dict | None = None, stdout: Path | None = None, stderr: Path | None = None,
           watchdog: float | None = None):
    """``fn(*args)`` in a forked child of this process, started: a process of its own (a test can
    ``kill -9`` it, and nothing it imports reaches this one) without the interpreter start of a
    fresh one (torch, transformers and Lightning take 10-12 s to import on the 2-core CI machine;
    the child has them already). ``env`` is set in the child only. With ``stdout`` the child
    writes its output there (and its errors to ``stderr``, default the same file), its logging
    set up afresh as in a new process. Returns the ``multiprocessing.Process``: ``.pid``,
    ``.join()``, ``.exitcode`` (``-9`` after a kill, the code of a ``SystemExit``, 1 after an
    exception). After ``watchdog`` seconds a child still running writes every thread's Python stack
    to its stderr and exits 1 (a hang shows where, not just that). Not for what needs a fresh
    interpreter: the real console script, an environment read at import, and Lightning's DDP
    launch (it runs ``sys.argv`` again)."""
    import gc
    import multiprocessing

    # Garbage that earlier tests left in cycles dies here, where its threads are: collected in the
    # child instead, a Gloo process group's destructor waited forever on worker threads a fork
    # does not copy (gdb: ~ProcessGroupGloo in pthread_cond_broadcast, from the child's GC).
    gc.collect()
    streams = (stdout, stderr or stdout)
    context = multiprocessing.get_context("fork")
    proc = context.Process(target=_run_forked, args=(fn, args, env or {}, streams, watchdog), daemon=True)
    proc.start()
    return proc


def _run_forked(fn, args, env, streams, watchdog) -> None:
    import faulthandler
    import gc
    import logging

    gc.freeze()  # and what the parent still holds is never collected here: its destructors belong there

    os.environ.update(env)
    if streams[0] is not None:
        out = open(streams[0], "a", buffering=1)  # noqa: SIM115  (the child's streams until it exits)
        err = out if streams[1] == streams[0] else open(streams[1], "a", buffering=1)  # noqa: SIM115
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = out, err
        logging.getLogger().handlers.clear()  # pytest's capture handlers: rfkit sets up its own, on these streams
    if watchdog is not None:  # a child that hangs writes every thread's stack to its stderr and exits
        faulthandler.dump_traceback_later(watchdog, exit=True, file=sys.stderr)
    fn(*args)


def forked_run(fn, *args, env: dict | None = None, timeout: float = 300):
    """``fn(*args)`` in a forked child (:func:`forked`), waited for: ``CompletedProcess`` with the
    child's exit code and what it wrote to stdout and stderr."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as logs:
        out, err = Path(logs, "stdout"), Path(logs, "stderr")
        proc = forked(fn, *args, env=env, stdout=out, stderr=err, watchdog=max(timeout - 10, 1))
        proc.join(timeout)
        name = getattr(fn, "__name__", str(fn))
        if proc.is_alive():
            proc.kill()
            pytest.fail(f"{name} did not finish within {timeout} s:\n{err.read_text()[-3000:]}")
        return subprocess.CompletedProcess(name, proc.exitcode, out.read_text(), err.read_text())


def tiny_args(model_dir, corpus, root, recipe=SMOLLM):
    """Overrides that run a SmolLM2 recipe's code paths (default: the default recipe's) on the
    tiny model and corpus. A recipe's ``model.dtype: auto`` is pinned to float32 here, so that
    hand-computed bytes and scores are the same on every CPU; the recipe's own choice runs in
    ``test_recipe_dry_runs.py``, ``test_integration.py`` and ``training/test_precision_choice.py``."""
    model = yaml.safe_load(Path(recipe).read_text()).get("model") or {}
    pin = ["--model.dtype", "float32"] if model.get("dtype") == "auto" else []
    return [
        "--config", recipe,
        *pin,
        *sweep_overrides(model_dir, corpus),
        "--trainer.default_root_dir", str(root),
        "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2",
        "--trainer.enable_progress_bar", "false",
        "--model.transfer.steps", "5",
        # the default recipe's long blocks, from the tiny corpus at the tiny model's scale
        "--model.transfer.long_source", str(corpus),
        "--model.transfer.long_seq_len", "64",
        "--model.transfer.long_samples", "2",
        *_long_mix(recipe, corpus),
    ]  # fmt: skip


def _long_mix(recipe, corpus) -> list[str]:
    """The recipe's long blocks in training (``data.long_source``), from the tiny corpus at the
    tiny model's scale, one after every short batch so a 2-step fit takes one; nothing for a
    recipe without them."""
    data = yaml.safe_load(Path(recipe).read_text()).get("data") or {}
    if not data.get("long_source"):
        return []
    return ["--data.long_source", str(corpus), "--data.long_seq_len", "96", "--data.long_every", "1"]


def packed(q, k, v):
    B, _, L, _ = q.shape
    flat = lambda t: t.transpose(1, 2).reshape(B, L, -1)  # noqa: E731
    return torch.cat([flat(q), flat(k), flat(v)], -1)


def train_both_paths(block, q, k, v, state=(), mask=None, window=None) -> list[dict]:
    """A training forward and backward of a window mixer through its tiled path, then through the
    general rank-masked path (``fast = False``), both at the drawn ``window`` (default: the
    block's). One loss reads the output and the next state (fixed random weights); each run gives
    ``{name: tensor}``: ``out`` and ``state.i`` (the next state), ``grad.q``, ``grad.k``,
    ``grad.v``, ``grad.state.i`` (the incoming state's floating tensors) and ``grad.<parameter>``.
    The tiled run must not reach the general path."""
    block.train()
    block.train_window = lambda: block.window if window is None else window  # the draw, forced
    runs = []
    try:
        for fast in (True, False):
            block.fast = fast
            block.zero_grad(set_to_none=True)
            leaves = {"q": q, "k": k, "v": v, **{f"state.{i}": t for i, t in enumerate(state) if t.is_floating_point()}}
            leaves = {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}
            given = tuple(leaves.get(f"state.{i}", t) for i, t in enumerate(state))
            if fast:  # the tiled run must not fall back on the reference
                block._general = lambda *a, **kw: pytest.fail("the training forward took the general path")
            try:
                out, new = block.attend(leaves["q"], leaves["k"], leaves["v"], *given, return_states=True, mask=mask)
            finally:
                block.__dict__.pop("_general", None)
            result = {"out": out, **{f"state.{i}": t for i, t in enumerate(new)}}
            g = torch.Generator().manual_seed(0)
            read = [t for t in result.values() if t.is_floating_point()]
            loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in read)
            loss.backward()
            result.update({f"grad.{name}": t.grad for name, t in leaves.items()})
            result.update({f"grad.{name}": p.grad for name, p in block.named_parameters()})
            runs.append(result)
    finally:
        del block.fast, block.train_window
    return runs


def assert_runs_equal(tiled: dict, general: dict, tol: float = 1e-9) -> None:
    """The two runs of :func:`train_both_paths` agree on every entry (a missing gradient too)."""
    assert tiled.keys() == general.keys()
    for name, got in tiled.items():
        want = general[name]
        assert (got is None) == (want is None), name
        if got is not None:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


def prefill_then_steps(model, ids, prefix: int = 7):
    """Logits of a full forward, and of a ``prefix``-token prefill followed by one-token cached
    steps (concatenated), plus the cache those steps leave: what step-decoding tests compare."""
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :prefix], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(prefix, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    return full, torch.cat(steps, 1), cache


def converted_tiny(operator, dtype=torch.float64, layers=((0, 1), (2, 3))):
    """A tiny Llama with heads ``layers`` (by default [0, 1] of layer 0 and [2, 3] of layer 1)
    replaced by ``operator``, in ``dtype``, eval mode, every hybrid gate at 0.8 (open, so the
    state counts)."""
    from rfkit.models.hybrid import HybridWindowAttention
    from rfkit.models.modeling import to_recurformer

    model = to_recurformer(tiny_model("llama"), [list(h) for h in layers], operator).to(dtype).eval()
    for m in model.modules():
        if isinstance(m, HybridWindowAttention):
            with torch.no_grad():
                m.gate.fill_(0.8)
    return model


def left_padded_ids(length: int = 20, pad: int = 6, seed: int = 4):
    """Two rows of ``length`` random ids and their mask, the second row's first ``pad`` masked."""
    ids = random_ids(2, length, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def decode_alike_on_two_backends(model, backends, choose, served, length: int, prefix: int, new_tokens: int, tol: float):
    """Run ``model`` on each of ``backends`` (``choose(name)`` selects one; ``served()`` counts the
    calls of the first, the one under test, the second being the reference): cached steps after a
    ``prefix``-token prefill give the full forward's logits on each, the first served and the
    second did not, and greedy ``generate`` on a left-padded batch picks the same tokens with
    the same logits on both (within ``tol``)."""
    ids, mask = left_padded_ids(length)
    results = []
    for backend in backends:
        choose(backend)
        before = served()
        full, steps, _ = prefill_then_steps(model, ids, prefix=prefix)
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            logits = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(steps, full, rtol=tol, atol=tol)
        results.append((full, tokens, logits, served() - before))
    (full_a, tokens_a, logits_a, calls_a), (full_b, tokens_b, logits_b, calls_b) = results
    assert calls_a > 0 and calls_b == 0
    assert torch.equal(tokens_a, tokens_b)
    torch.testing.assert_close(full_a, full_b, rtol=tol, atol=tol)
    torch.testing.assert_close(logits_a[mask.bool()], logits_b[mask.bool()], rtol=tol, atol=tol)


def generate_plain_and_left_padded(model, ids, pad: int = 3, new_tokens: int = 8):
    """Greedy generations of ``ids`` alone and left padded by ``pad`` tokens (padding stripped)."""
    zeros = torch.zeros(ids.shape[0], pad, dtype=torch.long)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        padded = model.generate(
            torch.cat([zeros, ids], 1), attention_mask=torch.cat([torch.zeros_like(zeros), torch.ones_like(ids)], 1),
            max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return plain, padded[:, pad:]


def small_tokenizer(corpus: Path):
    """A byte-level BPE tokenizer of 300 tokens trained on the tiny corpus: any text tokenises
    (HashHop's hashes too), and logits over 300 tokens instead of SmolLM2's 49,152 keep a dozen
    fits (teacher and student logits, KL over the vocabulary) within seconds."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = "<|endoftext|>"
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[special], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=special, bos_token=special, pad_token=special)


def load_script(relative: str, name: str | None = None):
    """A script of the repository (``benchmarks/gpu/check.py``) imported as a module by path."""
    import importlib.util
    import sys

    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name or f"rf_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def loud_mixers(model):
    """``model`` (converted) with its mixers' outputs made loud and the hybrids' gates open, so
    they move a tiny random model's logits (it barely uses them otherwise); generation never
    stops on eos and pads with 0. In place; returns the model."""
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = layer.self_attn.mixer
            if hasattr(mixer, "out_proj"):
                mixer.out_proj.weight.mul_(4.0)
            if hasattr(mixer, "gate"):
                mixer.gate.fill_(1.0)
    model.generation_config.eos_token_id = None  # never stop before the tokens asked for
    model.generation_config.pad_token_id = 0
    return model


def float32_copy(model_dir, dest):
    """A copy of a saved model directory with its weights in float32 (``config.json``'s dtype too):
    for the checks that compare against hand-computed float32 scores, whatever dtype the recipe's
    ``model.dtype: auto`` chose on this CPU."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest)
    weights = Path(dest) / "model.safetensors"
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((Path(dest) / "config.json").read_text())
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    (Path(dest) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(dest)


def sweep_overrides(model_dir, corpus):
    """The tiny model, corpus and blocks in place of a SmolLM2 recipe's: all ``rfkit sweep`` needs,
    and the start of :func:`tiny_args` for ``rfkit fit``."""
    return [
        "--model.base_model", str(model_dir),
        "--model.policy.init_args.window", "4",
        "--data.source", str(corpus),
        "--data.seq_len", "32",
        "--data.batch_size", "2",
        "--data.calibration_samples", "4",
        "--data.val_blocks", "4",
        "--data.split", "[0.1, 0.1]",
    ]  # fmt: skip


def one_state_open(converted, dest: Path) -> tuple[str, list[str]]:
    """A copy of the converted model folder ``converted`` at ``dest`` with the gates of its first
    converted layer open (1, old tokens weighing e^5 times their softmax share) and every other
    layer's closed, so only that layer's state counts; ``(its gate's name, every gate's name)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(converted, dest)
    weights = next(dest.glob("*.safetensors"))
    tensors = load_file(weights)
    gates = sorted(k for k in tensors if k.endswith("mixer.gate"))
    assert len(gates) >= 1
    first = gates[0]
    for name in gates:
        tensors[name] = torch.full_like(tensors[name], 1.0 if name == first else 0.0)
    scale = first.replace("mixer.gate", "mixer.log_scale")
    tensors[scale] = torch.full_like(tensors[scale], 5.0)
    save_file(tensors, weights, metadata={"format": "pt"})
    return first, gates


def floor_the_state_turns_away(on: list[float], off: list[float]) -> float:
    """A state audit floor (``min_margin``) for a model with one state open, given every prompt's
    margin with that state on and off: the prompts above it with the state off (the targets) are
    lowered by the state on average and at least one is at or below it with the state on, so the
    audit must close that state, after which every target is quoted. Fails when no such floor is."""
    values = sorted(set(off))
    for low, high in zip(values, values[1:]):
        floor = (low + high) / 2
        targets = [i for i, m in enumerate(off) if m > floor]
        if sum(off[i] - on[i] for i in targets) > 0 and any(on[i] <= floor for i in targets):
            return floor
    raise AssertionError(f"the open state lowers no quote here: on {on}, off {off}")
