"""Configuration of DeepSeek-V4 (``model_type`` ``"deepseek_v4"``), read from
a transformers ``config.json``.

:class:`DeepseekV4Config` is frozen and hashable (a static argument of
``jax.jit``). :meth:`DeepseekV4Config.from_hf` reads every field
transformers' ``DeepseekV4Config`` reads, with the same defaults and the same
folding of legacy fields older DeepSeek configs ship:

* ``compress_ratios`` (per layer 0 / 4 / 128) -> ``layer_types``
  (``sliding_attention`` / ``compressed_sparse_attention`` /
  ``heavily_compressed_attention``); with neither, transformers' default
  schedule (two HCA layers, then CSA and HCA alternating);
* ``compress_rate_csa`` / ``compress_rate_hca`` -> ``compress_rates``;
* ``num_hash_layers`` -> ``mlp_layer_types`` (that many ``hash_moe``, then
  ``moe``; default 3);
* ``qk_rope_head_dim`` -> ``partial_rotary_factor = qk_rope_head_dim / head_dim``;
* a flat ``rope_scaling`` / ``rope_parameters`` dict (e.g. YaRN) -> the two
  RoPEs: ``main`` (``rope_theta``, never scaled; sliding-window layers) and
  ``compress`` (``compress_rope_theta`` with the scaling, YaRN's attention
  factor forced to 1.0 as DeepSeek's reference does; CSA/HCA layers, their
  compressors and indexers).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxkv.errors import InvalidArgument

__all__ = ["DeepseekV4Config", "LAYER_TYPES", "MLP_LAYER_TYPES", "RopeParameters"]

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_SCORING = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """One RoPE of the model: ``rope_type`` ``"default"`` or ``"yarn"`` (with
    ``factor``, ``original_max_position_embeddings``, ``beta_fast``,
    ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``,
    ``truncate`` as transformers' YaRN reads them)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise InvalidArgument(f"rope_type {self.rope_type!r} is not supported for DeepSeek-V4 (default, yarn)")
        if not self.rope_theta > 0:
            raise InvalidArgument(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise InvalidArgument("yarn RoPE needs original_max_position_embeddings")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], theta: float) -> RopeParameters:
        kind = d.get("rope_type", d.get("type", "default")) or "default"
        opt = lambda k, f: None if d.get(k) is None else f(d[k])  # noqa: E731
        # ``truncate`` is not read: transformers' YaRN looks for it in the TOP-LEVEL rope_parameters, which for
        # DeepSeek-V4 holds only "main" / "compress", so it always truncates (as DeepSeek's own code does), even
        # when the compress dict says false (tests/fixtures/parity/dsv4_8 and dsv4_9 pin this).
        return cls(rope_type=kind, rope_theta=float(d.get("rope_theta", theta)), factor=opt("factor", float),
                   original_max_position_embeddings=opt("original_max_position_embeddings", int),
                   beta_fast=opt("beta_fast", float), beta_slow=opt("beta_slow", float),
                   attention_factor=opt("attention_factor", float), mscale=opt("mscale", float),
                   mscale_all_dim=opt("mscale_all_dim", float))

    def to_hf(self, partial_rotary_factor: float) -> dict:
        d = {"rope_type": self.rope_type, "rope_theta": self.rope_theta, "partial_rotary_factor": partial_rotary_factor}
        for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                  "mscale", "mscale_all_dim"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    def inv_freq(self, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
        """``([dim // 2] float32 inverse frequencies, cos/sin scaling)``,
        computed in float32 in transformers' order of operations."""
        exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        pos_freqs = np.float32(self.rope_theta) ** exponents
        if self.rope_type == "default":
            return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
        factor = self.factor
        if factor is None:
            factor = max_position_embeddings / self.original_max_position_embeddings

        def mscale_of(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = mscale_of(factor, self.mscale) / mscale_of(factor, self.mscale_all_dim)
            else:
                attention = mscale_of(factor)
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

        def correction_dim(rotations):
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.rope_theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation = np.float32(1.0) - ramp.astype(np.float32)
        inv_extra = np.float32(1.0) / pos_freqs
        inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
        inv = inv_inter * (np.float32(1.0) - extrapolation) + inv_extra * extrapolation
        return inv.astype(np.float32), float(attention)


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """Shape and schedule of a DeepSeek-V4 model (names as in transformers).

    One shared KV head (K == V) of ``head_dim``, whose last
    ``qk_rope_head_dim`` dims carry RoPE; ``layer_types[i]`` picks layer
    ``i``'s attention (sliding window only, CSA with rate
    ``compress_rates["compressed_sparse_attention"]``, HCA with rate
    ``compress_rates["heavily_compressed_attention"]``) and
    ``mlp_layer_types[i]`` its router (``hash_moe``: experts from
    ``tid2eid[token]``; ``moe``: top-k of the scores plus a correction bias).
    ``compress_rates`` is a tuple ``(csa, hca)``.
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    layer_types: tuple[str, ...] = ()
    compress_rates: tuple[int, int] = (4, 128)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: tuple[str, ...] = ()
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    partial_rotary_factor: float = 64 / 512
    rope_main: RopeParameters = RopeParameters(rope_theta=10000.0)
    rope_compress: RopeParameters = RopeParameters(rope_theta=160000.0)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    # Loading hints, not part of the model (configs differing here compare equal).
    torch_dtype: str | None = dataclasses.field(default=None, compare=False)
    quantization_config: str | None = dataclasses.field(default=None, compare=False)  # JSON text
    model_type: str = dataclasses.field(default="deepseek_v4", init=False)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        n = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
                     "hc_mult", "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
                     "index_head_dim", "index_topk"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_key_value_heads != 1:
            raise InvalidArgument(f"DeepSeek-V4 has one shared KV head; num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise InvalidArgument(f"num_experts_per_tok ({self.num_experts_per_tok}) > n_routed_experts "
                                  f"({self.n_routed_experts})")
        if self.scoring_func not in _SCORING:
            raise InvalidArgument(f"scoring_func {self.scoring_func!r} is not one of {_SCORING}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise InvalidArgument(f"num_attention_heads * head_dim ({self.num_attention_heads * self.head_dim}) is "
                                  f"not a multiple of o_groups ({self.o_groups})")
        rope = self.qk_rope_head_dim
        if rope % 2 or not 0 < rope <= min(self.head_dim, self.index_head_dim):
            raise InvalidArgument(f"qk_rope_head_dim = head_dim * partial_rotary_factor = {rope} must be even, > 0 and "
                                  f"<= head_dim ({self.head_dim}) and index_head_dim ({self.index_head_dim})")
        types = tuple(self.layer_types) or _default_layer_types(n)
        mlp = tuple(self.mlp_layer_types) or _default_mlp_types(n, 3)
        for name, got, allowed in (("layer_types", types, LAYER_TYPES), ("mlp_layer_types", mlp, MLP_LAYER_TYPES)):
            if len(got) < n:
                raise InvalidArgument(f"{name} has {len(got)} entries for num_hidden_layers={n}")
            bad = sorted({t for t in got[:n] if t not in allowed})
            if bad:
                raise InvalidArgument(f"{name} entries must be one of {allowed}; got {bad}")
        set_("layer_types", types[:n])
        set_("mlp_layer_types", mlp[:n])
        csa, hca = (int(r) for r in self.compress_rates)
        for kind, r in (("compressed_sparse_attention", csa), ("heavily_compressed_attention", hca)):
            if kind in self.layer_types and (r < 1 or 128 % r):
                raise InvalidArgument(f"compress rate of {kind} must divide 128 (jaxkv's block of original tokens), "
                                      f"got {r}")
        set_("compress_rates", (csa, hca))
        eos = self.eos_token_id
        set_("eos_token_id", () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos))

    # ------------------------------------------------------------- facts

    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, layer: int) -> int:
        """Layer ``layer``'s compression rate (0: sliding window only)."""
        kind = self.layer_types[layer]
        return {"sliding_attention": 0, "compressed_sparse_attention": self.compress_rates[0],
                "heavily_compressed_attention": self.compress_rates[1]}[kind]

    def replace(self, **changes) -> DeepseekV4Config:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------- HF conversion

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> DeepseekV4Config:
        """Read a transformers ``config.json`` dict (legacy fields folded in
        as transformers does; see the module docstring)."""
        d = dict(d)
        if d.get("model_type") != "deepseek_v4":
            raise InvalidArgument(f"model_type {d.get('model_type')!r} is not deepseek_v4")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise InvalidArgument(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise InvalidArgument(f"{flag}=True is not supported: DeepSeek-V4 has no biases")
        n = int(d.get("num_hidden_layers", 43))
        head_dim = int(d.get("head_dim", 512))
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_TYPE[int(r)] for r in d["compress_ratios"]]
            except (KeyError, TypeError, ValueError):
                raise InvalidArgument(f"compress_ratios entries must be 0, 4 or 128, got {d['compress_ratios']}") \
                    from None
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            mlp_types = _default_mlp_types(n, int(d.get("num_hash_layers", 3)))
        rates = dict(d.get("compress_rates") or {"compressed_sparse_attention": 4,
                                                  "heavily_compressed_attention": 128})
        if d.get("compress_rate_csa") is not None:
            rates["compressed_sparse_attention"] = int(d["compress_rate_csa"])
        if d.get("compress_rate_hca") is not None:
            rates["heavily_compressed_attention"] = int(d["compress_rate_hca"])
        partial = d.get("partial_rotary_factor")
        if partial is None:
            partial = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") is not None else 64 / 512
        rope_theta = float(d.get("rope_theta", 10000.0))
        compress_theta = float(d.get("compress_rope_theta", 160000.0))
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
            main = RopeParameters.from_hf(params["main"], rope_theta)
            compress = RopeParameters.from_hf(params["compress"], compress_theta)
        else:
            scaling = {k: v for k, v in params.items() if k not in ("main", "compress", "rope_theta",
                                                                      "partial_rotary_factor")}
            main = RopeParameters(rope_theta=rope_theta)
            compress = RopeParameters.from_hf({**scaling, "rope_theta": compress_theta}, compress_theta)
            if compress.rope_type == "yarn" and compress.attention_factor is None:
                compress = dataclasses.replace(compress, attention_factor=1.0)
        dtype = d.get("torch_dtype", d.get("dtype"))
        quant = d.get("quantization_config")
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        simple = {k: d[k] for k in fields if k in d and k not in (
            "layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_main",
            "rope_compress", "eos_token_id", "torch_dtype", "quantization_config")}
        return cls(**simple, layer_types=tuple(layer_types or ()), mlp_layer_types=tuple(mlp_types),
                   compress_rates=(int(rates.get("compressed_sparse_attention", 4)),
                                   int(rates.get("heavily_compressed_attention", 128))),
                   partial_rotary_factor=float(partial), rope_main=main, rope_compress=compress,
                   eos_token_id=d.get("eos_token_id", 1), torch_dtype=dtype if isinstance(dtype, str) else None,
                   quantization_config=None if quant is None else json.dumps(quant, sort_keys=True))

    def to_hf(self) -> dict:
        """A transformers ``config.json`` dict that :meth:`from_hf` (and
        transformers) read back to an equal config."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope_main", "rope_compress", "compress_rates", "eos_token_id", "quantization_config",
                               "layer_types", "mlp_layer_types", "torch_dtype")}
        d.update(architectures=["DeepseekV4ForCausalLM"], hidden_act="silu",
                 layer_types=list(self.layer_types), mlp_layer_types=list(self.mlp_layer_types),
                 compress_rates={"compressed_sparse_attention": self.compress_rates[0],
                                 "heavily_compressed_attention": self.compress_rates[1]},
                 rope_theta=self.rope_main.rope_theta, compress_rope_theta=self.rope_compress.rope_theta,
                 rope_parameters={"main": self.rope_main.to_hf(self.partial_rotary_factor),
                                  "compress": self.rope_compress.to_hf(self.partial_rotary_factor)},
                 eos_token_id=(self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)) or None)
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.quantization_config is not None:
            d["quantization_config"] = json.loads(self.quantization_config)
        return d


def _default_layer_types(n: int) -> tuple[str, ...]:
    """transformers' default: two HCA layers, then CSA and HCA alternating."""
    rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    return tuple(["heavily_compressed_attention"] * min(n, 2) + rest)


def _default_mlp_types(n: int, num_hash: int) -> tuple[str, ...]:
    return tuple(["hash_moe"] * min(n, num_hash) + ["moe"] * max(0, n - num_hash))
