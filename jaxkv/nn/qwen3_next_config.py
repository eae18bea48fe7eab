"""Configuration of Qwen3-Next (``model_type`` ``"qwen3_next"``), read from a
transformers ``config.json``.

Every field transformers' ``Qwen3NextConfig`` reads, with its defaults:
``layer_types`` (``linear_attention`` / ``full_attention``; without it,
every ``full_attention_interval``-th layer is full attention), the Gated
DeltaNet sizes (``linear_num_key_heads``, ``linear_num_value_heads``,
``linear_key_head_dim``, ``linear_value_head_dim``,
``linear_conv_kernel_dim``), the MoE layout (``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``,
``shared_expert_intermediate_size``, ``decoder_sparse_step``,
``mlp_only_layers``, ``norm_topk_prob``) and the partial RoPE
(``partial_rotary_factor``, default 0.25; ``rope_theta`` or
``rope_parameters``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxkv.errors import InvalidArgument

__all__ = ["Qwen3NextConfig"]

_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    """Shape of a Qwen3-Next model (names as in transformers)."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = dataclasses.field(default=None, compare=False)
    model_type: str = dataclasses.field(default="qwen3_next", init=False)

    def __post_init__(self):
        n = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "decoder_sparse_step"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise InvalidArgument(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                                  f"linear_num_key_heads ({self.linear_num_key_heads})")
        rot = self.rotary_dim
        if rot % 2 or not 0 < rot <= self.head_dim:
            raise InvalidArgument(f"head_dim * partial_rotary_factor = {rot} must be even and in (0, head_dim]")
        types = tuple(self.layer_types) or tuple(
            "linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n))
        if len(types) != n or any(t not in _LAYER_TYPES for t in types):
            raise InvalidArgument(f"layer_types must be {n} entries of {_LAYER_TYPES}, got {list(types)}")
        object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise InvalidArgument(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts "
                                  f"({self.num_experts})]")
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", () if eos is None else (int(eos),) if isinstance(eos, int)
                           else tuple(int(e) for e in eos))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: an MoE block unless ``layer`` is in
        ``mlp_only_layers``, there are no experts, or ``(layer + 1) %
        decoder_sparse_step != 0``."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **changes) -> Qwen3NextConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Qwen3NextConfig:
        d = dict(d)
        if d.get("model_type") != "qwen3_next":
            raise InvalidArgument(f"model_type {d.get('model_type')!r} is not qwen3_next")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise InvalidArgument(f"hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
        rope = d.get("rope_parameters") or {}
        scaling = rope.get("rope_type", "default") if rope else (d.get("rope_scaling") or {}).get("rope_type")
        if scaling not in (None, "default"):
            raise InvalidArgument(f"rope_type {scaling!r} is not supported for qwen3_next (default only)")
        n = int(d.get("num_hidden_layers", 48))
        types = d.get("layer_types")
        if types is None:
            interval = int(d.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        simple = {k: d[k] for k in fields if k in d and k not in (
            "layer_types", "mlp_only_layers", "eos_token_id", "rope_theta", "partial_rotary_factor", "torch_dtype")}
        dtype = d.get("torch_dtype", d.get("dtype"))
        return cls(**simple, layer_types=tuple(types), mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                   eos_token_id=d.get("eos_token_id"),
                   rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                   partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                        d.get("partial_rotary_factor", 0.25))),
                   torch_dtype=dtype if isinstance(dtype, str) else None)

    def to_hf(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("eos_token_id", "torch_dtype", "rope_theta", "partial_rotary_factor")}
        d.update(architectures=["Qwen3NextForCausalLM"], hidden_act="silu", layer_types=list(self.layer_types),
                 mlp_only_layers=list(self.mlp_only_layers),
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor},
                 eos_token_id=(self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)) or None)
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        return d
