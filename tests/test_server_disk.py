"""The server's disk tier across a real restart: ``python -m jaxkv.serve
--kv-disk-dir DIR`` serves a long prompt, is stopped (SIGTERM: the engine
loop's close flushes the disk tier's queue), and a new server process on
the same folder serves the prompt again from disk: the same text as the
first server's (greedy), the prompt's cached tokens in the usage, the disk
tier's counters in ``/metrics``. A third request in another ``cache_salt``
(a tenant's namespace) hits nothing. The tiny byte-level Llama of
test_server; random prompt text drawn fresh."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from tests.test_server import MODEL, ServerProcess, metrics, write_tiny_checkpoint

httpx = pytest.importorskip("httpx")


def complete(server, prompt: str, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_restarted_server_serves_a_prompt_from_its_disk_tier(tmp_path):
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    prompt = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz ,.")) for _ in range(int(rng.integers(150, 220))))
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    args = ["--model", str(checkpoint), "--served-model-name", MODEL, "--max-model-len", "256", "--max-num-seqs",
            "2", "--decode-chunk", "4", "--prefill-chunk", "64", "--kv-disk-dir", str(tmp_path / "kv"),
            "--compile-cache-dir", str(tmp_path / "jax-cache")]
    first = ServerProcess(args, tmp_path / "first.log")
    try:
        first.wait_ready()
        before = complete(first, prompt)
        assert before["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) in (0, None)
    finally:
        first.stop()
    assert list((tmp_path / "kv").glob("*.kvrec")), first.output()
    second = ServerProcess(args, tmp_path / "second.log")
    try:
        second.wait_ready()
        after = complete(second, prompt)
        other = complete(second, prompt, cache_salt="another-tenant")
        figures = metrics(second)
    finally:
        second.stop()
    prompt_tokens = after["usage"]["prompt_tokens"]
    cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert after["choices"][0]["text"] == before["choices"][0]["text"], seed
    assert cached == (prompt_tokens - 1) // 16 * 16 > 0, (seed, cached, prompt_tokens)
    assert (other["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) in (0, None), seed
    assert other["choices"][0]["text"] == before["choices"][0]["text"], seed
    assert figures[("jaxkv_kv_disk_hit_tokens_total", ())] >= cached
    assert figures[("jaxkv_kv_disk_loaded_records_total", ())] >= cached // 16
    assert figures[("jaxkv_kv_disk_rejected_records_total", ())] == 0
