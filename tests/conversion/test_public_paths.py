"""One public path per class: the class_path a recipe writes (``rfkit.operators.X``,
``rfkit.policies.X``) is what a saved model's config.json, its head map and its model card record;
the implementation spellings older files hold still load; a plugin's class keeps its own path."""

from __future__ import annotations

import importlib
import inspect
import json
import shutil
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import SMOLLM, random_ids, run_cli, tiny_args, tiny_model
from transformers import AutoModelForCausalLM

import rfkit.conversion.policies as policies_impl
import rfkit.models.operators as operators_impl
from rfkit.classpath import PUBLIC_MODULES, class_path, public_path
from rfkit.conversion.headmap import HeadMap
from rfkit.conversion.registry import OPERATOR_ALIASES, POLICY_ALIASES
from rfkit.experiments.sweep import operator_label
from rfkit.models.layout import AttentionLayout
from rfkit.operators import HybridOperator, MambaOperator, ReplacementOperator, SinkRecentOperator
from rfkit.policies import ExplicitHeads, HeadSelectionPolicy, RecencyRatioPolicy
from rfkit.training.module import RecurFormerModule

OLD = {"rfkit.policies": "rfkit.conversion.policies", "rfkit.operators": "rfkit.models.operators"}


def old_spelling(path: str) -> str:
    module, _, name = path.rpartition(".")
    return f"{OLD[module]}.{name}"


def recipe_paths(recipe=SMOLLM) -> tuple[str, str]:
    model = yaml.safe_load(open(recipe))["model"]
    return model["policy"]["class_path"], model["operator"]["class_path"]


def test_a_converted_model_records_the_recipe_class_paths(converted_dir):
    """config.json, head_map.json and the model card of ``rfkit convert`` name the operator and
    the policy as the recipe does; no file names the implementation modules."""
    policy, operator = recipe_paths()
    assert (policy, operator) == ("rfkit.policies.RecencyRatioPolicy", "rfkit.operators.HybridOperator")
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["rf_operator"]["class_path"] == operator
    head_map = json.loads((converted_dir / "head_map.json").read_text())
    assert head_map["policy"]["class_path"] == policy
    card = (converted_dir / "README.md").read_text()
    assert f"- Replacement: `{operator}`" in card and f"- Policy: `{policy}`" in card
    assert f"class_path: {operator}" in card and f"class_path: {policy}" in card  # the recipe section
    for name in ("config.json", "head_map.json", "README.md"):
        text = (converted_dir / name).read_text()
        assert "rfkit.models.operators" not in text and "rfkit.conversion.policies" not in text, name


def test_every_builtin_class_is_named_by_its_public_module():
    """Each policy and operator defined in an implementation module records its public path, and
    that path imports the very class (so what a saved model records loads)."""
    for module, base in ((policies_impl, HeadSelectionPolicy), (operators_impl, ReplacementOperator)):
        public = PUBLIC_MODULES[module.__name__]
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
        classes = [c for c in classes if issubclass(c, base)]
        assert len(classes) >= 5
        for cls in classes:
            assert class_path(cls) == f"{public}.{cls.__name__}"
            assert getattr(importlib.import_module(public), cls.__name__) is cls, f"re-export {cls.__name__} from {public}"
    for aliases in (POLICY_ALIASES, OPERATOR_ALIASES):  # the short names of rfkit sweep say it the same way
        assert all(path == public_path(path) for path in aliases.values())
    assert HybridOperator().to_dict()["class_path"] == "rfkit.operators.HybridOperator"
    assert RecencyRatioPolicy().describe()["class_path"] == "rfkit.policies.RecencyRatioPolicy"
    # a policy with a module of its own is public under rfkit.policies too
    from rfkit.conversion.streamed_loss import StreamedLossPolicy

    assert StreamedLossPolicy().describe()["class_path"] == "rfkit.policies.StreamedLossPolicy"
    assert importlib.import_module("rfkit.policies").StreamedLossPolicy is StreamedLossPolicy


def test_a_head_map_with_the_old_spelling_loads_with_the_public_one(tmp_path):
    model = tiny_model()
    layout = AttentionLayout.from_config(model.config)
    raw = asdict(HeadMap.build("tiny", layout, None, [[0], [1]], ExplicitHeads([[0], [1]]), {}))
    raw["policy"]["class_path"] = "rfkit.conversion.policies.ExplicitHeads"
    (tmp_path / "head_map.json").write_text(json.dumps(raw))
    loaded = HeadMap.load(tmp_path / "head_map.json")
    assert loaded.policy["class_path"] == "rfkit.policies.ExplicitHeads"
    assert loaded.selected == [[0], [1]]
    loaded.save(tmp_path / "again.json")  # saved again: the public spelling
    assert json.loads((tmp_path / "again.json").read_text())["policy"]["class_path"] == "rfkit.policies.ExplicitHeads"


def test_a_saved_model_with_the_old_spelling_still_loads(converted_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(converted_dir, old)
    config = json.loads((old / "config.json").read_text())
    spec = config["rf_operator"]
    config["rf_operator"] = {**spec, "class_path": old_spelling(spec["class_path"])}
    (old / "config.json").write_text(json.dumps(config))
    ids = random_ids()
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(converted_dir)).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(old)).eval()(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    old_spec = config["rf_operator"]
    assert type(ReplacementOperator.from_dict(old_spec)) is HybridOperator
    assert operator_label(old_spec) == operator_label(spec)  # rfkit sweep --trained names it alike


def test_a_checkpoint_with_the_old_spelling_resumes(tmp_path):
    """Checkpoints record the operator; one written before the public paths still matches a recipe
    that names the same operator."""
    model = tiny_model()
    layout = AttentionLayout.from_config(model.config)
    head_map = HeadMap.build("tiny", layout, None, [[0], [1]], ExplicitHeads([[0], [1]]), {})
    recipe = SimpleNamespace(operator=MambaOperator(d_state=8), base_model="tiny")
    spec = recipe.operator.to_dict()
    meta = {"operator": {**spec, "class_path": "rfkit.models.operators.MambaOperator"}, "base_model": "tiny"}
    meta["head_map"] = asdict(head_map)
    assert RecurFormerModule.check_checkpoint(recipe, "last.ckpt", meta) is meta
    other = {**meta, "operator": {**spec, "class_path": "rfkit.models.operators.SinkRecentOperator"}}
    with pytest.raises(Exception, match="checkpoint rfkit.operators.SinkRecentOperator, recipe rfkit.operators.MambaOperator"):
        RecurFormerModule.check_checkpoint(recipe, "last.ckpt", other)


class EveryOtherHead(HeadSelectionPolicy):
    """A plugin policy defined outside rfkit."""

    def select(self, layout, profile):
        return [list(range(0, layout.num_heads, 2)) for _ in range(layout.num_layers)]


class QuietHybrid(HybridOperator):
    """A plugin operator subclassing a built-in: it is still the plugin's class."""


def test_a_plugin_class_records_its_own_path(tmp_path):
    here = __name__
    assert EveryOtherHead().describe()["class_path"] == f"{here}.EveryOtherHead"
    spec = QuietHybrid().to_dict()
    assert spec["class_path"] == f"{here}.QuietHybrid"
    assert type(ReplacementOperator.from_dict(spec)) is QuietHybrid
    assert SinkRecentOperator().to_dict()["class_path"] == "rfkit.operators.SinkRecentOperator"

    model = tiny_model()
    layout = AttentionLayout.from_config(model.config)
    policy = EveryOtherHead()
    head_map = HeadMap.build("tiny", layout, None, policy.select(layout, None), policy, {})
    head_map.save(tmp_path / "head_map.json")
    assert HeadMap.load(tmp_path / "head_map.json").policy["class_path"] == f"{here}.EveryOtherHead"
    assert public_path(f"{here}.EveryOtherHead") == f"{here}.EveryOtherHead"


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, operator, recorded",
    [
        # short names: jsonargparse alone would record the shortest import path, rfkit.RandomHeads
        ("RandomHeads", "SinkRecentOperator", ("rfkit.policies.RandomHeads", "rfkit.operators.SinkRecentOperator")),
        # a recipe written with the old spelling: saved under the public one
        ("rfkit.conversion.policies.RandomHeads", "rfkit.models.operators.HybridOperator",
         ("rfkit.policies.RandomHeads", "rfkit.operators.HybridOperator")),
        # a plugin keeps its own path
        (f"{__name__}.EveryOtherHead", f"{__name__}.QuietHybrid", (f"{__name__}.EveryOtherHead", f"{__name__}.QuietHybrid")),
    ],
)  # fmt: skip
def test_the_resolved_recipe_records_the_same_paths(policy, operator, recorded, tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """``rfkit profile`` writes the resolved recipe (config.yaml) beside the head map: both name the
    classes alike, whichever way the command line named them."""
    out = tmp_path / "map" / "head_map.json"
    args = [*tiny_args(tiny_model_dir, tiny_corpus, tmp_path), "--model.policy", policy, "--model.operator", operator]
    code, _, err = run_cli(["profile", *args, "--output", str(out), "--report", "false"], capsys)
    assert code == 0, err
    config = yaml.safe_load((out.parent / "config.yaml").read_text())["model"]
    assert (config["policy"]["class_path"], config["operator"]["class_path"]) == recorded
    assert HeadMap.load(out).policy["class_path"] == recorded[0]
