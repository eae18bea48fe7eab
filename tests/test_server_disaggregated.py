"""Prefill and decode on different server processes: ``python -m jaxkv.serve
--role prefill`` and ``--role decode --prefill-url ...`` on this machine,
the KV of each prompt moved by ``jax.experimental.transfer``
(:mod:`jaxkv.serve.disaggregated`).

Expectations we did not write: an engine on one device in this test's own
process gives the tokens the decode server must stream (the tiny
byte-level Llama of test_server: the text is the tokens). Prompts are token
ids drawn fresh. Two prefill servers behind one decode server: the decode
server's ``/metrics`` shows every prompt taken from the server its first
page picks (bytes, adopted tokens), and each request's usage its hit; a
prompt the decode server holds already is not asked for. With one prefill
server stopped, its prompts go to the other (same tokens, no failure);
with both stopped, the decode server computes prompts itself (counted as
failures) and still gives the same tokens.
"""

from __future__ import annotations

import pytest

from jaxkv.serve.disaggregated import PrefillRouter
from tests.test_server import MODEL, ServerProcess, metric, metrics
from tests.test_server_processes import drawn_case, stream_all

httpx = pytest.importorskip("httpx")

OPTIONS = ["--served-model-name", MODEL, "--max-model-len", "256", "--max-num-seqs", "4", "--decode-chunk", "4",
           "--prefill-chunk", "64"]


def test_a_decode_server_serves_what_its_prefill_servers_computed(tmp_path):
    max_tokens = 10
    seed, checkpoint, prompts, want = drawn_case(tmp_path, 4, 20, 120, max_tokens)
    cache = ["--compile-cache-dir", str(tmp_path / "jax-cache")]
    prefills = [ServerProcess(["--model", str(checkpoint), *OPTIONS, *cache, "--role", "prefill"],
                              tmp_path / f"prefill{i}.log") for i in range(2)]
    decode = None

    def complete(prompt, salt=None):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        return httpx.post(decode.url + "/v1/completions", json=body, timeout=60).json()

    try:
        for prefill in prefills:
            prefill.wait_ready()
        urls = [p.url for p in prefills]
        decode = ServerProcess(["--model", str(checkpoint), *OPTIONS, *cache, "--role", "decode", "--prefill-url",
                                ",".join(urls)], tmp_path / "decode.log")
        decode.wait_ready()
        logs = lambda: (seed, decode.output(), *(p.output() for p in prefills))  # noqa: E731
        assert stream_all(decode.url, prompts, max_tokens) == want, logs()
        one = complete(prompts[0], "fresh")
        assert one["choices"][0]["text"] == want[0]
        # In a namespace nothing here holds: every whole page of the prompt came from a prefill server.
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompts[0]) - 1) // 16 * 16, seed
        # Held here already: not asked of a prefill server.
        assert complete(prompts[2])["choices"][0]["text"] == want[2]
        figures = metrics(decode)
        adopted = sum((len(p) - 1) // 16 * 16 for p in prompts) + (len(prompts[0]) - 1) // 16 * 16
        assert figures[("jaxkv_kv_transfer_requests_total", ())] == len(prompts) + 1
        assert figures[("jaxkv_kv_transfer_held_total", ())] == 1
        assert figures[("jaxkv_kv_transfer_adopted_tokens_total", ())] == adopted
        assert figures[("jaxkv_kv_transfer_bytes_total", ())] > 0
        assert figures[("jaxkv_kv_transfer_failures_total", ())] == 0
        # Each prompt went to the server its first page and namespace pick (PrefillRouter.affinity).
        router = PrefillRouter(urls)
        chosen = [router.affinity(p, None, 16) for p in prompts] + [router.affinity(prompts[0], ["cache_salt",
                                                                                                 "fresh"], 16)]
        for url, prefill in zip(urls, prefills):
            asked = chosen.count(url)
            assert metric(figures, "jaxkv_kv_transfer_server_requests_total", server=url, outcome="ok") == asked
            assert metric(metrics(prefill), "jaxkv_prefix_cache_queries_tokens_total") >= sum(
                len(p) for p, c in zip(prompts, chosen) if c == url), logs()

        prefills[0].stop()  # one gone: its prompts go to the other, same tokens
        for i, prompt in enumerate(prompts):
            assert complete(prompt, "after")["choices"][0]["text"] == want[i], logs()
        figures = metrics(decode)
        first = [router.affinity(p, ["cache_salt", "after"], 16) for p in prompts].count(urls[0])
        assert metric(figures, "jaxkv_kv_transfer_server_requests_total", server=urls[0], outcome="failed") == first
        assert figures[("jaxkv_kv_transfer_requests_total", ())] == 2 * len(prompts) + 1
        assert figures[("jaxkv_kv_transfer_failures_total", ())] == 0

        prefills[1].stop()  # both gone: the decode server computes the prompts itself, with the same tokens
        assert complete(prompts[1], "alone")["choices"][0]["text"] == want[1]
        assert metrics(decode)[("jaxkv_kv_transfer_failures_total", ())] == 1
    finally:
        for prefill in prefills:
            prefill.stop()
        if decode is not None:
            decode.stop()
