"""Configuration of DeepSeek-V3 (``model_type`` ``"deepseek_v3"``), read from a
transformers ``config.json``.

Every field transformers' ``DeepseekV3Config`` reads, with its defaults. The
RoPE is one :class:`~jaxkv.nn.deepseek_v4_config.RopeParameters` (``rope_type``
``default`` or ``yarn``) over ``qk_rope_head_dim`` dims, from
``rope_parameters`` (transformers 5) or the older ``rope_theta`` +
``rope_scaling``. DeepSeek's own config fields ``scoring_func`` and
``topk_method`` are checked (transformers always routes with sigmoid scores
and group-limited top-k, ``noaux_tc``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from jaxkv.errors import InvalidArgument
from jaxkv.nn.deepseek_v4_config import RopeParameters

__all__ = ["DeepseekV3Config"]


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """Shape of a DeepSeek-V3 model (names as in transformers).

    Attention is multi-head latent attention: ``q`` through ``q_lora_rank``
    (None: one ``q_proj``), K/V from one latent of ``kv_lora_rank`` plus a
    shared RoPE key of ``qk_rope_head_dim``; per head ``qk_nope_head_dim +
    qk_rope_head_dim`` for q/k and ``v_head_dim`` for v. Layers below
    ``first_k_dense_replace`` have a dense MLP (``intermediate_size``), the
    rest routed experts (sigmoid scores, ``n_group`` groups of which the
    ``topk_group`` best by the sum of their top-2 scores are eligible,
    ``num_experts_per_tok`` experts, ``routed_scaling_factor``) plus
    ``n_shared_experts`` shared ones. ``rope_interleave``: the RoPE dims are
    interleaved pairs (DeepSeek's layout) rather than halves.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope: RopeParameters = RopeParameters(rope_theta=10000.0)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    torch_dtype: str | None = dataclasses.field(default=None, compare=False)
    quantization_config: str | None = dataclasses.field(default=None, compare=False)  # JSON text
    model_type: str = dataclasses.field(default="deepseek_v3", init=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "n_routed_experts", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                     "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise InvalidArgument(f"q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise InvalidArgument(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group or not self.topk_group <= self.n_group:
            raise InvalidArgument(f"n_routed_experts ({self.n_routed_experts}) must split into n_group "
                                  f"({self.n_group}) groups and topk_group ({self.topk_group}) <= n_group")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2 or self.num_experts_per_tok > self.topk_group * per_group:
            raise InvalidArgument(f"group routing needs >= 2 experts per group and num_experts_per_tok "
                                  f"({self.num_experts_per_tok}) <= topk_group * experts per group "
                                  f"({self.topk_group * per_group})")
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", () if eos is None else (int(eos),) if isinstance(eos, int)
                           else tuple(int(e) for e in eos))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale: ``qk_head_dim ** -0.5``, times ``mscale**2`` under
        YaRN with ``mscale_all_dim`` (``mscale = 0.1 * mscale_all_dim *
        ln(factor) + 1``), as DeepSeek and transformers compute it."""
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            factor = r.factor or self.max_position_embeddings / r.original_max_position_embeddings
            if factor > 1:
                m = 0.1 * r.mscale_all_dim * math.log(factor) + 1.0
                scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def replace(self, **changes) -> DeepseekV3Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> DeepseekV3Config:
        """Read a transformers ``config.json`` dict."""
        d = dict(d)
        if d.get("model_type") != "deepseek_v3":
            raise InvalidArgument(f"model_type {d.get('model_type')!r} is not deepseek_v3")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise InvalidArgument(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise InvalidArgument(f"scoring_func {d.get('scoring_func')!r} / topk_method {d.get('topk_method')!r}: "
                                  f"DeepSeek-V3 routes with sigmoid scores and noaux_tc")
        theta = float(d.get("rope_theta", 10000.0))
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope = RopeParameters.from_hf({**params, "rope_theta": params.get("rope_theta", theta)}, theta)
        # transformers' YaRN reads `truncate` (default True: the correction range rounded to whole dims).
        rope = dataclasses.replace(rope, truncate=bool(params.get("truncate", True)))
        dtype = d.get("torch_dtype", d.get("dtype"))
        quant = d.get("quantization_config")
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        simple = {k: d[k] for k in fields if k in d and k not in ("rope", "eos_token_id", "torch_dtype",
                                                                    "quantization_config")}
        return cls(**simple, rope=rope, eos_token_id=d.get("eos_token_id", 1),
                   torch_dtype=dtype if isinstance(dtype, str) else None,
                   quantization_config=None if quant is None else json.dumps(quant, sort_keys=True))

    def to_hf(self) -> dict:
        """A transformers ``config.json`` dict :meth:`from_hf` reads back equal."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope", "eos_token_id", "quantization_config", "torch_dtype")}
        d.update(architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
                 rope_parameters={**self.rope.to_hf(1.0), **({} if self.rope.truncate else {"truncate": False})},
                 rope_theta=self.rope.rope_theta,
                 eos_token_id=(self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)) or None)
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.quantization_config is not None:
            d["quantization_config"] = json.loads(self.quantization_config)
        return d
