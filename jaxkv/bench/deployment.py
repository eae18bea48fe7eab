"""``python -m jaxkv.bench deployment``: what one device holds when a real-size
model of each family serves 128k-token sequences from a mesh, by the
placement rules of :mod:`jaxkv.nn.sharding`.

Nothing is allocated and no device is needed: each model is built with
``nnx.eval_shape`` (bf16 parameters) and its cache with ``jax.eval_shape``;
the specs come from :func:`jaxkv.nn.sharding.placement_report` and
:func:`jaxkv.nn.sharding.cache_sharding` on a ``jax.sharding.AbstractMesh``
of the deployment's axis sizes (they read only the axis sizes), so a
64-device mesh is sized on a laptop.

Per row:

* ``weights_gb``: parameter bytes one device holds (a split leaf counts
  ``1/parts`` of its bytes, a replicated leaf all of them).
* ``kv_gb``: the bytes one more sequence of ``context`` tokens adds to one
  device's cache: ``bytes(cache for 2 sequences) - bytes(cache for 1)``,
  each leaf divided as its sharding divides it (blocks, table rows, rings
  and recurrent states; the null page is not counted).
* ``seqs``: ``floor((USABLE * H100_BYTES - weights) / kv)`` sequences of
  ``context`` tokens per device: an 80 GB H100 of which 90 % goes to
  weights and KV, the rest left to activations, XLA's workspace and the
  CUDA context (JAX itself preallocates 75 % unless
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise). 0 when the weights
  alone do not fit.
* ``kv_split``: the share of ``kv_gb``'s global bytes that the mesh splits
  (the rest is replicated on every device).
* ``notes``: why KV stays whole on every device (KV heads the ``tp`` axis
  does not divide, e.g. 8 at ``tp=16``; one MLA latent head; DeepSeek-V4's
  latent entries, replicated by design), how many ways an ``expert`` axis
  splits the experts (together with ``tp``), and any parameter the rules
  would split but whose dimension the axis does not divide.

Sizes are each checkpoint's published ``config.json`` on the Hugging Face
Hub (bf16 weights everywhere, although DeepSeek-V3 ships fp8 and gpt-oss
MXFP4 experts). DeepSeek-V4 is the V4-Flash-like model the repository's
hybrid benchmark uses: :class:`~jaxkv.nn.DeepseekV4Config`'s defaults (which
are transformers' ``DeepseekV4Config`` defaults: 43 layers, hidden 4096, 64
query heads of 512 dims, 256 routed experts of 2048, top-6) with
:func:`~jaxkv.manager.hybrid_schema.v4_flash_like_ratios` (2 SWA layers,
then CSA / HCA alternating) and DeepSeek-V4's fp8 entries: 284B parameters,
V4-Flash's published total, but not checked against its ``config.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from jaxkv.bench._timing import print_json, print_table
from jaxkv.manager.hybrid_schema import v4_flash_like_ratios
from jaxkv.nn import (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM, Gemma3Config,
                      Gemma3ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM,
                      Qwen3NextConfig, Qwen3NextForCausalLM)
from jaxkv.nn.packed import cache_kind
from jaxkv.nn.sharding import cache_sharding, placement_report

__all__ = ["DEPLOYMENTS", "H100_BYTES", "HF_CONFIGS", "USABLE", "deployment_rows", "main", "model_and_cache"]

CONTEXT = 131072
PAGE_SIZE = 16
H100_BYTES = 80 * 10**9  # an "80 GB" H100: the marketing GB
USABLE = 0.9  # of it for weights + KV; the rest for activations, workspace, CUDA context
GB = 10**9

_LLAMA_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "original_max_position_embeddings": 4096, "truncate": False}


def _gpt_oss(layers: int, experts: int) -> dict:
    return dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                num_local_experts=experts, num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                layer_types=["sliding_attention", "full_attention"] * (layers // 2), rope_theta=150000.0,
                rope_scaling=_GPT_OSS_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5,
                tie_word_embeddings=False)


#: The published ``config.json`` of each checkpoint (the keys the family's
#: ``Config.from_hf`` reads; Gemma 3 27B: the ``text_config`` of
#: google/gemma-3-27b-it). DeepSeek-V4: see the module docstring.
HF_CONFIGS = {
    "Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_scaling=_LLAMA_ROPE, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False),
    "Llama-3.1-70B": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          rms_norm_eps=1e-5, rope_scaling=_LLAMA_ROPE, rope_theta=500000.0,
                          max_position_embeddings=131072, tie_word_embeddings=False),
    "DeepSeek-V3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
                        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                        scoring_func="sigmoid", topk_method="noaux_tc", tie_word_embeddings=False),
    # DeepseekV4Config's defaults (43 layers, hidden 4096, ...) on hybrid.py's V4-Flash-like schedule.
    "DeepSeek-V4-Flash-like": dict(model_type="deepseek_v4", compress_ratios=v4_flash_like_ratios()),
    "Qwen3-Next-80B-A3B": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               partial_rotary_factor=0.25, rope_theta=10000000.0, linear_conv_kernel_dim=4,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512,
                               norm_topk_prob=True, mlp_only_layers=[], full_attention_interval=4,
                               max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "gpt-oss-120b": _gpt_oss(36, 128),
    "gpt-oss-20b": _gpt_oss(24, 32),
    "Gemma-3-27B": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        query_pre_attn_scalar=168, sliding_window=1024, sliding_window_pattern=6,
                        rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, final_logit_softcapping=None, attn_logit_softcapping=None,
                        tie_word_embeddings=True),
}

#: The MoE giants: only they get the four-node and expert-axis meshes.
_GIANTS = ("DeepSeek-V3", "DeepSeek-V4-Flash-like", "gpt-oss-120b")


@dataclasses.dataclass(frozen=True)
class Deployment:
    """A mesh shape: ``axes`` ``((name, size), ...)`` on ``where``; ``only``:
    the families it is shown for (None: all)."""

    name: str
    axes: tuple[tuple[str, int], ...]
    where: str
    only: tuple[str, ...] | None = None

    @property
    def devices(self) -> int:
        return math.prod(size for _, size in self.axes)

    def mesh(self) -> AbstractMesh:
        return AbstractMesh(tuple(s for _, s in self.axes), tuple(n for n, _ in self.axes))


DEPLOYMENTS = (
    Deployment("tp=1", (("tp", 1),), "one GPU"),
    Deployment("tp=8", (("tp", 8),), "one 8-GPU node"),
    Deployment("tp=16", (("tp", 16),), "two nodes"),
    Deployment("tp=32", (("tp", 32),), "four nodes", only=_GIANTS),
    Deployment("tp=8 x expert=8", (("tp", 8), ("expert", 8)), "eight nodes", only=_GIANTS),
)


def _build(name: str, scan_layers: bool | None = None) -> Callable[[], object]:
    """A constructor of the model ``name`` in bf16 (call under ``nnx.eval_shape``);
    ``scan_layers`` as the models take it."""
    raw = HF_CONFIGS[name]
    config_cls, cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                       "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
                       "deepseek_v4": (DeepseekV4Config, DeepseekV4ForCausalLM),
                       "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
                       "gpt_oss": (GptOssConfig, GptOssForCausalLM),
                       "gemma3_text": (Gemma3Config, Gemma3ForCausalLM)}[raw["model_type"]]
    config = config_cls.from_hf(raw)
    return lambda: cls(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                       scan_layers=scan_layers)


def model_and_cache(name: str, context: int = CONTEXT, *, scan_layers: bool | None = None):
    """``(abstract model, cache_for)``: the bf16 model ``name`` of
    :data:`HF_CONFIGS` as shapes (``scan_layers`` as the models take it),
    and ``cache_for(n)`` its abstract cache for ``n`` sequences of
    ``context`` tokens (a paged pool of ``n * ceil(context / 16) + 1``
    pages, or the hybrid cache of ``n`` requests; DeepSeek-V4 in its fp8
    entries)."""
    model = nnx.eval_shape(_build(name, scan_layers))
    if cache_kind(model) == "paged":
        pages = -(-context // PAGE_SIZE)
        return model, lambda n: jax.eval_shape(lambda: model.make_pool(n * pages + 1, PAGE_SIZE,
                                                                       dtype=jnp.bfloat16))
    # DeepSeek-V4 in the fp8 entries it is designed for (as bench hybrid); the others in bf16 (the compute dtype).
    fmt = "fp8" if HF_CONFIGS[name]["model_type"] == "deepseek_v4" else "lossless"
    return model, lambda n: jax.eval_shape(lambda: model.make_cache(n, context, entry_format=fmt))


def _leaf_bytes(leaf) -> int:
    return int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize


def _unit(mesh: AbstractMesh) -> AbstractMesh:
    """The mesh of the same axes, each of size 1: every leaf the rules split
    is split there (any size divides by 1), so it tells which leaves a
    bigger mesh keeps whole only because its axis does not divide them."""
    return AbstractMesh((1,) * len(mesh.axis_names), mesh.axis_names)


def _cache_bytes(cache, mesh: AbstractMesh) -> tuple[float, int, int, set[int]]:
    """``(bytes on one device, global bytes, global bytes the mesh splits,
    sizes of the axes the rules would split but the mesh does not divide)``."""
    leaves = jax.tree_util.tree_leaves_with_path(cache)
    specs = [s.spec for s in jax.tree.leaves(cache_sharding(cache, mesh))]
    unit_specs = [s.spec for s in jax.tree.leaves(cache_sharding(cache, _unit(mesh)))]
    per_device, total, split, undivided = 0.0, 0, 0, set()
    for (_, leaf), spec, unit_spec in zip(leaves, specs, unit_specs, strict=True):
        size = _leaf_bytes(leaf)
        parts = math.prod(mesh.shape[a] for a in spec if a is not None)
        per_device += size / parts
        total += size
        split += size if parts > 1 else 0
        if parts == 1 and size and any(a is not None for a in unit_spec):
            undivided.add(next(leaf.shape[i] for i, a in enumerate(unit_spec) if a is not None))
    return per_device, total, split, undivided


def _notes(dep: Deployment, kv_split: float, undivided: set[int], unsplit_params: list[str]) -> str:
    """Why a row keeps something whole on every device."""
    if dep.devices == 1:
        return ""
    axes, notes = dict(dep.axes), []
    if kv_split < 0.999:
        if undivided == {1}:
            notes.append("KV whole: one MLA latent head")
        elif undivided:
            notes.append(f"KV whole: {'/'.join(map(str, sorted(undivided)))} KV heads, tp={axes.get('tp', 1)}")
        else:
            notes.append("KV whole: latent entries")
    if "expert" in axes:
        notes.append(f"experts over expert x tp ({axes['expert'] * axes.get('tp', 1)}-way)")
    if unsplit_params:
        notes.append(f"{', '.join(unsplit_params)} whole")
    return "; ".join(notes)


def deployment_rows(context: int = CONTEXT, models=None) -> list[dict]:
    """One row per (family, deployment): parameters, weights, KV bytes of
    one ``context``-token sequence and such sequences that fit, per device
    (module docstring). ``models``: names of :data:`HF_CONFIGS` (default all)."""
    rows = []
    budget = USABLE * H100_BYTES
    for name in models or HF_CONFIGS:
        model, cache_for = model_and_cache(name, context)
        one, two = cache_for(1), cache_for(2)
        params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(model)))
        for dep in DEPLOYMENTS:
            if dep.only is not None and name not in dep.only:
                continue
            mesh = dep.mesh()
            report, unit_report = placement_report(model, mesh), placement_report(model, _unit(mesh))
            dev1, tot1, split1, undivided = _cache_bytes(one, mesh)
            dev2, tot2, split2, _ = _cache_bytes(two, mesh)
            kv, kv_split = dev2 - dev1, (split2 - split1) / (tot2 - tot1)
            weights = report["bytes_per_device"]
            unsplit = sorted({path.split("/")[-2] for path in unit_report["split"] if path not in report["split"]})
            rows.append({"model": name, "mesh": dep.name, "where": dep.where, "devices": dep.devices,
                         "params_b": params / 1e9, "weights_gb": weights / GB, "kv_gb": kv / GB,
                         "kv_bytes_per_token": kv / context, "kv_split": kv_split,
                         "seqs": max(int((budget - weights) // kv), 0),
                         "notes": _notes(dep, kv_split, undivided, unsplit)})
    return rows


def main(args=None) -> int:
    """Print the table; ``args``: the namespace of ``python -m jaxkv.bench``
    (``--json``: end with one JSON line of the rows; ``--quick``: the two
    Llamas only) or an argument list (also ``--context N``)."""
    if args is None or isinstance(args, list):
        parser = argparse.ArgumentParser(prog="python -m jaxkv.bench.deployment", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--json", action="store_true", help="end with one JSON line of the rows")
        parser.add_argument("--quick", action="store_true", help="the two Llamas only")
        parser.add_argument("--context", type=int, default=CONTEXT, help="tokens of the one sequence")
        args = parser.parse_args(args)
    context = getattr(args, "context", CONTEXT)
    rows = deployment_rows(context, ("Llama-3.1-8B", "Llama-3.1-70B") if args.quick else None)
    print_table(f"Per device: bf16 weights and one {context}-token sequence's KV; seqs = such sequences that fit "
                f"in {USABLE:.0%} of an {H100_BYTES // GB} GB H100 after the weights (shapes only: nothing "
                f"allocated)",
                ["model", "mesh", "devices", "params (B)", "weights GB", "KV GB/seq", "KV split", "seqs",
                 "notes"],
                [[r["model"], r["mesh"], r["devices"], r["params_b"], r["weights_gb"], r["kv_gb"],
                  f"{r['kv_split']:.0%}", r["seqs"], r["notes"]] for r in rows])
    if args.json:
        print_json({"benchmark": "deployment", "context": context, "device_bytes": H100_BYTES, "usable": USABLE,
                    "results": rows})
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
