"""API-key tenants on the OpenAI-compatible server (``--api-keys-file``,
``--api-key``; :mod:`jaxkv.serve.http`, "API keys and tenants").

One server for the module, started exactly as tests/test_server.py starts
its own (the same tiny checkpoint and :class:`ServerProcess`), with an API
keys file of two tenants, one of them with two keys, and the engine's
isolation options passed through (``--scrub-on-free --prefix-quota``). Its
token budget is one 16-token packed stream, so the warm-up runs one request
(tests/test_server.py's runs four), and the compilation cache is off
(nothing to write). Checked:
401 without or with a wrong key and the open ``/health`` and ``/metrics``;
the same prompt with the same ``cache_salt`` never hits another tenant's
prefix (``usage.prompt_tokens_details.cached_tokens`` and the engine's hit
counter), and hits its own tenant's, through either of its keys; per-tenant
metric labels, and no salt or key in the metrics, the error bodies or the
log.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import MODEL, ServerProcess, _error, checkpoint, metric, metrics  # noqa: F401 (fixture)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

KEYS = {"sk-alpha-3b1f9c07d2e4": "alpha", "sk-alpha-second-5e8a61": "alpha", "sk-beta-c40d7f21a96b": "beta"}
ALPHA, ALPHA2, BETA = KEYS
SALT = "salt-Qz81-shared-by-both"  # the same salt from both tenants
OTHER_SALT = "salt-Wv27-alpha-only"
BAD_SALT = "salt-Jm40-in-a-list"
# 89 tokens (byte-level tokenizer: one per byte), five whole 16-token pages, then a distinct last token
PROMPT = "A tenant's long system prompt, the same text from every client here. " + "0123456789" * 2


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):  # noqa: F811 - checkpoint: tests/test_server.py's fixture
    tmp = tmp_path_factory.mktemp("tenants")
    keys_file = tmp / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    srv = ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--max-model-len", "128",
                         "--max-num-seqs", "2", "--decode-chunk", "2", "--prefill-chunk", "16",
                         "--api-keys-file", str(keys_file), "--scrub-on-free", "--prefix-quota", "0.5",
                         "--no-compile-cache"], tmp / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _complete(server, key: str, suffix: str, salt: str | None = None, *, path: str = "/v1/completions") -> dict:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT + suffix}]
    else:
        body["prompt"] = PROMPT + suffix
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(server.url + path, json=body, headers=_auth(key), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


# ------------------------------------------------------------------ no server


def test_api_keys_options_and_namespaces():
    from jaxkv.errors import InvalidArgument
    from jaxkv.serve.__main__ import build_parser, engine_options, load_api_keys
    from jaxkv.serve.http import APIKeys, _bearer, _namespace

    keys = APIKeys(KEYS)
    assert keys.tenants == ("alpha", "beta") and len(keys) == 3
    assert [keys.tenant(k) for k in (ALPHA, ALPHA2, BETA)] == ["alpha", "alpha", "beta"]
    for wrong in (None, "", ALPHA[:-1], ALPHA + "x", "alpha", "sk-"):
        assert keys.tenant(wrong) is None, wrong
    assert not any(k in repr(keys) or k in str(vars(keys)) for k in KEYS)  # only digests are kept
    for bad in ({}, {"": "a"}, {"a b": "a"}, {"k\u00e9y": "a"}, {"key": ""}, {"key": 5}):
        with pytest.raises(InvalidArgument):
            APIKeys(bad)
    assert _bearer(f"Bearer {ALPHA}") == _bearer(f"bearer  {ALPHA} ") == ALPHA
    assert _bearer(f"Basic {ALPHA}") is None and _bearer("Bearer ") is None and _bearer(None) is None
    # namespaces: a tenant's own salts; two tenants never meet; no tenant: as before
    assert _namespace("alpha", SALT) != _namespace("beta", SALT)
    assert _namespace("alpha", None) != _namespace("alpha", SALT) != _namespace(None, SALT)
    assert _namespace(None, None) is None and _namespace(None, SALT) == ("cache_salt", SALT)

    parse = build_parser().parse_args
    plain = engine_options(parse(["--model", "m"]))
    assert "scrub_on_free" not in plain and "prefix_quota" not in plain  # an engine without them still builds
    both = engine_options(parse(["--model", "m", "--scrub-on-free", "--prefix-quota", "0.25"]))
    assert both["scrub_on_free"] is True and both["prefix_quota"] == 0.25
    for bad in ("0", "1.5", "-0.1", "half"):
        with pytest.raises(SystemExit):
            parse(["--model", "m", "--prefix-quota", bad])
    assert load_api_keys(None) is None
    assert load_api_keys(None, "single-key") == {"single-key": "default"}


def test_load_api_keys_file_errors_never_show_a_key(tmp_path):
    from jaxkv.errors import InvalidArgument
    from jaxkv.serve.__main__ import load_api_keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    assert load_api_keys(str(path), "sk-extra") == {**KEYS, "sk-extra": "default"}
    with pytest.raises(InvalidArgument) as err:
        load_api_keys(str(path), BETA)  # the file gives this key to 'beta'
    assert BETA not in str(err.value)
    for text in ('{"sk-secret-1": ', '["sk-secret-1"]', '{"sk-secret-1": ""}', "{}"):
        path.write_text(text)
        with pytest.raises(InvalidArgument) as err:
            load_api_keys(str(path))
        assert "sk-secret" not in str(err.value), text


def test_metrics_without_tenants_have_no_tenant_label():
    from jaxkv.serve.metrics import ServerMetrics

    plain, tenants = ServerMetrics(), ServerMetrics(tenants=("alpha", "beta"))
    for m in (plain, tenants):
        m.observe_tokens(0.0, None, 0.5, 3, tenant="alpha")
        m.observe_prompt(7, tenant="alpha")
        m.observe_finished(0.0, 1.0, "stop", tenant="alpha")
        m.observe_error(401)
    assert "tenant" not in plain.render().decode()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(tenants.render().decode()) for s in family.samples}
    assert metric(values, "jaxkv_prompt_tokens_total", tenant="alpha") == 7
    assert ("jaxkv_prompt_tokens_total", (("tenant", "beta"),)) in values  # each tenant's series from the start
    assert metric(values, "jaxkv_time_to_first_token_seconds_count", tenant="alpha") == 1
    assert metric(values, "jaxkv_inter_token_latency_seconds_count", tenant="alpha") == 2
    assert metric(values, "jaxkv_request_success_total", tenant="alpha", finish_reason="stop") == 1
    assert metric(values, "jaxkv_http_errors_total", tenant="", status="401") == 1


# ------------------------------------------------------------------ the server


def test_missing_or_wrong_key_is_401(server):
    url = server.url
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    err = _error(httpx.post(url + "/v1/completions", json=good, timeout=30), 401, "missing_api_key")
    assert err["type"] == "authentication_error"
    for headers in (_auth("sk-wrong-key-000"), _auth(ALPHA[:-1]), {"Authorization": f"Basic {ALPHA}"}):
        response = httpx.post(url + "/v1/completions", json=good, headers=headers, timeout=30)
        err = _error(response, 401)
        assert err["type"] == "authentication_error" and err["code"] in ("invalid_api_key", "missing_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
        assert "sk-" not in response.text  # the presented key is not echoed
    _error(httpx.get(url + "/v1/models", timeout=30), 401)
    _error(httpx.get(url + "/v1/no-such-route", timeout=30), 401)  # unknown paths too: no probing without a key
    _error(httpx.get(url + "/v1/no-such-route", headers=_auth(BETA), timeout=30), 404)
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/metrics", timeout=30).status_code == 200
    assert httpx.get(url + "/v1/models", headers=_auth(ALPHA2), timeout=30).json()["data"][0]["id"] == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong-key-000", max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=2)
    out = openai.OpenAI(base_url=url + "/v1", api_key=BETA, max_retries=0, timeout=120).completions.create(
        model=MODEL, prompt="x", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_tenants_never_share_a_prefix_even_with_the_same_salt(server):
    def hits() -> float:
        return metric(metrics(server), "jaxkv_prefix_cache_hits_tokens_total")

    start = hits()
    assert _cached(_complete(server, ALPHA, "A", SALT)) == 0  # alpha caches the prompt under SALT
    assert _cached(_complete(server, BETA, "B", SALT)) == 0  # beta, same prompt, same salt: no hit
    assert hits() == start
    assert _cached(_complete(server, ALPHA, "C", OTHER_SALT)) == 0  # alpha, another salt: its own namespace
    assert hits() == start
    again = _cached(_complete(server, ALPHA2, "D", SALT))  # alpha's other key, SALT again: alpha's prefix
    assert again >= 48 and hits() == start + again
    assert _cached(_complete(server, BETA, "E", SALT)) >= 48  # beta's own earlier request
    # no salt: one namespace per tenant, still never shared, chat alike
    assert _cached(_complete(server, BETA, "F")) == 0
    assert _cached(_complete(server, ALPHA, "F", path="/v1/chat/completions")) == 0
    assert _cached(_complete(server, ALPHA, "G")) == 0
    assert _cached(_complete(server, ALPHA2, "H")) >= 48


def test_metrics_have_tenant_labels_and_no_secrets(server):
    _complete(server, ALPHA, "I", SALT)
    _complete(server, BETA, "J", SALT)
    bad_salt = {"model": MODEL, "prompt": "x", "cache_salt": [BAD_SALT]}  # not a string: 400, not echoed
    response = httpx.post(server.url + "/v1/completions", json=bad_salt, headers=_auth(BETA), timeout=30)
    assert _error(response, 400, "invalid_type")["param"] == "cache_salt" and BAD_SALT not in response.text
    httpx.post(server.url + "/v1/completions", json={"model": MODEL}, timeout=30)  # 401
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = metrics(server)
    for tenant in ("alpha", "beta"):
        assert metric(values, "jaxkv_prompt_tokens_total", tenant=tenant) > 0, tenant
        assert metric(values, "jaxkv_generation_tokens_total", tenant=tenant) > 0, tenant
        assert metric(values, "jaxkv_time_to_first_token_seconds_count", tenant=tenant) > 0, tenant
        assert sum(v for (name, labels), v in values.items()
                   if name == "jaxkv_request_success_total" and dict(labels)["tenant"] == tenant) > 0, tenant
    assert metric(values, "jaxkv_http_errors_total", tenant="", status="401") >= 1
    assert metric(values, "jaxkv_http_errors_total", tenant="beta", status="400") >= 1
    per_request = ("jaxkv_prompt_tokens_total", "jaxkv_generation_tokens_total", "jaxkv_request_success_total",
                   "jaxkv_http_errors_total", "jaxkv_e2e_request_latency_seconds_count")
    tenants = {dict(labels).get("tenant") for (name, labels) in values if name in per_request}
    assert tenants <= {"alpha", "beta", ""} and {"alpha", "beta"} <= tenants
    log = server.output()
    for secret in (*KEYS, SALT, OTHER_SALT, BAD_SALT):
        assert secret not in text, secret
        assert secret not in log, secret
    assert "tenant(s) alpha, beta" in log
