"""``AutoModelForCausalLM``: load a local checkpoint of any family jaxkv serves.

The family comes from ``config.json``'s ``model_type``, as in transformers:

==============================================  ==========================================
model_type                                      class
==============================================  ==========================================
``llama``, ``mistral``, ``qwen2``, ``qwen3``    :class:`~jaxkv.nn.LlamaForCausalLM`
``deepseek_v3``                                 :class:`~jaxkv.nn.DeepseekV3ForCausalLM`
``deepseek_v4``                                 :class:`~jaxkv.nn.DeepseekV4ForCausalLM`
``qwen3_next``                                  :class:`~jaxkv.nn.Qwen3NextForCausalLM`
``gpt_oss``                                     :class:`~jaxkv.nn.GptOssForCausalLM`
``gemma3_text``                                 :class:`~jaxkv.nn.Gemma3ForCausalLM`
==============================================  ==========================================

A GGUF file (llama.cpp's format; a file starting with ``b"GGUF"``) is read
by :mod:`jaxkv.nn.gguf` instead: architectures ``llama``, ``qwen2`` and
``qwen3`` give a :class:`~jaxkv.nn.LlamaForCausalLM`, ``gemma3`` a
:class:`~jaxkv.nn.Gemma3ForCausalLM`; any other is refused naming it.
"""

from __future__ import annotations

import os

from jaxkv.errors import InvalidArgument
from jaxkv.nn.checkpoint import read_config
from jaxkv.nn.config import SUPPORTED_MODEL_TYPES
from jaxkv.nn.deepseek_v3 import DeepseekV3ForCausalLM
from jaxkv.nn.deepseek_v4 import DeepseekV4ForCausalLM
from jaxkv.nn.gemma3 import Gemma3ForCausalLM
from jaxkv.nn.gguf import GGUF_MODEL_TYPES, SUPPORTED_GGUF_ARCHITECTURES, is_gguf, load_gguf_model, read_gguf
from jaxkv.nn.gpt_oss import GptOssForCausalLM
from jaxkv.nn.llama import LlamaForCausalLM
from jaxkv.nn.qwen3_next import Qwen3NextForCausalLM

__all__ = ["AutoModelForCausalLM", "MODEL_CLASSES"]

#: ``model_type`` -> model class.
MODEL_CLASSES = {**{t: LlamaForCausalLM for t in SUPPORTED_MODEL_TYPES}, "deepseek_v3": DeepseekV3ForCausalLM,
                 "deepseek_v4": DeepseekV4ForCausalLM, "qwen3_next": Qwen3NextForCausalLM,
                 "gpt_oss": GptOssForCausalLM, "gemma3_text": Gemma3ForCausalLM}


class AutoModelForCausalLM:
    """Not instantiated: :meth:`from_pretrained` returns the family's model."""

    def __init__(self):
        raise TypeError("use AutoModelForCausalLM.from_pretrained(dir)")

    @staticmethod
    def model_class(path: str | os.PathLike):
        """The class :meth:`from_pretrained` would build for ``path``."""
        if is_gguf(path):
            architecture = read_gguf(path).architecture
            if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
                raise InvalidArgument(f"GGUF file {os.fspath(path)} has architecture {architecture!r}; jaxkv "
                                      f"loads GGUF architectures {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
            return MODEL_CLASSES[GGUF_MODEL_TYPES[architecture]]
        model_type = read_config(path).get("model_type")
        if model_type not in MODEL_CLASSES:
            raise InvalidArgument(f"model_type {model_type!r} in {os.fspath(path)} is not supported; jaxkv.nn "
                                  f"serves {', '.join(sorted(MODEL_CLASSES))}")
        return MODEL_CLASSES[model_type]

    @staticmethod
    def from_pretrained(path: str | os.PathLike, **kwargs):
        """Load ``path`` (a local transformers checkpoint directory) with its
        family's ``from_pretrained``; keyword arguments go to it (``dtype``,
        ``param_dtype``, ``precision``, ``implementation``). A GGUF file
        goes to :func:`jaxkv.nn.gguf.load_gguf_model` (same keywords)."""
        if is_gguf(path):
            return load_gguf_model(path, **kwargs)
        if os.path.isfile(path) and os.fspath(path).endswith(".gguf"):
            read_gguf(path)  # raises the typed error: not GGUF (wrong magic), unreadable
        return AutoModelForCausalLM.model_class(path).from_pretrained(path, **kwargs)
