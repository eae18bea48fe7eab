"""Prefill and decode on different server processes: ``python -m jaxkv.serve
--role prefill`` and ``--role decode --prefill-url ...`` on this machine,
the KV of each prompt moved by ``jax.experimental.transfer``
(:mod:`jaxkv.serve.disaggregated`).

Expectations we did not write: an engine on one device in this test's own
process gives the tokens the decode server must stream (the tiny
byte-level Llama of test_server: the text is the tokens). Prompts are token
ids drawn fresh. The decode server's ``/metrics`` shows every prompt taken
from the prefill server (bytes, adopted tokens), and each request's usage
its hit; the prefill server's shows the prompts it computed. A prompt the
decode server holds already is not asked for. With the
prefill server gone, the decode server computes prompts itself (counted as
failures) and still gives the same tokens.
"""

from __future__ import annotations

import pytest

from tests.test_server import MODEL, ServerProcess, metrics
from tests.test_server_processes import drawn_case, stream_all

httpx = pytest.importorskip("httpx")

OPTIONS = ["--served-model-name", MODEL, "--max-model-len", "256", "--max-num-seqs", "4", "--decode-chunk", "4",
           "--prefill-chunk", "64"]


def test_a_decode_server_serves_what_its_prefill_server_computed(tmp_path):
    max_tokens = 10
    seed, checkpoint, prompts, want = drawn_case(tmp_path, 4, 20, 120, max_tokens)
    cache = ["--compile-cache-dir", str(tmp_path / "jax-cache")]
    prefill = ServerProcess(["--model", str(checkpoint), *OPTIONS, *cache, "--role", "prefill"],
                            tmp_path / "prefill.log")
    decode = None
    try:
        prefill.wait_ready()
        decode = ServerProcess(["--model", str(checkpoint), *OPTIONS, *cache, "--role", "decode", "--prefill-url",
                                prefill.url], tmp_path / "decode.log")
        decode.wait_ready()
        assert stream_all(decode.url, prompts, max_tokens) == want, (seed, decode.output(), prefill.output())
        one = httpx.post(decode.url + "/v1/completions", json={"model": MODEL, "prompt": prompts[0],
                                                               "max_tokens": max_tokens, "temperature": 0,
                                                               "cache_salt": "fresh"}, timeout=60).json()
        assert one["choices"][0]["text"] == want[0]
        # In a namespace nothing here holds: every whole page of the prompt came from the prefill server.
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompts[0]) - 1) // 16 * 16, seed
        # Held here already: not asked of the prefill server.
        repeat = httpx.post(decode.url + "/v1/completions", json={"model": MODEL, "prompt": prompts[2],
                                                                  "max_tokens": max_tokens, "temperature": 0},
                            timeout=60).json()
        assert repeat["choices"][0]["text"] == want[2]
        figures = metrics(decode)
        adopted = sum((len(p) - 1) // 16 * 16 for p in prompts) + (len(prompts[0]) - 1) // 16 * 16
        assert figures[("jaxkv_kv_transfer_requests_total", ())] == len(prompts) + 1
        assert figures[("jaxkv_kv_transfer_held_total", ())] == 1
        assert figures[("jaxkv_kv_transfer_adopted_tokens_total", ())] == adopted
        assert figures[("jaxkv_kv_transfer_bytes_total", ())] > 0
        assert figures[("jaxkv_kv_transfer_failures_total", ())] == 0
        assert metrics(prefill)[("jaxkv_prefix_cache_queries_tokens_total", ())] >= sum(len(p) for p in prompts)
        prefill.stop()  # gone: the decode server computes the prompts itself, with the same tokens
        lone = httpx.post(decode.url + "/v1/completions", json={"model": MODEL, "prompt": prompts[1],
                                                                "max_tokens": max_tokens, "temperature": 0,
                                                                "cache_salt": "alone"}, timeout=60).json()
        assert lone["choices"][0]["text"] == want[1]
        assert metrics(decode)[("jaxkv_kv_transfer_failures_total", ())] == 1
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()
