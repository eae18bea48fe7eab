"""``python -m jaxkv.demo``: the continuous-batching engine serving a
synthetic workload with shared prefixes, on a small random-weight Llama by
default, or ``--model DIR`` for a local Hugging Face checkpoint of any family
jaxkv serves, on the same engine (prints the generated text with the
checkpoint's tokenizer).

The workload: requests arrive over time, each a shared "system prompt" (one
of four) followed by its own question; the pool is sized so the engine must
evict cached prefixes (admission keeps room for the running requests' next
decode chunk, so it rarely has to preempt; ``examples/swap_under_pressure.py``
shows preemption). At the end it prints the summary: requests, tokens/s,
prefix hit rate, peak KV blocks used, preemptions, TTFT and ITL.
(``python -m jaxkv.allocator_tour`` is the allocator tour.)
"""

from __future__ import annotations

import argparse
import contextlib
import os

import jax
import numpy as np
from flax import nnx

import jaxkv
from jaxkv._ops import pow2_at_least
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, SamplingParams
from jaxkv.serve import Engine, EngineProgress

__all__ = ["DEMO_CONFIG", "main", "progress_bar", "run_checkpoint", "run_random_model", "synthetic_workload"]

DEMO_CONFIG = dict(
    model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=2048, tie_word_embeddings=False,
)


def synthetic_workload(vocab: int, num_requests: int, rng) -> list[tuple[list[int], int, int]]:
    """(prompt, max_new_tokens, arrival_step) with four shared system prompts."""
    systems = [rng.integers(3, vocab, size=rng.integers(48, 96)).tolist() for _ in range(4)]
    workload = []
    for i in range(num_requests):
        question = rng.integers(3, vocab, size=rng.integers(4, 24)).tolist()
        workload.append((systems[rng.integers(4)] + question, int(rng.integers(8, 33)), i // 3))
    return workload


@contextlib.contextmanager
def progress_bar(total: int):
    """A ``rich`` progress bar; yields the ``on_progress`` callback for
    :meth:`Engine.run` that advances it (the engine itself never prints)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("serve", total=total, detail="")

        def update(p: EngineProgress) -> None:
            bar.update(task, completed=p.finished, detail=(
                f"{p.running} running, {p.generated_tokens} tok, {p.tokens_per_second:.0f} tok/s, "
                f"{p.preemptions} preempted"))

        yield update


def run_random_model(num_requests: int) -> None:
    model = LlamaForCausalLM(LlamaConfig.from_hf(DEMO_CONFIG), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    engine = Engine(model, num_pages=72, page_size=8, max_seqs=8, max_blocks_per_seq=24, num_host_pages=64,
                    decode_chunk=8)
    for prompt, max_new, arrival in synthetic_workload(DEMO_CONFIG["vocab_size"], num_requests, rng):
        engine.add_request(prompt, max_new, sampling=SamplingParams(temperature=0.7, top_p=0.95), arrival_step=arrival)
    print(f"jaxkv {jaxkv.__version__} demo on {jax.devices()[0].platform}: {num_requests} requests sharing 4 system "
          f"prompts, random Llama ({DEMO_CONFIG['num_hidden_layers']} layers, hidden {DEMO_CONFIG['hidden_size']}), "
          f"{engine.capacity} KV blocks of 8 tokens")
    with progress_bar(num_requests) as on_progress:
        summary = engine.run(on_progress=on_progress)
    print(summary)


def run_checkpoint(path: str, prompts: list[str], max_new: int) -> None:
    """Serve ``prompts`` on the engine with the checkpoint at ``path`` (any
    family of :class:`jaxkv.nn.AutoModelForCausalLM`: the Llama family and
    DeepSeek-V3 over the paged pool, DeepSeek-V4 and Qwen3-Next over their
    hybrid ``KVCacheManager``). Without a ``tokenizer.json`` the prompts
    are read as comma-separated token ids and the output is printed as ids."""
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if os.path.exists(tokenizer_file):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_file)
        encode, decode = (lambda text: tokenizer.encode(text).ids), tokenizer.decode
    else:
        print(f"{path} has no tokenizer.json: prompts are token ids (e.g. --prompt 3,17,42), output is ids")
        encode, decode = (lambda text: [int(t) for t in text.split(",")]), (lambda ids: ids)
    eos = model.config.eos_token_id[0] if model.config.eos_token_id else None
    encoded = [encode(text) for text in prompts]
    if hasattr(model, "make_cache"):  # DeepSeek-V4, Qwen3-Next: the hybrid KVCacheManager
        context = pow2_at_least(max(map(len, encoded)) + max_new)
        engine = Engine(model, max_seqs=8, max_context_tokens=context)
    else:  # the paged pool: Llama family, DeepSeek-V3
        engine = Engine(model, num_pages=512, page_size=16, max_seqs=8, max_blocks_per_seq=64)
    print(f"{type(model).__name__} on the engine: {list(engine.cache.groups)} block groups, "
          f"{engine.cache.bytes_per_token:.0f} KV bytes per token")
    ids = [engine.add_request(tokens, max_new, eos_token_id=eos) for tokens in encoded]
    with progress_bar(len(ids)) as on_progress:
        summary = engine.run(on_progress=on_progress)
    for text, rid in zip(prompts, ids):
        print(f"{text!r} -> {decode(engine.outputs[rid])!r}")
    print(summary)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face checkpoint directory (config.json, *.safetensors, "
                                        "tokenizer.json)")
    parser.add_argument("--prompt", action="append", help="a prompt for --model (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=48, help="synthetic requests (random model)")
    args = parser.parse_args(argv)
    if args.model:
        default = ["The KV cache", "Paged attention is"]
        if not os.path.exists(os.path.join(args.model, "tokenizer.json")):
            default = ["3,17,42,5,9", "7,7,1,30,2,11,4,8"]
        run_checkpoint(args.model, args.prompt or default, args.max_new_tokens)
    else:
        run_random_model(args.requests)


if __name__ == "__main__":
    main()
