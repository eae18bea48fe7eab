"""``python -m jaxkv.bench compile_depth``: cold compile time against depth,
with the decoder layers under one ``lax.scan`` (``scan_layers=True``, the
default) and unrolled (``False``), in the same run.

Subjects, per family and depth (random weights, small widths: compile time
follows the program's size in layers, not the widths):

* ``generate``: the first call of :func:`jaxkv.nn.generate` (one prompt of
  :data:`PROMPT` tokens, :data:`NEW` new tokens): its prefill and its decode
  loop compile; the figure is the first call's wall time less a second,
  warm call's;
* ``engine``: an :class:`~jaxkv.serve.Engine`'s first request to completion
  (the packed step at the buckets it uses, the decode chunk), less a second
  identical request's.

The table gives seconds and each depth's ratio to the shallowest depth of
the same mode (an untimed first round compiles what does not depend on the
model); the issue's target is 48 and 80 layers within 1.5x of 2.
JAX's persistent compilation cache is off for the run (a hit would hide the
compile).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from jaxkv.bench._timing import machine_description, print_json, print_table

__all__ = ["main", "measure"]

PROMPT, NEW = 24, 4
DEPTHS = (2, 30, 80)
QUICK_DEPTHS = (2, 6)

_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
              tie_word_embeddings=False, torch_dtype="float32", model_type="llama")


def _llama(layers: int, scan: bool):
    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig.from_hf(dict(_LLAMA, num_hidden_layers=layers)), rngs=nnx.Rngs(0),
                            scan_layers=scan)


def _window_types(layers: int, period: int) -> tuple[str, ...]:
    """Every ``period``-th layer global, the rest sliding; the last layer
    global when none is (the ring cache needs a paged layer)."""
    types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
    types[-1] = "full_attention" if "full_attention" not in types else types[-1]
    return tuple(types)


def _gemma3(layers: int, scan: bool):
    """Gemma 3's pattern (five window layers, one global)."""
    from jaxkv.nn import Gemma3ForCausalLM
    from jaxkv.nn.gemma3_config import Gemma3Config

    config = Gemma3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                          sliding_window=16, layer_types=_window_types(layers, 6), max_position_embeddings=256)
    return Gemma3ForCausalLM(config, rngs=nnx.Rngs(0), scan_layers=scan)


def _gpt_oss(layers: int, scan: bool):
    """gpt-oss's alternation (window, full)."""
    from jaxkv.nn import GptOssForCausalLM
    from jaxkv.nn.gpt_oss_config import GptOssConfig

    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=16, layer_types=_window_types(layers, 2),
                          max_position_embeddings=256)
    return GptOssForCausalLM(config, rngs=nnx.Rngs(0), scan_layers=scan)


def _qwen3_next(layers: int, scan: bool):
    """Qwen3-Next's pattern (three Gated DeltaNet layers, one full
    attention; the last layer full when none is: the hybrid cache's full
    group needs one), MoE on every layer."""
    from jaxkv.nn import Qwen3NextConfig, Qwen3NextForCausalLM

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    types[-1] = "full_attention" if "full_attention" not in types else types[-1]
    config = Qwen3NextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, layer_types=tuple(types),
                             max_position_embeddings=256)
    return Qwen3NextForCausalLM(config, rngs=nnx.Rngs(0), scan_layers=scan)


def _deepseek_v4(layers: int, scan: bool):
    """DeepSeek-V4's pattern after its hash-routed first layer: CSA and HCA
    layers alternating (rates 4 and 16), top-k routed MoE; the fixture's
    widths (``tests/fixtures/dsv4/small``)."""
    from jaxkv.nn import DeepseekV4ForCausalLM
    from jaxkv.nn.deepseek_v4_config import DeepseekV4Config

    types = tuple("compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
                  for i in range(layers))
    config = DeepseekV4Config(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=layers,
                              num_attention_heads=4, head_dim=128, q_lora_rank=32, num_experts_per_tok=2,
                              n_routed_experts=4, layer_types=types, compress_rates=(4, 16),
                              mlp_layer_types=("hash_moe",) + ("moe",) * (layers - 1), sliding_window=16,
                              o_groups=2, o_lora_rank=32, index_n_heads=2, index_topk=4, partial_rotary_factor=0.5,
                              max_position_embeddings=256)
    return DeepseekV4ForCausalLM(config, rngs=nnx.Rngs(0), scan_layers=scan)


#: family -> builder(layers, scan) of a random-weight model.
FAMILIES = {"llama": _llama, "gemma3": _gemma3, "gpt_oss": _gpt_oss, "qwen3_next": _qwen3_next,
            "deepseek_v4": _deepseek_v4}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(family: str, layers: int, scan: bool) -> dict:
    """Seconds of compile in ``generate`` and in an engine's first request
    (first call less a warm one), and the tokens each produced."""
    from jaxkv.nn.generate import generate
    from jaxkv.serve import Engine

    # A model with no repeating pattern (2 layers of a window family) is the same program scanned or not: without
    # this its second build would be a cache hit, not a compile.
    jax.clear_caches()
    model = FAMILIES[family](layers, scan)
    prompt = np.random.default_rng(layers).integers(1, model.config.vocab_size, PROMPT).tolist()
    out = {}

    def run_generate():
        out["generate_tokens"] = generate(model, [prompt], NEW).tokens[0]

    cold = _timed(run_generate)
    out["generate_s"] = cold - _timed(run_generate)
    engine = Engine(model, max_seqs=2, page_size=16, max_model_len=64, prefill_chunk=32, decode_chunk=4)

    def run_engine():
        rid = engine.add_request(prompt, max_new_tokens=NEW)
        engine.run()
        out["engine_tokens"] = list(engine.outputs[rid])

    cold = _timed(run_engine)
    out["engine_s"] = cold - _timed(run_engine)
    return out


def parse_extra(args, rest):
    parser = argparse.ArgumentParser(prog="python -m jaxkv.bench compile_depth")
    parser.add_argument("--depths", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                        help="comma-separated layer counts (default 2,30,80; --quick: 2,6)")
    parser.add_argument("--families", default="llama", help=f"comma-separated, of {sorted(FAMILIES)}")
    extra = parser.parse_args(rest)
    args.depths, args.families = extra.depths, extra.families
    return args


def main(args) -> int:
    jax.config.update("jax_enable_compilation_cache", False)
    depths = getattr(args, "depths", None) or (QUICK_DEPTHS if args.quick else DEPTHS)
    families = (getattr(args, "families", None) or "llama").split(",")
    rows, results, mismatched = [], [], []
    for family in families:
        # Untimed: the engine's programs that do not depend on the model (admission, bookkeeping) compile
        # once per process; without this the first row would pay for them.
        measure(family, 1, False)  # one layer: a model of its own (its programs are not reused below)
        for scan in (False, True):
            base = None
            for layers in depths:
                got = measure(family, layers, scan)
                base = base or got
                results.append(dict(family=family, layers=layers, scan=scan, generate_s=got["generate_s"],
                                    engine_s=got["engine_s"]))
                rows.append([family, "scan" if scan else "unrolled", layers, f"{got['generate_s']:.2f}",
                             f"{got['generate_s'] / base['generate_s']:.2f}x", f"{got['engine_s']:.2f}",
                             f"{got['engine_s'] / base['engine_s']:.2f}x"])
                if scan:
                    unrolled = next(r for r in results if r["family"] == family and r["layers"] == layers
                                    and not r["scan"])
                    rows[-1].append(f"{unrolled['generate_s'] / got['generate_s']:.1f}x")
                    rows[-1].append(f"{unrolled['engine_s'] / got['engine_s']:.1f}x")
                    results[-1]["tokens"] = (got["generate_tokens"], got["engine_tokens"])
                    same = next(r for r in results if r["family"] == family and r["layers"] == layers
                                and not r["scan"]).get("tokens")
                    if same is not None and same != results[-1]["tokens"]:
                        mismatched.append((family, layers))
                else:
                    rows[-1] += ["", ""]
                    results[-1]["tokens"] = (got["generate_tokens"], got["engine_tokens"])
    print_table(f"cold compile seconds against depth (first call less a warm one; ratio to {depths[0]} layers); "
                f"{machine_description()}",
                ["family", "mode", "layers", "generate s", "vs shallowest", "engine 1st request s",
                 "vs shallowest", "generate: unrolled/scan", "engine: unrolled/scan"], rows)
    if mismatched:
        print(f"TOKENS DIFFER between scan and unrolled: {mismatched}")
    if args.json:
        print_json({"benchmark": "compile_depth", "machine": machine_description(),
                    "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
                    "mismatched": mismatched})
    return 1 if mismatched else 0
