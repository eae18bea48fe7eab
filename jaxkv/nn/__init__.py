"""Flax NNX models over the paged KV cache.

* :class:`LlamaConfig`: Llama / Mistral / Qwen2 / Qwen3 configuration, read
  from a Hugging Face ``config.json``.
* :class:`LlamaForCausalLM`: the causal LM; ``model(tokens, positions, pool,
  slots, block_tables, starts, num_new, mode=...)`` runs a prefill or decode
  step over a :class:`~jaxkv.KVPool`; ``from_pretrained(dir)`` loads a local
  Hugging Face checkpoint (``config.json`` + ``*.safetensors``).
* :class:`PagedAttention`: the attention layer (writes K/V into the pool,
  attends through block tables; GQA, RoPE incl. Llama 3 scaling, q/k norm,
  sliding window).
* :func:`paged_prefill_attention`: pure-``jnp`` prefill attention over the
  pages (the decode counterpart is :func:`jaxkv.paged_decode_attention`).
* :func:`generate`: prefill, then decoding in one jitted ``lax.while_loop``
  with block allocation on device (greedy, temperature, top-k, top-p).
* :class:`Engine`: continuous batching (host scheduler, jitted prefill and
  multi-step decode chunks, prefix-cache hits, preemption by swap or
  recompute).
* :func:`sample_n`, :func:`beam_search`: one prefill, then ``fork`` and
  copy-on-write inside the jitted loop (parallel sampling, beam search).
"""

from jaxkv.nn.attention import PagedAttention, RMSNorm, paged_prefill_attention, set_attention_fns
from jaxkv.nn.config import LlamaConfig, RopeScaling
from jaxkv.nn.engine import Engine, EngineSummary
from jaxkv.nn.generate import GenerateOutput, SamplingParams, generate
from jaxkv.nn.llama import LlamaForCausalLM
from jaxkv.nn.parallel import beam_search, sample_n
from jaxkv.nn.rope import apply_rope, rope_inv_freq

__all__ = [
    "Engine",
    "EngineSummary",
    "GenerateOutput",
    "SamplingParams",
    "generate",
    "sample_n",
    "beam_search",
    "LlamaConfig",
    "LlamaForCausalLM",
    "PagedAttention",
    "RMSNorm",
    "RopeScaling",
    "apply_rope",
    "paged_prefill_attention",
    "rope_inv_freq",
    "set_attention_fns",
]
