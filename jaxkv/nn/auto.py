"""``AutoModelForCausalLM``: load a local checkpoint of any family jaxkv serves.

The family comes from ``config.json``'s ``model_type``, as in transformers:

==============================================  ==========================================
model_type                                      class
==============================================  ==========================================
``llama``, ``mistral``, ``qwen2``, ``qwen3``    :class:`~jaxkv.nn.LlamaForCausalLM`
``deepseek_v3``                                 :class:`~jaxkv.nn.DeepseekV3ForCausalLM`
``deepseek_v4``                                 :class:`~jaxkv.nn.DeepseekV4ForCausalLM`
``qwen3_next``                                  :class:`~jaxkv.nn.Qwen3NextForCausalLM`
==============================================  ==========================================
"""

from __future__ import annotations

import os

from jaxkv.errors import InvalidArgument
from jaxkv.nn.checkpoint import read_config
from jaxkv.nn.config import SUPPORTED_MODEL_TYPES
from jaxkv.nn.deepseek_v3 import DeepseekV3ForCausalLM
from jaxkv.nn.deepseek_v4 import DeepseekV4ForCausalLM
from jaxkv.nn.llama import LlamaForCausalLM
from jaxkv.nn.qwen3_next import Qwen3NextForCausalLM

__all__ = ["AutoModelForCausalLM", "MODEL_CLASSES"]

#: ``model_type`` -> model class.
MODEL_CLASSES = {**{t: LlamaForCausalLM for t in SUPPORTED_MODEL_TYPES}, "deepseek_v3": DeepseekV3ForCausalLM,
                 "deepseek_v4": DeepseekV4ForCausalLM, "qwen3_next": Qwen3NextForCausalLM}


class AutoModelForCausalLM:
    """Not instantiated: :meth:`from_pretrained` returns the family's model."""

    def __init__(self):
        raise TypeError("use AutoModelForCausalLM.from_pretrained(dir)")

    @staticmethod
    def model_class(path: str | os.PathLike):
        """The class :meth:`from_pretrained` would build for ``path``."""
        model_type = read_config(path).get("model_type")
        if model_type not in MODEL_CLASSES:
            raise InvalidArgument(f"model_type {model_type!r} in {os.fspath(path)} is not supported; jaxkv.nn "
                                  f"serves {', '.join(sorted(MODEL_CLASSES))}")
        return MODEL_CLASSES[model_type]

    @staticmethod
    def from_pretrained(path: str | os.PathLike, **kwargs):
        """Load ``path`` (a local transformers checkpoint directory) with its
        family's ``from_pretrained``; keyword arguments go to it (``dtype``,
        ``param_dtype``, ``precision``, ``implementation``)."""
        return AutoModelForCausalLM.model_class(path).from_pretrained(path, **kwargs)
