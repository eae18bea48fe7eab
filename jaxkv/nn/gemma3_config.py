"""Configuration of Gemma 3 text (``model_type`` ``"gemma3_text"``), read from a
transformers ``config.json``.

Every field transformers' (5.x) ``Gemma3TextConfig`` reads, with its
defaults: the sizes, ``query_pre_attn_scalar`` (the attention scale is its
``** -0.5``), ``sliding_window``, ``layer_types`` (``sliding_attention`` /
``full_attention``; without it, every ``sliding_window_pattern``-th layer
(default 6) is full attention), ``attn_logit_softcapping`` (null only: see
the refusal), ``final_logit_softcapping``, ``hidden_activation`` and the two RoPEs:

* ``rope_parameters`` keyed by layer type (what transformers 5.x writes:
  ``{"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta":
  1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}``);
* or the older spelling, ``rope_theta`` (global, default 1e6),
  ``rope_local_base_freq`` (sliding layers, default 1e4) and
  ``rope_scaling`` (the full-attention layers' scaling).

Each layer type's RoPE is ``default`` or ``linear`` (``factor``); anything
else, ``partial_rotary_factor`` other than 1, ``use_bidirectional_attention``
and activations other than the GELUs are refused with ``InvalidArgument``
naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxkv.errors import InvalidArgument
from jaxkv.nn.config import RopeScaling

__all__ = ["Gemma3Config"]

_LAYER_TYPES = ("sliding_attention", "full_attention")
#: transformers' ACT2FN names this model runs: the tanh GELU (``gelu_pytorch_tanh``, ``gelu_new``) or the exact one.
_ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _rope_of(layer_type: str, d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` of one layer type's rope parameters."""
    where = f"rope_parameters[{layer_type!r}]"
    if not isinstance(d, Mapping):
        raise InvalidArgument(f"{where} must be a dict, got {d!r}")
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in ("default", "linear"):
        raise InvalidArgument(f"{where}: rope_type {kind!r} is not supported for gemma3_text (default, linear)")
    prf = d.get("partial_rotary_factor", 1.0)
    if prf is not None and float(prf) != 1.0:
        raise InvalidArgument(f"{where}: partial_rotary_factor {prf} is not supported for gemma3_text (1.0 only)")
    theta = d.get("rope_theta")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise InvalidArgument(f"{where}: rope_theta must be a number > 0, got {theta!r}")
    if kind == "default":
        return float(theta), None
    if "factor" not in d:
        raise InvalidArgument(f"{where}: linear rope scaling needs a 'factor'")
    return float(theta), RopeScaling.from_hf({"rope_type": "linear", "factor": d["factor"]})


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Shape of a Gemma 3 text model (names as in transformers).

    ``rope_theta`` / ``rope_scaling``: the full-attention layers' RoPE;
    ``rope_local_base_freq`` / ``rope_local_scaling``: the sliding layers'.
    """

    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] = ()
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    rope_local_base_freq: float = 10_000.0
    rope_local_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = 0
    torch_dtype: str | None = dataclasses.field(default=None, compare=False)
    model_type: str = dataclasses.field(default="gemma3_text", init=False)

    def __post_init__(self):
        n = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even (RoPE rotates halves), got {self.head_dim}")
        if self.hidden_activation not in _ACTIVATIONS:
            raise InvalidArgument(f"hidden_activation {self.hidden_activation!r} is not supported for gemma3_text "
                                  f"({', '.join(_ACTIVATIONS)})")
        for name in ("rms_norm_eps", "query_pre_attn_scalar", "rope_theta", "rope_local_base_freq"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or not value > 0:
                raise InvalidArgument(f"{name} must be a finite number > 0, got {value!r}")
        if self.attn_logit_softcapping is not None:
            # An option that would do nothing is refused rather than ignored: transformers 5.x's Gemma 3
            # attention never applies it (Gemma 2's does), so neither capping nor ignoring it matches every
            # reading of such a checkpoint. Released Gemma 3 checkpoints set it null.
            raise InvalidArgument(
                f"attn_logit_softcapping={self.attn_logit_softcapping!r}: Gemma 3 checkpoints set it null, and "
                "transformers' Gemma 3 attention never applies it (Gemma 2's does), so a value here has no "
                "agreed meaning; set it to null (transformers' behaviour)")
        for name in ("final_logit_softcapping",):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value) or not value > 0):
                raise InvalidArgument(f"{name} must be None or a finite number > 0, got {value!r}")
        types = tuple(self.layer_types) or tuple(
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n))
        if len(types) != n or any(t not in _LAYER_TYPES for t in types):
            raise InvalidArgument(f"layer_types must be {n} entries of {_LAYER_TYPES}, got {list(types)}")
        object.__setattr__(self, "layer_types", types)
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise InvalidArgument(f"sliding_window must be None or an integer >= 1, got {window!r}")
        if window is None and "sliding_attention" in types:
            raise InvalidArgument("sliding_window is None but layer_types has sliding_attention layers")
        for name in ("rope_scaling", "rope_local_scaling"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, RopeScaling) or value.rope_type != "linear"):
                raise InvalidArgument(f"{name} must be None or a linear RopeScaling, got {value!r}")
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", () if eos is None else (int(eos),) if isinstance(eos, int)
                           else tuple(int(e) for e in eos))

    @property
    def attention_scale(self) -> float:
        """The attention logits' scale, ``query_pre_attn_scalar ** -0.5``."""
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def embed_scale(self) -> float:
        """``sqrt(hidden_size)`` (the model rounds it to its compute dtype)."""
        return float(self.hidden_size) ** 0.5

    @property
    def gelu_approximate(self) -> bool:
        return _ACTIVATIONS[self.hidden_activation]

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def rope_of(self, layer: int) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` of layer ``layer``'s RoPE."""
        if self.is_sliding(layer):
            return self.rope_local_base_freq, self.rope_local_scaling
        return self.rope_theta, self.rope_scaling

    def replace(self, **changes) -> Gemma3Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Gemma3Config:
        d = dict(d)
        if d.get("model_type") != "gemma3_text":
            extra = (" (the multimodal Gemma3ForConditionalGeneration; only its text model, gemma3_text, is "
                     "supported)") if d.get("model_type") == "gemma3" else ""
            raise InvalidArgument(f"model_type {d.get('model_type')!r} is not gemma3_text{extra}")
        if d.get("use_bidirectional_attention"):
            raise InvalidArgument("use_bidirectional_attention is not supported for gemma3_text (causal only)")
        n = int(d.get("num_hidden_layers", 26))
        types = d.get("layer_types")
        if types is None:
            pattern = d.get("sliding_window_pattern", 6)
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
                raise InvalidArgument(f"sliding_window_pattern must be an integer >= 1, got {pattern!r}")
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        elif not isinstance(types, (list, tuple)):
            raise InvalidArgument(f"layer_types must be a list, got {types!r}")
        # transformers' convert_rope_params_to_dict: rope_parameters keyed by
        # layer type, or rope_theta / rope_local_base_freq / rope_scaling.
        rope = d.get("rope_parameters")
        if rope is None:
            rope = {t: {"rope_type": "default"} for t in _LAYER_TYPES}
        elif not isinstance(rope, Mapping) or set(rope) - set(_LAYER_TYPES):
            raise InvalidArgument(f"rope_parameters must be keyed by layer type {_LAYER_TYPES}, got {rope!r}")
        rope = {t: dict(rope.get(t) or {"rope_type": "default"}) for t in _LAYER_TYPES}
        scaling = d.get("rope_scaling")
        if scaling is not None:
            if not isinstance(scaling, Mapping):
                raise InvalidArgument(f"rope_scaling must be a dict or null, got {scaling!r}")
            rope["full_attention"].update(scaling)
        rope["full_attention"].setdefault("rope_theta", d.get("rope_theta", _DEFAULT_THETA["full_attention"]))
        rope["sliding_attention"].setdefault("rope_theta",
                                             d.get("rope_local_base_freq", _DEFAULT_THETA["sliding_attention"]))
        theta, global_scaling = _rope_of("full_attention", rope["full_attention"])
        local_theta, local_scaling = _rope_of("sliding_attention", rope["sliding_attention"])
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        simple = {k: d[k] for k in fields if k in d and k not in (
            "layer_types", "eos_token_id", "rope_theta", "rope_scaling", "rope_local_base_freq", "torch_dtype")}
        dtype = d.get("torch_dtype", d.get("dtype"))
        return cls(**simple, layer_types=tuple(types), eos_token_id=d.get("eos_token_id"), rope_theta=theta,
                   rope_scaling=global_scaling, rope_local_base_freq=local_theta, rope_local_scaling=local_scaling,
                   torch_dtype=dtype if isinstance(dtype, str) else None)

    def to_hf(self) -> dict:
        def rope(theta, scaling):
            out = {"rope_type": "default", "rope_theta": theta}
            if scaling is not None:
                out.update(rope_type="linear", factor=scaling.factor)
            return out

        skip = ("eos_token_id", "torch_dtype", "rope_theta", "rope_scaling", "rope_local_base_freq",
                "rope_local_scaling")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        d.update(architectures=["Gemma3ForCausalLM"], layer_types=list(self.layer_types),
                 rope_parameters={"full_attention": rope(self.rope_theta, self.rope_scaling),
                                  "sliding_attention": rope(self.rope_local_base_freq, self.rope_local_scaling)},
                 use_bidirectional_attention=False,
                 eos_token_id=(self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id))
                 or None)
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        return d
