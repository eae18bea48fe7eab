"""Configuration of gpt-oss (``model_type`` ``"gpt_oss"``), read from a
transformers ``config.json``.

Every field transformers' (5.x) ``GptOssConfig`` reads, with its defaults
(gpt-oss-20b's shapes): ``layer_types`` (``sliding_attention`` /
``full_attention``; without it, even layers slide and odd ones are full),
``sliding_window`` (a sliding layer's token ``p`` attends positions ``(p -
sliding_window, p]``), the experts (``num_local_experts``, alias
``num_experts``; ``num_experts_per_tok``; ``intermediate_size``;
``swiglu_alpha``, ``swiglu_limit``), ``attention_bias`` and the RoPE:
``rope_parameters`` (transformers 5) or the older ``rope_scaling`` +
``rope_theta``, ``rope_type`` ``yarn`` or ``default``; without either, the
YaRN gpt-oss ships (``factor`` 32, ``beta_fast`` 32, ``beta_slow`` 1,
``original_max_position_embeddings`` 4096, ``truncate`` false, theta
150000). ``truncate`` (default true) is read from the top-level dict as
transformers reads it. ``quantization_config`` is kept as JSON text (the
MXFP4 experts are dequantized by :mod:`jaxkv.nn.gpt_oss` at load).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jaxkv.errors import InvalidArgument
from jaxkv.nn.deepseek_v4_config import RopeParameters

__all__ = ["GptOssConfig"]

_LAYER_TYPES = ("sliding_attention", "full_attention")
_DEFAULT_THETA = 150000.0
#: transformers' GptOssConfig default ``rope_parameters`` (theta added by its standardization).
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_DEFAULT_ROPE_PARAMETERS = RopeParameters(rope_type="yarn", rope_theta=_DEFAULT_THETA, factor=32.0,
                                          original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False)
_ROPE_TYPES = ("default", "yarn")


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """Shape of a gpt-oss model (names as in transformers)."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope: RopeParameters = _DEFAULT_ROPE_PARAMETERS
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = dataclasses.field(default=None, compare=False)
    quantization_config: str | None = dataclasses.field(default=None, compare=False)  # JSON text
    model_type: str = dataclasses.field(default="gpt_oss", init=False)

    def __post_init__(self):
        n = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise InvalidArgument(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, "
                                  f"num_local_experts ({self.num_local_experts})]")
        if not self.rms_norm_eps > 0:
            raise InvalidArgument(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.swiglu_limit > 0:
            raise InvalidArgument(f"swiglu_limit must be > 0, got {self.swiglu_limit}")
        if not isinstance(self.rope, RopeParameters):
            raise InvalidArgument(f"rope must be a RopeParameters, got {type(self.rope).__name__}")
        if self.rope.rope_type == "yarn" and not (self.rope.factor or 0) > 0:
            raise InvalidArgument(f"rope_parameters factor must be > 0 for yarn, got {self.rope.factor}")
        types = tuple(self.layer_types) or tuple(
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n))
        if len(types) != n or any(t not in _LAYER_TYPES for t in types):
            raise InvalidArgument(f"layer_types must be {n} entries of {_LAYER_TYPES}, got {list(types)}")
        object.__setattr__(self, "layer_types", types)
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", () if eos is None else (int(eos),) if isinstance(eos, int)
                           else tuple(int(e) for e in eos))

    @property
    def num_experts(self) -> int:
        """transformers' alias of ``num_local_experts``."""
        return self.num_local_experts

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def replace(self, **changes) -> GptOssConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> GptOssConfig:
        """Read a transformers ``config.json`` dict. Raises ``InvalidArgument``
        naming the field for a wrong ``model_type``, ``hidden_act`` other
        than silu (transformers' experts ignore it, but a checkpoint that says
        otherwise is not gpt-oss), an unsupported ``rope_type`` or a partial
        rotary factor, and every check of the dataclass."""
        if not isinstance(d, Mapping):
            raise InvalidArgument(f"config must be a dict, got {type(d).__name__}")
        d = dict(d)
        if d.get("model_type") != "gpt_oss":
            raise InvalidArgument(f"model_type {d.get('model_type')!r} is not gpt_oss")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise InvalidArgument(f"hidden_act {d.get('hidden_act')!r} is not supported (gpt-oss: silu)")
        theta = float(d.get("rope_theta") or _DEFAULT_THETA)
        params = d.get("rope_parameters")
        if params is None:
            params = d.get("rope_scaling")
        if params is None:
            params = _DEFAULT_ROPE
        if not isinstance(params, Mapping):
            raise InvalidArgument(f"rope_parameters must be a dict, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in _ROPE_TYPES:
            raise InvalidArgument(f"rope_parameters rope_type {kind!r} is not supported for gpt_oss {_ROPE_TYPES}")
        partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise InvalidArgument(f"partial_rotary_factor {partial} is not supported for gpt_oss (1.0 only)")
        if kind == "yarn" and params.get("original_max_position_embeddings") is None:
            raise InvalidArgument("rope_parameters original_max_position_embeddings is required for yarn")
        rope = RopeParameters.from_hf({**params, "rope_type": kind}, theta)
        rope = dataclasses.replace(rope, truncate=bool(params.get("truncate", True)))
        n = int(d.get("num_hidden_layers", 36))
        types = d.get("layer_types")
        if types is None:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        if not isinstance(types, (list, tuple)):
            raise InvalidArgument(f"layer_types must be a list, got {types!r}")
        window = d.get("sliding_window", 128)
        if window is None:
            if any(t == "sliding_attention" for t in types):
                raise InvalidArgument("sliding_window is null but layer_types has sliding_attention layers")
            window = 128
        experts = d.get("num_local_experts", d.get("num_experts", 128))
        quant = d.get("quantization_config")
        dtype = d.get("torch_dtype", d.get("dtype"))
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        skip = ("rope", "layer_types", "eos_token_id", "torch_dtype", "quantization_config", "num_local_experts",
                "sliding_window")
        simple = {k: d[k] for k in fields if k in d and k not in skip}
        return cls(**simple, rope=rope, layer_types=tuple(types), sliding_window=window, num_local_experts=experts,
                   eos_token_id=d.get("eos_token_id"), torch_dtype=dtype if isinstance(dtype, str) else None,
                   quantization_config=None if quant is None else json.dumps(quant, sort_keys=True))

    def to_hf(self) -> dict:
        """A transformers ``config.json`` dict :meth:`from_hf` reads back equal
        (and transformers' ``GptOssConfig`` reads to the same model)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope", "eos_token_id", "torch_dtype", "quantization_config", "layer_types")}
        rope = {k: v for k, v in self.rope.to_hf(1.0).items() if k != "partial_rotary_factor"}
        rope["truncate"] = self.rope.truncate
        d.update(architectures=["GptOssForCausalLM"], hidden_act="silu", layer_types=list(self.layer_types),
                 rope_parameters=rope,
                 eos_token_id=(self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)) or None)
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.quantization_config is not None:
            d["quantization_config"] = json.loads(self.quantization_config)
        return d
