"""Configuration of the Llama-family models (Llama, Mistral, Qwen2, Qwen3).

:class:`LlamaConfig` is a frozen, hashable dataclass (so it can be a static
argument of ``jax.jit``) read from a Hugging Face ``config.json`` with
:meth:`LlamaConfig.from_hf` / :meth:`LlamaConfig.from_json` and written back
with :meth:`LlamaConfig.to_hf`. The four families differ only in flags:

===========  ==============  ===============  ========  ==================
model_type   q/k/v bias      o_proj bias      q/k norm  sliding window
===========  ==============  ===============  ========  ==================
llama        attention_bias  attention_bias   no        no
mistral      no              no               no        ``sliding_window``
qwen2        yes (default)   no               no        if ``use_sliding_window``
qwen3        attention_bias  attention_bias   yes       if ``use_sliding_window``
===========  ==============  ===============  ========  ==================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jaxkv.errors import InvalidArgument
from jaxkv.nn.checkpoint import read_config

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaConfig", "RopeScaling"]

#: ``model_type`` values :meth:`LlamaConfig.from_hf` accepts.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# transformers' defaults where a config.json leaves a field out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (hashable form of HF's ``rope_scaling`` dict).

    ``rope_type``: ``"llama3"`` (Llama 3.1+: ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``) or
    ``"linear"`` (every frequency divided by ``factor``).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear"):
            raise InvalidArgument(
                f"rope_scaling type {self.rope_type!r} is not supported (llama3, linear, default/None)")
        if not self.factor > 0:
            raise InvalidArgument(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise InvalidArgument(
                    f"llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                    f"{self.high_freq_factor} and {self.low_freq_factor}")
            if self.original_max_position_embeddings < 1:
                raise InvalidArgument("llama3 rope_scaling needs original_max_position_embeddings >= 1")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None) -> RopeScaling | None:
        """HF's dict (``rope_type`` or the older ``type`` key); None or
        ``"default"`` gives None (plain RoPE)."""
        if d is None:
            return None
        kind = d.get("rope_type", d.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind == "linear":
            return cls("linear", factor=float(d["factor"]))
        if kind == "llama3":
            try:
                return cls(
                    "llama3",
                    factor=float(d["factor"]),
                    low_freq_factor=float(d["low_freq_factor"]),
                    high_freq_factor=float(d["high_freq_factor"]),
                    original_max_position_embeddings=int(d["original_max_position_embeddings"]),
                )
            except KeyError as e:
                raise InvalidArgument(f"llama3 rope_scaling is missing {e.args[0]!r}: {dict(d)}") from None
        raise InvalidArgument(f"rope_scaling type {kind!r} is not supported (llama3, linear, default/None)")

    def to_hf(self) -> dict:
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and flags of a Llama-family decoder (names as in transformers).

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA) and
    ``head_dim`` to ``hidden_size // num_attention_heads``. ``attention_bias``
    puts a bias on q/k/v_proj, ``attention_out_bias`` on o_proj,
    ``mlp_bias`` on the MLP projections. ``qk_norm``: RMSNorm over each head
    of q and k before RoPE (Qwen3). ``sliding_window``: each query attends
    its ``sliding_window`` latest positions, itself included (None: off);
    ``sliding_window_layers`` lists the layers that use it (None: all).
    ``eos_token_id`` is a tuple (HF allows an int or a list).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # The checkpoint's storage dtype: a loading hint, not part of the model
    # (configs differing only here compare equal).
    torch_dtype: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgument(
                f"model_type {self.model_type!r} is not supported; jaxkv.nn handles {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise InvalidArgument(
                    f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim")
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim < 2 or self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise InvalidArgument(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}")
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", RopeScaling.from_hf(self.rope_scaling))
        if self.sliding_window is not None:
            if int(self.sliding_window) < 1:
                raise InvalidArgument(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
            set_("sliding_window", int(self.sliding_window))
        if self.sliding_window_layers is not None:
            layers = tuple(sorted(int(i) for i in self.sliding_window_layers))
            bad = [i for i in layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise InvalidArgument(f"sliding_window_layers {bad} outside [0, {self.num_hidden_layers})")
            # Every layer windowed is spelled None, so equal configs compare equal.
            set_("sliding_window_layers", None if layers == tuple(range(self.num_hidden_layers)) else layers)
        eos = self.eos_token_id
        if eos is None:
            eos = ()
        elif isinstance(eos, int):
            eos = (eos,)
        set_("eos_token_id", tuple(int(e) for e in eos))
        if self.torch_dtype is not None and self.torch_dtype not in _DTYPE_NAMES:
            set_("torch_dtype", None)  # e.g. "auto": no preference

    # ----------------------------------------------------------------- queries

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------- HF conversion

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """Read a transformers ``config.json`` dict (LlamaConfig, MistralConfig,
        Qwen2Config or Qwen3Config). Raises ``InvalidArgument`` for another
        ``model_type``, a missing required field, an activation other than
        SiLU or an unsupported RoPE scaling."""
        d = dict(d)
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgument(
                f"model_type {model_type!r} is not supported; jaxkv.nn handles {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise InvalidArgument(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise InvalidArgument(f"config ({model_type}) is missing {', '.join(missing)}")

        # transformers >= 5 folds rope_theta and the scaling into rope_parameters.
        rope = d.get("rope_parameters") or {}
        rope_theta = float(d.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = RopeScaling.from_hf(d.get("rope_scaling") or (rope if rope else None))

        # Qwen2's q/k/v always carry a bias in transformers (an ``attention_bias`` key is not read).
        bias = True if model_type == "qwen2" else bool(d.get("attention_bias", False))
        out_bias = bias if model_type in ("llama", "qwen3") else False
        if model_type == "mistral":
            bias = False
        sliding_window, window_layers = None, None
        num_layers = int(d["num_hidden_layers"])
        if model_type == "mistral":
            sliding_window = d.get("sliding_window", 4096)
        elif model_type in ("qwen2", "qwen3"):
            if d.get("use_sliding_window", False):
                sliding_window = d.get("sliding_window")
                if sliding_window is not None:
                    window_layers = _window_layers(d, num_layers)
        elif model_type == "llama":
            sliding_window = d.get("sliding_window")  # not in HF's Llama; kept for round trips
        if sliding_window is not None and window_layers is None and d.get("layer_types"):
            window_layers = _window_layers(d, num_layers)

        dtype = d.get("torch_dtype", d.get("dtype"))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=None if d.get("num_key_value_heads") is None else int(d["num_key_value_heads"]),
            # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads.
            head_dim=int(d["head_dim"]) if d.get("head_dim") is not None else (128 if model_type == "qwen3" else None),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type])),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            attention_out_bias=out_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            sliding_window_layers=window_layers,
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            torch_dtype=dtype if isinstance(dtype, str) else None,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> LlamaConfig:
        """:meth:`from_hf` of a ``config.json`` file, or of the ``config.json``
        inside a directory."""
        return cls.from_hf(read_config(path))

    def to_hf(self) -> dict:
        """A transformers-style ``config.json`` dict that :meth:`from_hf` reads
        back to an equal config."""
        d: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)) or None,
            "pad_token_id": self.pad_token_id,
        }
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.model_type in ("llama", "qwen3"):
            if self.attention_bias != self.attention_out_bias:
                raise InvalidArgument(
                    f"{self.model_type} has one attention_bias for q/k/v and o; this config has "
                    f"{self.attention_bias} and {self.attention_out_bias}")
            d["attention_bias"] = self.attention_bias
        elif self.model_type == "qwen2":
            if self.attention_out_bias:
                raise InvalidArgument("qwen2 has no o_proj bias")
            d["attention_bias"] = self.attention_bias
        elif self.attention_bias or self.attention_out_bias:
            raise InvalidArgument("mistral has no attention bias")
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        elif self.mlp_bias:
            raise InvalidArgument(f"{self.model_type} has no mlp bias")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise InvalidArgument(f"qk_norm={self.qk_norm} cannot be written as model_type {self.model_type}")
        d["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
        if self.sliding_window is not None:
            d["layer_types"] = [
                "sliding_attention" if self.layer_sliding_window(i) else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        return d


def _window_layers(d: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers with a sliding window: HF's ``layer_types`` when given, else
    Qwen2's rule (layers at and after ``max_window_layers``)."""
    types = d.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise InvalidArgument(f"layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    first = int(d.get("max_window_layers", 28))  # transformers' default for Qwen2 and Qwen3
    first = min(max(first, 0), num_layers)
    return tuple(range(first, num_layers))

