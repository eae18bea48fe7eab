"""``python -m jaxkv.bench serve --disaggregated`` (also ``bench
disaggregated``): prefill and decode on two
server processes of this machine (``--role prefill`` / ``--role decode``,
:mod:`jaxkv.serve.disaggregated`) against one server, same model, same
requests, one after the other.

The model: SmolLM2-135M-Instruct when its wheel is installed, else the
tiny Llama of ``bench serve --http`` (said in the title). Requests: random
token prompts of 512 tokens (``--quick`` 256), 16 new tokens, greedy, sent
one at a time (``/v1/completions``, streaming): 12 (``--quick`` 3) after
two untimed ones. Reported per setup: time to first token and end-to-end
time (p50), and for the pair the KV moved per request (bytes; the
decode server's seconds per request to have the prompt prefilled there,
pulled and adopted; the pull's own seconds and rate, from its
``/metrics``), and whether every output equals the single server's.

What the loopback figure predicts and what it does not: the bytes per
request are what a cluster moves (the prompt's pages, or a hybrid
record). The time is this machine's: both servers share its two cores, the
pull goes through the transfer server's TCP path on loopback with host
copies at both ends, and the prefill server computes the prompt on the
same CPU the decode server waits on, so the pair's TTFT here is the single
server's plus the hand-over. On a GPU cluster the pull is device to device
over the fabric (the transfer server's bulk transport), the prefill runs
on other GPUs, and what disaggregation buys (decode steps never stalled by
another request's prefill, each pool sized for its phase) shows under
concurrent load, which this sequential run does not measure.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from jaxkv.bench._timing import machine_description, print_json, print_table

__all__ = ["main"]

OPTIONS = {"max_seqs": 4, "max_model_len": 1024, "decode_chunk": 4}


def _one(url: str, prompt: list, max_tokens: int) -> tuple[float, float, str]:
    """``(ttft, e2e, text)`` of one streamed completion."""
    import httpx

    began = time.perf_counter()
    first, text = None, ""
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first if first is not None else time.perf_counter() - began
                text += chunk["choices"][0]["text"]
    return first or 0.0, time.perf_counter() - began, text


def _figure(url: str, name: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def main(args) -> int:
    from jaxkv.bench.serve import ServerProcess, write_checkpoint
    from jaxkv.nn.gguf import find_smollm2

    quick = args.quick
    length, timed, max_tokens = (256, 3, 16) if quick else (512, 12, 16)
    tmp = tempfile.mkdtemp(prefix="jaxkv-bench-disagg-")
    smollm2 = find_smollm2()
    checkpoint = smollm2 if smollm2 is not None else write_checkpoint(os.path.join(tmp, "ckpt"))
    name = "SmolLM2-135M-Instruct (float32)" if smollm2 is not None else "a tiny random Llama (SmolLM2 not installed)"
    vocab = 49152 if smollm2 is not None else 2048
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab - 1, length).tolist() for _ in range(timed + 2)]
    cache = os.path.join(tmp, "jax-cache")
    results: dict = {}
    moved = {}
    try:
        single = ServerProcess(checkpoint, cache, os.path.join(tmp, "single.log"), OPTIONS)
        try:
            single.wait_ready()
            results["one server"] = [_one(single.url, p, max_tokens) for p in prompts]
        finally:
            single.proc.terminate()
            single.proc.wait(60)
        prefill = ServerProcess(checkpoint, cache, os.path.join(tmp, "prefill.log"), {**OPTIONS, "role": "prefill"})
        decode = None
        try:
            prefill.wait_ready()
            decode = ServerProcess(checkpoint, cache, os.path.join(tmp, "decode.log"),
                                   {**OPTIONS, "role": "decode", "prefill_url": prefill.url})
            decode.wait_ready()
            results["prefill + decode servers"] = [_one(decode.url, p, max_tokens) for p in prompts]
            for key in ("requests", "bytes", "seconds", "pull_seconds", "adopted_tokens", "failures"):
                moved[key] = _figure(decode.url, f"jaxkv_kv_transfer_{key}_total")
        finally:
            for server in (prefill, decode):
                if server is not None:
                    server.proc.terminate()
                    server.proc.wait(60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = [r[2] for r in results["one server"]] == [r[2] for r in results["prefill + decode servers"]]
    requests = max(moved["requests"], 1)
    rows, payload = [], []
    for setup, runs in results.items():
        runs = runs[2:]
        ttft = statistics.median(r[0] for r in runs)
        e2e = statistics.median(r[1] for r in runs)
        pair = setup != "one server"
        per_bytes = moved["bytes"] / requests if pair else 0
        per_seconds = moved["seconds"] / requests if pair else 0
        per_pull = moved["pull_seconds"] / requests if pair else 0
        rows.append([setup, f"{ttft * 1e3:.0f}", f"{e2e * 1e3:.0f}",
                     f"{per_bytes / 2**20:.2f}" if pair else "", f"{per_seconds * 1e3:.0f}" if pair else "",
                     f"{per_pull * 1e3:.1f}" if pair else "",
                     f"{per_bytes / per_pull / 1e9:.2f}" if pair and per_pull else "",
                     f"{moved['adopted_tokens'] / requests:.0f}" if pair else ""])
        payload.append({"setup": setup, "ttft_ms": ttft * 1e3, "e2e_ms": e2e * 1e3,
                        "transfer_bytes_per_request": per_bytes, "transfer_seconds_per_request": per_seconds,
                        "pull_seconds_per_request": per_pull})
    print_table(f"prefill and decode servers vs one server: {name}, {length}-token prompts, {max_tokens} new tokens, "
                f"one request at a time ({timed} timed, p50) on {machine_description()}",
                ["setup", "TTFT ms", "end-to-end ms", "KV MiB / request", "hand-over ms / request",
                 "pull ms / request", "pull GB/s", "adopted tokens / request"], rows)
    print(f"\nSame outputs as one server: {same}; hand-overs {moved['requests']:.0f}, failures "
          f"{moved['failures']:.0f}. The hand-over is the prefill server's prefill of the prompt, the pull "
          "(jax.experimental.transfer over loopback TCP) and the adoption into the decode server's host tier. "
          "What this predicts for a GPU cluster: the bytes; not the time (module docstring).")
    if args.json:
        print_json({"benchmark": "serve", "disaggregated": True, "machine": machine_description(),
                    "same_outputs": same, "transfer": moved, "results": payload})
    return 0 if same else 1
