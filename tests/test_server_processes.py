"""One HTTP front end over two JAX processes (``python -m jaxkv.serve
--num-processes 2 --process-id I --coordinator localhost:PORT
--tensor-parallel-size 2``: a mesh of one CPU device per process, CPU
collectives over gloo; :mod:`jaxkv.serve.multihost`).

Expectations we did not write: an engine on one device in this test's own
process gives the tokens the two-process server must stream. Prompts are
token ids drawn fresh (the tiny byte-level Llama of test_server: every id
decodes to one byte, so the text is the tokens), and a context-free
grammar's request (its grammar sent to process 1 as text) gives the text
of that device under the grammar. Then process 1 is killed:
process 0 answers 503 to every request (none the failed step's 500) and
exits, within the heartbeat timeout and its grace.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_server import MODEL, ROOT, free_port, write_tiny_checkpoint
from tests.test_text import continuation

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

OPTIONS = ["--max-model-len", "256", "--max-num-seqs", "4", "--decode-chunk", "4", "--prefill-chunk", "64"]


def start(checkpoint, tmp_path, port: int, coordinator: int) -> list:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAXKV_HEARTBEAT_SECONDS": "3"}
    procs = []
    for i in range(2):
        log = open(tmp_path / f"process{i}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "jaxkv.serve", "--model", str(checkpoint), "--served-model-name", MODEL,
             "--host", "127.0.0.1", "--port", str(port), *OPTIONS, "--no-compile-cache", "--num-processes", "2",
             "--process-id", str(i), "--coordinator", f"localhost:{coordinator}", "--tensor-parallel-size", "2"],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env), log))
    return procs


def logs(tmp_path) -> str:
    return "\n".join(f"--- process {i}\n" + (tmp_path / f"process{i}.log").read_text()[-4000:] for i in range(2))


GRAMMAR = 'start: ("ab" | "c" | "d" | " ")+ "."'


def reference(checkpoint, prompts, max_tokens, grammar: str | None = None):
    """The texts a server must give for the greedy tokens of an engine on
    this process's one device: each the continuation of its prompt (a prompt
    of drawn bytes can end inside a UTF-8 character, whose U+FFFD stays the
    prompt's; test_text.continuation), not the decode of the new ids alone;
    ``grammar``: under that context-free grammar."""
    from jaxkv.nn import AutoModelForCausalLM
    from jaxkv.serve import Engine
    from jaxkv.text import Tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    tokenizer = Tokenizer.from_pretrained(str(checkpoint))
    engine = Engine(model, max_seqs=4, max_model_len=256, decode_chunk=4, prefill_chunk=64)
    eos = tokenizer.eos_token_ids[0]
    options = {}
    if grammar is not None:
        from jaxkv.serve.structured import compile_constraint

        options["constraint"] = compile_constraint(tokenizer, model.config.vocab_size, grammar=grammar)
    ids = [engine.add_request(p, max_tokens, eos_token_id=eos, **options) for p in prompts]
    engine.run()
    return [continuation(tokenizer, prompt, engine.outputs[i]) for prompt, i in zip(prompts, ids)]


def stream_all(url: str, prompts: list, max_tokens: int) -> list[str]:
    """The texts of greedy completions of ``prompts``, streamed concurrently
    by the ``openai`` client."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def stream(prompt):
        text = ""
        async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0, stream=True):
            text += chunk.choices[0].text
        return text

    async def all_streams():
        return await asyncio.gather(*(stream(p) for p in prompts))

    return asyncio.run(all_streams())


def drawn_case(tmp_path, count: int, shortest: int, longest: int, max_tokens: int):
    """``(seed, checkpoint, prompts, want)``: the tiny checkpoint, ``count``
    token prompts drawn fresh, and their one-device greedy texts."""
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    prompts = [rng.integers(3, 250, int(rng.integers(shortest, longest))).tolist() for _ in range(count)]
    return seed, checkpoint, prompts, reference(checkpoint, prompts, max_tokens)


def test_two_processes_serve_one_devices_tokens_and_fail_cleanly(tmp_path):
    max_tokens = 12
    seed, checkpoint, prompts, want = drawn_case(tmp_path, 5, 5, 90, max_tokens)
    port = free_port()
    procs = start(checkpoint, tmp_path, port, free_port())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p, _ in procs), logs(tmp_path)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, logs(tmp_path)
            time.sleep(0.2)
        got = stream_all(url, prompts, max_tokens)  # concurrent streams, one engine across both processes
        assert got == want, (seed, logs(tmp_path))
        again = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompts[0],
                                                          "max_tokens": max_tokens, "temperature": 0}, timeout=60)
        assert again.json()["choices"][0]["text"] == want[0]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompts[0]) - 1) // 16 * 16

        if importlib.util.find_spec("llguidance") is not None:  # a grammar travels as its text: same tokens
            constrained = httpx.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": prompts[0], "max_tokens": max_tokens, "temperature": 0,
                "structured_outputs": {"grammar": GRAMMAR}}, timeout=60)
            assert constrained.status_code == 200, constrained.text
            assert constrained.json()["choices"][0]["text"] == reference(checkpoint, prompts[:1], max_tokens,
                                                                        grammar=GRAMMAR)[0], seed

        procs[1][0].kill()  # a follower dies: process 0 answers 503, then exits
        killed = time.monotonic()
        statuses = []
        while procs[0][0].poll() is None and time.monotonic() - killed < 60:
            try:
                response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompts[1],
                                                                     "max_tokens": 2}, timeout=10)
                statuses.append((response.status_code, response.json()["error"]["code"]
                                 if response.status_code != 200 else None))
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert procs[0][0].poll() == 1, (statuses, logs(tmp_path))
        assert time.monotonic() - killed < 30, logs(tmp_path)
        # Every answer after the kill is the lost process's 503, none the failed step's 500: the engine
        # thread waits for the watchdog's verdict.
        assert statuses and set(statuses) == {(503, "process_lost")}, (statuses, logs(tmp_path))
        assert "process(es) [1] of 2 died" in (tmp_path / "process0.log").read_text()
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            log.close()
