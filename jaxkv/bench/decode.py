"""``python -m jaxkv.bench decode``: tokens/s of a decode loop over the paged
cache, against a contiguous cache and against a per-step host loop.

One small random Llama model (float32, same weights everywhere), prompts of
128 random tokens, 64 greedy decode steps with no EOS (every row runs every
step), at batch 1, 8 and 32 (``--quick``: 16 tokens, 8 steps, batch 2). Three ways to decode, timed in one run, interleaved, prefill and
compilation excluded:

* **paged**: ``jaxkv.nn.generate``'s machinery: ``prefill`` once, then
  ``decode_loop`` (one jitted ``lax.while_loop``; each step
  ``BlockSpaceManager.append_slots`` on device, K/V written into the
  ``KVPool`` through the model, attention through the block tables, greedy
  sample, ``free`` of finished rows);
* **contiguous**: the same model on a contiguous ``[B, max_len, KVH, D]``
  K/V cache per layer, written here: a jitted ``lax.scan`` over the steps that
  calls the model's own submodules (norms, q/k/v/o projections and RoPE via
  ``PagedAttention.qkv``, MLP, final norm and ``lm_head`` via the model's
  ``logits_from_hidden``), writes each new token's K/V with ``.at[rows, position].set``
  and attends with ``jaxkv.dense_decode_attention``. ``max_len`` equals the paged side's
  ``max_blocks * page_size``, so both attend over the same number of
  positions;
* **per-step**: the paged path driven from the host, one jitted
  ``decode_step`` per token, checking ``finished`` after each like
  ``generate(per_step=True)``.

The benchmark checks that all three produce the same greedy tokens (the
contiguous side has its own prefill, so the whole contiguous path is checked)
and raises on a mismatch. Each timed run starts from a fresh copy of the
post-prefill state (the loops donate their state; the copy is not timed).
Figures are the minimum over the repeats, the three ways interleaved.

On CPU the benchmark runs jitted calls inline, as the prefix benchmark does
(``JAXKV_ASYNC_DISPATCH=1`` keeps JAX's default), which favours the per-step
host loop.
"""

from __future__ import annotations

import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.reference import dense_decode_attention
from jaxkv.bench._timing import inline_cpu_dispatch, machine_description, print_json, print_table
from jaxkv._ops import ceil_div
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn.attention import causal_attention
from jaxkv.nn.config import LlamaConfig
from jaxkv.nn.generate import prefill
from jaxkv.nn.sampling import GREEDY
from jaxkv.nn.steps import decode_loop, decode_step
from jaxkv.nn.llama import LlamaForCausalLM

__all__ = ["CONFIG", "CONTIGUOUS_ATTENTION", "NEAR_TIE", "NEAR_TIE_BF16", "QUICK_CONFIG", "cache_dtype_attention",
           "check_same_greedy", "contiguous_decode", "contiguous_prefill", "main", "measure", "per_step_loop"]

CONFIG = LlamaConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
)
PAGE_SIZE = 16
NO_EOS = np.int32(-1)


QUICK_CONFIG = CONFIG.replace(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def model_description(c: LlamaConfig = CONFIG) -> str:
    return (f"random Llama: hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads} heads, "
            f"{c.num_key_value_heads} KV heads, head_dim {c.head_dim}, MLP {c.intermediate_size}, "
            f"vocab {c.vocab_size}, float32")


# --------------------------------------------------------------------------
# The contiguous-cache baseline.
# --------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("graphdef", "max_len"))
def contiguous_prefill(graphdef, params, prompts, lengths, *, max_len: int):
    """Prompts ``[B, T]`` (row ``b`` holds ``lengths[b]`` tokens) through the
    model with K/V kept in per-layer ``[B, max_len, KVH, D]`` caches. Returns
    ``(caches, first)``: a tuple of ``(k, v)`` per layer and the greedy first
    new token ``[B]``, and that token's margin (see ``_greedy``)."""
    model = nnx.merge(graphdef, params)
    batch, width = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    valid = positions < lengths[:, None]
    x = model.embed_tokens(prompts)
    caches = []
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), positions)
        shape = (batch, max_len, attn.num_kv_heads, attn.head_dim)
        k_cache = jax.lax.dynamic_update_slice(jnp.zeros(shape, k.dtype), k, (0, 0, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(jnp.zeros(shape, v.dtype), v, (0, 0, 0, 0))
        out = causal_attention(q, k_cache, v_cache, positions, valid, lengths, sm_scale=attn.sm_scale,
                               sliding_window=attn.sliding_window)
        x = x + attn.out(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        caches.append((k_cache, v_cache))
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    first, margin = _greedy(model.logits_from_hidden(last)[:, 0])
    return tuple(caches), first, margin


def _greedy(logits):
    """Greedy tokens ``[B]`` and how far each won by: ``(top1 - top2) /
    max(1, |top1|)`` (a margin near zero is a near-tie another summation
    order may flip)."""
    top, _ = jax.lax.top_k(logits, 2)
    margin = (top[:, 0] - top[:, 1]) / jnp.maximum(1.0, jnp.abs(top[:, 0]))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), margin


#: ``contiguous_decode``'s attention: ``"reference"``, :func:`jaxkv.dense_decode_attention` (K/V
#: converted to float32, products at the highest precision: the exact core the kernels are checked
#: against); ``"cache_dtype"``, :func:`cache_dtype_attention` (K/V read in the cache's own dtype,
#: float32 accumulation: what a contiguous-cache server writes, the fair speed baseline at real sizes).
CONTIGUOUS_ATTENTION = ("reference", "cache_dtype")


def cache_dtype_attention(q, k, v, lengths, *, sm_scale: float, sliding_window=None, heads_first: bool = False):
    """Decode attention over contiguous ``k``/``v`` ``[B, S, KVH, D]``
    (``heads_first``: ``[B, KVH, S, D]``) read in their own dtype
    (bfloat16 at real sizes), as a flash-decoding kernel computes it: the
    scores are ``q . k`` accumulated in float32, times ``sm_scale``;
    positions at or past a row's ``lengths`` (or before its window) are
    masked in the scores; the softmax is float32, and the weighted sum of
    ``v`` takes the probabilities in ``v``'s dtype with float32
    accumulation. ``q [B, H, D]`` (query head ``i`` reads KV head ``i //
    (H / KVH)``); returns ``[B, H, Dv]`` in ``q.dtype``. Every row must hold at least one position (decode does),
    and masked positions finite values (a zero weight times NaN is NaN: the
    reference zeroes them first; the caches timed here are gathered from a
    pool, whose unwritten pages are zeros)."""
    if heads_first:
        b, kvh, s, dk = k.shape
    else:
        b, s, kvh, dk = k.shape
    kv = "bksd" if heads_first else "bskd"
    h = q.shape[1]
    qg = q.astype(k.dtype).reshape(b, kvh, h // kvh, dk)
    scores = jnp.einsum(f"bkgd,{kv}->bkgs", qg, k, preferred_element_type=jnp.float32) * sm_scale
    pos = jnp.arange(s, dtype=jnp.int32)[None, :]
    length = lengths.astype(jnp.int32)[:, None]
    valid = pos < length
    if sliding_window is not None:
        valid &= pos >= length - sliding_window
    probs = jax.nn.softmax(jnp.where(valid[:, None, None, :], scores, -jnp.inf), axis=-1)
    out = jnp.einsum(f"bkgs,{kv}->bkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, h, v.shape[-1]).astype(q.dtype)


@partial(jax.jit, static_argnames=("graphdef", "steps", "with_margins", "attention", "heads_first"),
         donate_argnums=(2,))
def contiguous_decode(graphdef, params, caches, first, lengths, *, steps: int, with_margins: bool = False,
                      attention: str = "reference", heads_first: bool = False):
    """``steps`` greedy decode steps in one ``lax.scan`` over the contiguous
    caches (donated: written in place), ``(k, v)`` per layer, each ``[B,
    max_len, KVH, D]`` or with ``heads_first`` ``[B, KVH, max_len, D]``
    (the layout XLA:GPU gives the attention's products: in the other one a
    deviceless H100 compile at Llama-3.1-8B's shapes, batch 64, copies the
    whole 18 GB of caches into that layout and back on every call; with
    it, 0.03 GB of temporaries). ``first [B]`` is the token to feed,
    ``lengths [B]`` the tokens each row holds. Returns ``(caches, tokens
    [B, steps])``, and with ``with_margins`` (an untimed checking run) also
    each token's winning margin ``[B, steps]`` (see ``_greedy``).
    ``attention``: one of :data:`CONTIGUOUS_ATTENTION`."""
    if attention not in CONTIGUOUS_ATTENTION:
        raise ValueError(f"attention={attention!r}: one of {CONTIGUOUS_ATTENTION}")
    model = nnx.merge(graphdef, params)
    rows = jnp.arange(first.shape[0])

    def step(carry, _):
        caches, last, lengths = carry
        positions = lengths  # the new token's position
        x = model.embed_tokens(last[:, None])
        written = []
        for layer, (k_cache, v_cache) in zip(model.layers, caches):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), positions[:, None])
            if heads_first:
                k_cache = k_cache.at[rows, :, positions].set(k[:, 0].astype(k_cache.dtype))
                v_cache = v_cache.at[rows, :, positions].set(v[:, 0].astype(v_cache.dtype))
            else:
                k_cache = k_cache.at[rows, positions].set(k[:, 0].astype(k_cache.dtype))
                v_cache = v_cache.at[rows, positions].set(v[:, 0].astype(v_cache.dtype))
            if attention == "reference":  # (the reference core takes [B, S, KVH, D])
                k_seq, v_seq = (k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2)) if heads_first else (k_cache, v_cache)
                out = dense_decode_attention(q[:, 0], k_seq, v_seq, positions + 1, sm_scale=attn.sm_scale,
                                             sliding_window=attn.sliding_window)
            else:
                out = cache_dtype_attention(q[:, 0], k_cache, v_cache, positions + 1, sm_scale=attn.sm_scale,
                                            sliding_window=attn.sliding_window, heads_first=heads_first)
            x = x + attn.out(out[:, None])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            written.append((k_cache, v_cache))
        new, margin = _greedy(model.logits_from_hidden(x)[:, 0])
        return (tuple(written), new, lengths + 1), (new, margin)

    (caches, _, _), (tokens, margins) = jax.lax.scan(step, (caches, first, lengths.astype(jnp.int32)), None,
                                                     length=steps)
    return (caches, tokens.T, margins.T) if with_margins else (caches, tokens.T)


# --------------------------------------------------------------------------
# The measurement.
# --------------------------------------------------------------------------


def _copy(tree):
    return jax.block_until_ready(jax.tree.map(lambda x: x.copy(), tree))


def per_step_loop(graphdef, params, state):
    """``generate(per_step=True)``'s loop: one jitted ``decode_step`` per
    token, the host checking whether any row still runs after each."""
    while bool(jnp.any(~state.finished)) and bool(state.ok):
        state = decode_step(graphdef, params, state, GREEDY)
    return state


def best_seconds_with_setup(cases: dict, repeats: int) -> dict[str, float]:
    """Minimum wall time of ``run(setup())`` per case over ``repeats`` rounds,
    the cases interleaved; ``setup`` (a fresh copy of donated inputs) is not
    timed. Returns ``{name: seconds}`` and keeps the last result of each case
    in ``cases[name]["last"]``."""
    best = {name: float("inf") for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            args = case["setup"]()
            start = time.perf_counter()
            out = jax.block_until_ready(case["run"](args))
            best[name] = min(best[name], time.perf_counter() - start)
            case["last"] = out
    return best


#: A greedy pick may differ between two exact attention implementations only
#: where the reference's top two logits were this close (relative to the top
#: logit): float32 summation order (split-K, online softmax) and XLA's TF32
#: projections on GPU move logits by ~1e-4 of their scale. A random model's
#: logits are flat, so among thousands of tokens a few such near-ties occur;
#: a wrong cache or table splits rows at large margins, and at once.
NEAR_TIE = 2e-3
#: The same for a bfloat16 model (``bench real_scale``'s): its activations and
#: logits are rounded to bfloat16, whose spacing is 2**-8 (3.9e-3) of a value,
#: so two logits a few spacings apart swap under any change of rounding
#: upstream. Four spacings: the tiny bf16 shape split paged from reference
#: rows at 5.7e-3 and 6.1e-3 on two of six seeds (both of them bf16 roundings
#: of the reference's float32 attention); a wrong cache or table still splits
#: at once, at large margins.
NEAR_TIE_BF16 = 2**-6


def check_same_greedy(ours: np.ndarray, reference: np.ndarray, margins: np.ndarray, what: str,
                      near_tie: float = NEAR_TIE) -> list:
    """Raise unless every row of ``ours`` equals ``reference`` ``[B, T]`` up
    to its first difference, and that difference is at a near-tie of the
    reference (``margins`` below ``near_tie``: :data:`NEAR_TIE` for a
    float32 model, :data:`NEAR_TIE_BF16` for a bfloat16 one; the tokens
    after it follow another history and are not compared). Returns ``(row,
    step, margin)`` per row split at a near-tie."""
    near_ties = []
    for row in np.nonzero((ours != reference).any(axis=1))[0]:
        step = int(np.argmax(ours[row] != reference[row]))
        margin = float(margins[row, step])
        if margin > near_tie:
            raise AssertionError(
                f"{what} greedy tokens differ ({int(np.sum(ours != reference))} of {ours.size}); row {row} first "
                f"at step {step}: {ours[row, step]} vs {reference[row, step]}, where the reference's top two "
                f"logits were {margin:.2e} apart (relative), more than a rounding flip ({near_tie:.0e})")
        near_ties.append((int(row), step, margin))
    return near_ties


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> str:
    rows, cols = np.nonzero(a != b)
    return f"first at row {rows[0]}, step {cols[0]}: {a[rows[0], cols[0]]} vs {b[rows[0], cols[0]]}"


def measure(model: LlamaForCausalLM, batch: int, prompt_len: int, steps: int, repeats: int, rng) -> dict:
    graphdef, params = nnx.split(model)
    max_new = steps + 1  # prefill samples token 0, then ``steps`` decode steps
    max_blocks = ceil_div(prompt_len + max_new, PAGE_SIZE)  # as generate sizes it
    num_pages = batch * max_blocks + 1
    prompts = jnp.asarray(rng.integers(1, model.config.vocab_size, size=(batch, prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)

    # Paged: generate's prefill, once; each timed run decodes from a copy.
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=PAGE_SIZE,
                                       max_seqs=batch, max_blocks_per_seq=max_blocks)
    state = prefill(graphdef, params, manager, model.make_pool(num_pages, PAGE_SIZE), prompts, lengths,
                    jax.random.key(0), NO_EOS, GREEDY, max_new=max_new)
    if not bool(state.ok):
        raise RuntimeError("prefill could not allocate the prompts' blocks")
    state = _copy(state)

    # Contiguous: its own prefill into caches of the paged side's attended width.
    caches, first, first_margin = contiguous_prefill(graphdef, params, prompts, lengths,
                                                     max_len=max_blocks * PAGE_SIZE)
    caches = _copy(caches)

    cases = {
        "paged": {"setup": lambda: _copy(state),
                  "run": lambda s: decode_loop(graphdef, params, s, GREEDY)},
        "contiguous": {"setup": lambda: _copy(caches),
                       "run": lambda c: contiguous_decode(graphdef, params, c, first, lengths, steps=steps)},
        "per-step": {"setup": lambda: _copy(state),
                     "run": lambda s: per_step_loop(graphdef, params, s)},
    }
    for case in cases.values():  # compile (and warm up) outside the timing
        jax.block_until_ready(case["run"](case["setup"]()))
    best = best_seconds_with_setup(cases, repeats)

    paged_state, per_step_state = cases["paged"]["last"], cases["per-step"]["last"]
    for name, s in (("paged", paged_state), ("per-step", per_step_state)):
        if not bool(s.ok) or int(s.step) != max_new or not bool(jnp.all(s.num_generated == max_new)):
            raise RuntimeError(f"{name} loop ran {int(s.step) - 1} steps, expected {steps} (ok={bool(s.ok)})")
    paged_tokens = np.asarray(paged_state.tokens)
    contiguous_tokens = np.concatenate([np.asarray(first)[:, None], np.asarray(cases["contiguous"]["last"][1])], 1)
    per_step_tokens = np.asarray(per_step_state.tokens)
    # An untimed checking run gives each contiguous token's winning margin.
    _, _, margins = contiguous_decode(graphdef, params, _copy(caches), first, lengths, steps=steps,
                                      with_margins=True)
    margins = np.concatenate([np.asarray(first_margin)[:, None], np.asarray(margins)], 1)
    near_ties = check_same_greedy(paged_tokens, contiguous_tokens, margins, f"batch {batch}: paged and contiguous")
    if not np.array_equal(paged_tokens, per_step_tokens):
        raise AssertionError(f"batch {batch}: multi-step and per-step greedy tokens differ "
                             f"({_first_mismatch(paged_tokens, per_step_tokens)})")

    tokens = batch * steps
    rate = {name: tokens / seconds for name, seconds in best.items()}
    return {
        "batch": batch, "prompt": prompt_len, "steps": steps,
        "paged_tok_s": rate["paged"], "contiguous_tok_s": rate["contiguous"],
        "paged_over_contiguous": rate["paged"] / rate["contiguous"],
        "per_step_tok_s": rate["per-step"], "multi_step_tok_s": rate["paged"],
        "multi_over_per_step": rate["paged"] / rate["per-step"],
        "paged_ms": best["paged"] * 1e3, "contiguous_ms": best["contiguous"] * 1e3,
        "per_step_ms": best["per-step"] * 1e3, "tokens_match": not near_ties,
        "rows_split_at_near_tie": len(near_ties),
        "largest_split_margin": max((m for _, _, m in near_ties), default=0.0),
    }


def main(args) -> int:
    dispatch = inline_cpu_dispatch()
    batches = (2,) if args.quick else (1, 8, 32)
    prompt_len, steps = (16, 8) if args.quick else (128, 64)
    repeats = 1 if args.quick else 7
    config = QUICK_CONFIG if args.quick else CONFIG  # quick: a smoke test, small and few compiles
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    results = [measure(model, b, prompt_len, steps, repeats, rng) for b in batches]
    machine = machine_description()
    print_table(
        f"decode tokens/s, {model_description(config)}; prompts of {prompt_len} tokens, {steps} greedy steps "
        f"(no EOS), page {PAGE_SIZE}; best of {repeats}, {dispatch}, on {machine}, {os.cpu_count()} CPU cores",
        ["batch", "paged tok/s", "contiguous tok/s", "paged/contiguous", "per-step tok/s", "multi-step tok/s",
         "multi/per-step"],
        [[r["batch"], r["paged_tok_s"], r["contiguous_tok_s"], r["paged_over_contiguous"], r["per_step_tok_s"],
          r["multi_step_tok_s"], r["multi_over_per_step"]] for r in results],
    )
    print("\nTargets (issue 5): paged/contiguous >= 0.9; multi/per-step >= 1.5 at batch 8.\n"
          "paged = multi-step: the same timed run (generate's decode_loop, one jitted while_loop); per-step: one "
          "jitted decode_step per token plus the host's finished check, as generate(per_step=True).\n"
          "Greedy tokens: multi-step and per-step identical; paged and contiguous identical up to a rounding "
          "flip at a near-tie of the contiguous side's top two logits (relative margin <= "
          f"{NEAR_TIE:.0e}; any other difference raises).")
    for r in results:
        if r["rows_split_at_near_tie"]:
            print(f"batch {r['batch']}: {r['rows_split_at_near_tie']} row(s) split from the contiguous side at a "
                  f"near-tie (largest margin {r['largest_split_margin']:.1e})")
    if args.json:
        print_json({"benchmark": "decode", "machine": machine, "dispatch": dispatch,
                    "model": model_description(), "results": results})
    return 0
