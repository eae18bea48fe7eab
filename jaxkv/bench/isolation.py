"""``python -m jaxkv.bench isolation``: the prefix cache's timing side
channel, measured (vLLM's CVE-2025-46570: one tenant could tell from its
time to first token whether another tenant's prompt was cached; the fix is a
per-request cache salt, the prefix cache's namespace here).

Each trial draws a FRESH random prompt (:data:`PROMPT_TOKENS` random token
ids, so nothing is left cached from an earlier trial) and flips a seeded coin
(balanced: exactly half of a configuration's trials are heads, in a seeded
order). Heads: tenant A sends the prompt (``max_tokens`` 1) and it
completes; tails: A sends another fresh prompt of the same length instead,
so the two classes differ only in what the cache holds, not in what the
engine ran just before. Then tenant B sends the prompt (``max_tokens`` 1)
and its time to first token (TTFT) is measured: on the engine, wall time
from ``add_request`` to the return of the ``step`` that gives its first
token (the engine stepped back to back); over HTTP (``--http``), wall time
from sending a streaming ``/v1/completions`` request to its first content
chunk. A prefix hit serves all but the last page of the prompt from the
cache: one prefill call of 16 tokens instead of :data:`PROMPT_TOKENS` /
``prefill_chunk`` = 4 calls of 128.

Two configurations, their trials interleaved (trial ``i`` of each, in a
seeded order, so a noisy spell on the machine hits both alike), after
:data:`WARM_TRIALS` untimed trials each (every compiled shape runs once
before timing):

* **different salts**: A and B each in their own namespace (``cache_salt``
  per tenant over HTTP): B must never hit A's prefix, so the classifier
  must be at chance (0.5 inside its interval);
* **shared salt**: both in one namespace: how far above chance B can tell.

Classifier: the trials are split into halves (train / test, seeded,
stratified by class); the TTFT threshold that maximizes the training
accuracy (predict "A sent it" when TTFT < threshold) is applied to the test
half. Reported per configuration: the test accuracy with a 95% Wilson
interval, the AUC over all trials (Mann-Whitney: the probability that a
heads trial's TTFT is below a tails trial's), the median TTFT of each class
and, as the ground truth behind the timing, the prompt tokens B was served
from the cache (engine ``cached_tokens``; over HTTP ``usage.
prompt_tokens_details.cached_tokens``), mean per class.

The model is the serve bench's tiny random-weight Llama (2 layers, hidden
128) on the packed scheduler with ``prefill_chunk`` 128; the cache is sized
(``kv_cache_memory``) so that nothing is evicted during the run (eviction
would add timing of its own). ``--http`` adds the same two configurations
through ``python -m jaxkv.serve`` (a subprocess on 127.0.0.1, the same
engine options, the checkpoint saved with the serve bench's word-level
tokenizer); one synchronous client (keep-alive) plays both tenants.

After the side channel, the cost of the other isolation option,
``scrub_on_free`` (:mod:`jaxkv.bench.scrub_cost`): one freeing call with
and without zeroing what it frees, and the same serving workload with the
option on and off (tokens must not change).

Exit status 1 when a different-salt accuracy interval excludes 0.5 (the
bench is the check; a 95% interval misses the truth about one run in
twenty by construction, so a failure is worth one rerun before it is
believed), or when B was ever served cached tokens under a different salt.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from jaxkv.bench._timing import machine_description, print_json, print_table

__all__ = ["analyse", "auc", "best_threshold", "main", "measure_engine", "measure_http", "run_trials", "summarize",
           "wilson"]

PROMPT_TOKENS = 512
TRIALS = 200
QUICK_TRIALS = 40
WARM_TRIALS = 4  # untimed, per configuration, alternating classes (every shape compiles before timing)
#: Engine options (in-process and the server's): the packed scheduler's budget is ``prefill_chunk``.
ENGINE = {"max_model_len": 528, "max_seqs": 2, "decode_chunk": 1, "prefill_chunk": 128}
PAGE_SIZE = 16  # the engine's default
#: configuration -> (tenant A's salt, tenant B's salt)
SALTS = {"different": ("tenant-a", "tenant-b"), "shared": ("tenant-ab", "tenant-ab")}
Z95 = 1.959963984540054


# ------------------------------------------------------------ statistics


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``correct / n``."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, center - half), min(1.0, center + half))


def auc(hit: np.ndarray, miss: np.ndarray) -> float:
    """Mann-Whitney AUC: P(a "hit" class TTFT < a "miss" class TTFT), ties 1/2."""
    hit, miss = np.asarray(hit, np.float64), np.asarray(miss, np.float64)
    if not len(hit) or not len(miss):
        return 0.5
    less = (hit[:, None] < miss[None, :]).sum()
    ties = (hit[:, None] == miss[None, :]).sum()
    return float((less + 0.5 * ties) / (len(hit) * len(miss)))


def best_threshold(ttft: np.ndarray, sent: np.ndarray) -> float:
    """The threshold maximizing the accuracy of "sent when ``ttft`` <
    threshold" on these trials (candidates: below all, the midpoints of
    consecutive distinct values, above all; the first best)."""
    values = np.unique(np.asarray(ttft, np.float64))
    candidates = np.concatenate([[-np.inf], (values[1:] + values[:-1]) / 2, [np.inf]])
    accuracy = ((ttft[None, :] < candidates[:, None]) == sent[None, :]).mean(axis=1)
    return float(candidates[int(np.argmax(accuracy))])


def analyse(ttft, sent, seed: int) -> dict:
    """The classifier's figures for one configuration (module docstring)."""
    ttft, sent = np.asarray(ttft, np.float64), np.asarray(sent, bool)
    rng = np.random.default_rng(seed)
    train = np.zeros(len(ttft), bool)
    for cls in (True, False):  # stratified halves
        idx = np.flatnonzero(sent == cls)
        rng.shuffle(idx)
        train[idx[: len(idx) // 2]] = True
    threshold = best_threshold(ttft[train], sent[train])
    test = ~train
    correct = int(((ttft[test] < threshold) == sent[test]).sum())
    n = int(test.sum())
    lo, hi = wilson(correct, n)
    return {"trials": len(ttft), "test_trials": n, "test_correct": correct, "test_accuracy": correct / n if n else 0.0,
            "ci95": [lo, hi], "chance_in_ci": bool(lo <= 0.5 <= hi), "auc": auc(ttft[sent], ttft[~sent]),
            "threshold_ms": 1e3 * threshold if math.isfinite(threshold) else None,
            "ttft_ms_median": {"a_sent": 1e3 * statistics.median(ttft[sent]),
                               "a_not_sent": 1e3 * statistics.median(ttft[~sent])}}


# ------------------------------------------------------------ trials


def _fresh_prompt(rng, vocab: int) -> list:
    return rng.integers(3, vocab, PROMPT_TOKENS).tolist()


def run_trials(send, trials: int, seed: int, vocab: int, warm: int = WARM_TRIALS) -> dict:
    """``send(prompt, salt) -> (ttft_seconds, cached_tokens)`` sends one
    request (``max_tokens`` 1) and returns when it completed. Returns per
    configuration ``{"ttft": [...], "sent": [...], "cached": [...]}`` (B's
    TTFT, the coin, the prompt tokens B was served from the cache)."""
    rng = np.random.default_rng(seed)
    coins = {name: rng.permutation(np.arange(trials) < trials // 2) for name in SALTS}
    out = {name: {"ttft": [], "sent": [], "cached": []} for name in SALTS}

    def trial(name: str, sent: bool):
        salt_a, salt_b = SALTS[name]
        prompt = _fresh_prompt(rng, vocab)
        send(prompt if sent else _fresh_prompt(rng, vocab), salt_a)
        return send(prompt, salt_b)

    for w in range(warm):
        for name in SALTS:
            trial(name, w % 2 == 0)
    names = list(SALTS)
    for i in range(trials):
        for name in rng.permutation(names):
            sent = bool(coins[name][i])
            ttft, cached = trial(name, sent)
            out[name]["ttft"].append(ttft)
            out[name]["sent"].append(sent)
            out[name]["cached"].append(cached)
    return out


def _pages_needed(trials: int) -> int:
    """Pages for every request of the run, none evicted: two requests per
    trial of ``ceil((PROMPT_TOKENS + 1) / PAGE_SIZE)`` pages, two
    configurations, warm-up trials included, plus the rows' slack."""
    per_request = -(-(PROMPT_TOKENS + 1) // PAGE_SIZE)
    return (trials + WARM_TRIALS) * len(SALTS) * 2 * per_request + 2 * ENGINE["max_seqs"] * per_request + 64


def _kv_cache_bytes(config: dict, trials: int) -> int:
    """``kv_cache_memory`` for :func:`_pages_needed` pages (K and V of every
    layer, float32) plus 4 MiB for the cache's fixed arrays."""
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    return _pages_needed(trials) * PAGE_SIZE * per_token + (4 << 20)


def _tiny_llama():
    from flax import nnx

    from jaxkv.bench.serve import CONFIG
    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


def measure_engine(trials: int, seed: int = 0) -> dict:
    """:func:`run_trials` on an in-process :class:`~jaxkv.serve.Engine`
    (``namespace`` = the tenant's salt)."""
    from jaxkv.bench.serve import CONFIG
    from jaxkv.serve import Engine

    engine = Engine(_tiny_llama(), kv_cache_memory=_kv_cache_bytes(CONFIG, trials), **ENGINE)
    need = _pages_needed(trials)
    if engine.capacity < need:
        raise RuntimeError(f"the engine holds {engine.capacity} blocks, the run needs {need}")

    def send(prompt, salt):
        start = time.perf_counter()
        rid = engine.add_request(prompt, 1, namespace=salt)
        ttft = None
        while engine.has_unfinished():
            outputs = engine.step()
            if ttft is None and any(o.request_id == rid and o.new_token_ids for o in outputs):
                ttft = time.perf_counter() - start
        cached = engine.cached_tokens(rid)
        engine.forget(rid)
        return ttft, cached

    return run_trials(send, trials, seed, CONFIG["vocab_size"])


def _start_server(checkpoint: str, cache_dir: str, log_path: str, kv_bytes: int):
    """``python -m jaxkv.serve`` on 127.0.0.1 with :data:`ENGINE`'s options
    and ``kv_cache_memory`` (the serve bench's :class:`ServerProcess`)."""
    from jaxkv.bench.serve import ServerProcess

    return ServerProcess(checkpoint, cache_dir, log_path, options={**ENGINE, "kv_cache_memory": kv_bytes})


def measure_http(trials: int, seed: int = 0) -> tuple[dict, float]:
    """:func:`run_trials` through the HTTP server (``cache_salt`` = the
    tenant's salt; TTFT to the first streamed content chunk). Returns the
    trials and the server's start-up seconds."""
    import json
    import os
    import tempfile

    import httpx

    from jaxkv.bench.serve import CONFIG, write_checkpoint

    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-isolation-") as tmp:
        checkpoint = write_checkpoint(os.path.join(tmp, "ckpt"))
        server = _start_server(checkpoint, os.path.join(tmp, "jax-cache"), os.path.join(tmp, "server.log"),
                               _kv_cache_bytes(CONFIG, trials))
        try:
            ready = server.wait_ready()
            with httpx.Client(base_url=server.url, timeout=httpx.Timeout(120.0)) as client:
                def send(prompt, salt):
                    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "cache_salt": salt}
                    ttft = usage = None
                    start = time.perf_counter()
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
                        for line in response.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                raise RuntimeError(f"stream error: {chunk['error']}")
                            if ttft is None and any(c.get("text") for c in chunk.get("choices") or ()):
                                ttft = time.perf_counter() - start
                            usage = chunk.get("usage") or usage
                    if ttft is None or usage is None:
                        raise RuntimeError(f"no content chunk or no usage in the stream (usage {usage})")
                    return ttft, int(usage["prompt_tokens_details"]["cached_tokens"])

                return run_trials(send, trials, seed, CONFIG["vocab_size"]), ready
        except Exception:
            print(f"server log:\n{server.tail()}")
            raise
        finally:
            server.stop()


# ------------------------------------------------------------ report


def summarize(mode: str, measured: dict, seed: int) -> list[dict]:
    """One row per configuration: :func:`analyse` plus B's cached tokens."""
    rows = []
    for name in SALTS:
        m = measured[name]
        sent, cached = np.asarray(m["sent"], bool), np.asarray(m["cached"], np.float64)
        rows.append({"mode": mode, "salts": name, **analyse(m["ttft"], sent, seed + 1),
                     "b_cached_tokens_mean": {"a_sent": float(cached[sent].mean()),
                                              "a_not_sent": float(cached[~sent].mean())},
                     "b_cached_tokens_max_when_isolated": int(cached.max()) if name == "different" else None})
    return rows


def main(args) -> int:
    quick = getattr(args, "quick", False)
    seed = int(getattr(args, "seed", 0))  # not on the command line; tests rerun with another
    trials = QUICK_TRIALS if quick else TRIALS
    machine = machine_description()
    started = time.perf_counter()
    rows = summarize("engine", measure_engine(trials, seed), seed)
    ready = None
    if getattr(args, "http", False):
        measured, ready = measure_http(trials, seed)
        rows += summarize("http", measured, seed)
    wall = time.perf_counter() - started

    table = []
    for r in rows:
        med, cached = r["ttft_ms_median"], r["b_cached_tokens_mean"]
        accuracy = f"{r['test_correct']}/{r['test_trials']} = {r['test_accuracy']:.3f}"
        table.append([r["mode"], r["salts"], r["trials"], accuracy, f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                      f"{r['auc']:.3f}", f"{med['a_sent']:.1f} / {med['a_not_sent']:.1f}",
                      f"{cached['a_sent']:.0f} / {cached['a_not_sent']:.0f}"])
    print_table(f"prefix-cache timing side channel (CVE-2025-46570): can tenant B tell from its TTFT whether tenant A "
                f"sent its {PROMPT_TOKENS}-token prompt? {trials} trials per configuration (interleaved, after "
                f"{WARM_TRIALS} untimed each), tiny Llama, prefill chunk {ENGINE['prefill_chunk']}, on {machine}",
                ["mode", "salts", "trials", "test accuracy", "95% CI", "AUC", "TTFT p50 ms: A sent / not",
                 "B cached tokens: A sent / not"], table)
    leaks = [r for r in rows if r["salts"] == "different" and
             (not r["chance_in_ci"] or r["b_cached_tokens_max_when_isolated"])]
    print(f"\nDifferent salts at chance (0.5 inside the 95% interval, no cached token served across tenants): "
          f"{not leaks}; shared salt: " + ", ".join(f"{r['mode']} {r['test_accuracy']:.2f} accuracy, AUC "
                                                     f"{r['auc']:.2f}" for r in rows if r["salts"] == "shared")
          + f"; {wall:.0f} s" + (f" (HTTP server ready after {ready:.1f} s)" if ready is not None else ""))
    cost = _scrub_cost(quick) if getattr(args, "scrub_cost", True) else None
    if args.json:
        print_json({"benchmark": "isolation", "machine": machine, "prompt_tokens": PROMPT_TOKENS, "seed": seed,
                    "engine": ENGINE, "isolated": not leaks, "http_ready_seconds": ready, "results": rows,
                    "scrub_cost": cost})
    return 1 if leaks else 0


def _scrub_cost(quick: bool) -> dict:
    """The cost of ``scrub_on_free`` (:mod:`jaxkv.bench.scrub_cost`), as two tables."""
    from jaxkv.bench import scrub_cost

    repeats = 3 if quick else 7
    calls = scrub_cost.call_rows(repeats, quick)
    print_table(f"scrub_on_free: one allocate-and-retire call freeing N of {calls[0]['pool_pages']} pages "
                f"({calls[0]['pool_mb']:.0f} MB float32 pool), with and without zeroing them (best of {repeats}, "
                "interleaved)", ["pages freed", "MB zeroed", "plain us", "scrubbed us", "extra us"],
                [[r["pages_freed"], f"{r['zeroed_mb']:.2f}", f"{r['plain_us']:.0f}", f"{r['scrub_us']:.0f}",
                  f"{r['extra_us']:.0f}"] for r in calls])
    serving = scrub_cost.serving_rows(repeats, quick)
    print_table(f"scrub_on_free serving the same seeded workload (shared prefixes; evictions; 8 new tokens each), "
                f"best of {repeats}, interleaved", ["model", "requests", "off s", "on s", "on / off", "same tokens"],
                [[r["model"], r["requests"], f"{r['off_s']:.3f}", f"{r['on_s']:.3f}", f"{r['ratio']:.2f}",
                  r["same_tokens"]] for r in serving])
    return {"calls": calls, "serving": serving}
