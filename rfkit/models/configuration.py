"""The configurations of converted models: each family's config plus the fields that say what was
replaced (``rf_selected``, ``rf_operator``, ``rf_base_model_type``) and the layout of its weights
(``rf_format_version``: absent in models saved before the packed projection, see
:mod:`rfkit.models.modeling`).

``model_type`` ``rf_llama`` / ``rf_mistral`` / ``rf_qwen2``. :mod:`rfkit.models.modeling` registers them
with ``AutoConfig`` (``import rfkit``); an exported model folder ships this module as
``configuration_rfkit.py`` (:mod:`rfkit.models.export`).
"""

from __future__ import annotations

from transformers import LlamaConfig, MistralConfig, Qwen2Config


def _init_rf_fields(config, rf_selected, rf_operator, rf_base_model_type, rf_format_version) -> None:
    """The fields every ``rf_*`` config adds to its family's config."""
    config.rf_selected = rf_selected or []
    config.rf_operator = rf_operator or {}
    config.rf_base_model_type = rf_base_model_type
    config.rf_format_version = rf_format_version


# Each config class defines its own ``__init__``: transformers turns config classes into
# dataclasses and would generate one (dropping the ``rf_*`` arguments) for a class without.
class RecurFormerLlamaConfig(LlamaConfig):
    model_type = "rf_llama"

    def __init__(self, rf_selected=None, rf_operator=None, rf_base_model_type="llama", rf_format_version=None, **kwargs):
        super().__init__(**kwargs)
        _init_rf_fields(self, rf_selected, rf_operator, rf_base_model_type, rf_format_version)


class RecurFormerMistralConfig(MistralConfig):
    model_type = "rf_mistral"

    def __init__(self, rf_selected=None, rf_operator=None, rf_base_model_type="mistral", rf_format_version=None, **kwargs):
        super().__init__(**kwargs)
        _init_rf_fields(self, rf_selected, rf_operator, rf_base_model_type, rf_format_version)


class RecurFormerQwen2Config(Qwen2Config):
    model_type = "rf_qwen2"

    def __init__(self, rf_selected=None, rf_operator=None, rf_base_model_type="qwen2", rf_format_version=None, **kwargs):
        super().__init__(**kwargs)
        _init_rf_fields(self, rf_selected, rf_operator, rf_base_model_type, rf_format_version)
