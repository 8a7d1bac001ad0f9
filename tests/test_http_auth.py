"""The API key rule of each route (docs/serving.md): every route that reads or computes on user
input needs ``Authorization: Bearer KEY`` (scheme in any case, RFC 7235); /health and /version
never do; /metrics only with metrics_require_api_key. The middleware over a stub app."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pagebatch.plugins.frontends.http.server import _ApiKeyMiddleware

KEY = "s3cret"
KEYED = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1", "/tokenize",
         "/detokenize", "/tokenize/"]
OPEN = ["/health", "/version"]


def _client(metrics: bool) -> TestClient:
    async def ok(request):
        return PlainTextResponse("ok")

    paths = {p.rstrip("/") or "/" for p in KEYED + OPEN + ["/metrics"]}
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(_ApiKeyMiddleware, api_key=KEY, metrics=metrics)
    return TestClient(app)


@pytest.mark.parametrize("metrics", [False, True])
def test_each_route_rule(metrics):
    c = _client(metrics)
    for path in KEYED + (["/metrics"] if metrics else []):
        r = c.post(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            assert c.post(path, headers={"Authorization": f"{scheme} {KEY}"}).status_code \
                != 401, (path, scheme)
    for path in OPEN + ([] if metrics else ["/metrics"]):
        assert c.get(path).status_code == 200, path


@pytest.mark.parametrize("value", [f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer ",
                                   f"Token {KEY}", f"Bearer{KEY}", f"Bearer {KEY[:-1]}"])
def test_wrong_credentials(value):
    r = _client(False).post("/tokenize", headers={"Authorization": value})
    assert r.status_code == 401, value


def test_two_authorization_headers_are_refused():
    c = _client(False)
    r = c.post("/v1/models", headers=[("Authorization", "Bearer wrong"),
                                      ("Authorization", f"Bearer {KEY}")])
    assert r.status_code == 401


@pytest.mark.parametrize("metrics", [False, True])
def test_every_route_of_the_app_follows_the_rule(metrics):
    """The real route table (build_app): a route is open only if docs/serving.md says so, so a
    route added later is keyed or documented as open, never open by accident."""
    from types import SimpleNamespace

    from pagebatch.plugins.frontends.http.server import Settings, build_app

    class Engine:  # no request gets past the key, so nothing else is called
        engine = SimpleNamespace(max_model_len=16, tokenizer=None, sampling_defaults={},
                                 vocab_size=10)
        core_stats = None

        def add_stats_listener(self, listener):
            pass

        def check_health(self):
            pass

    app = build_app(Engine(), SimpleNamespace(model="m"),
                    Settings(api_key=KEY, metrics_require_api_key=metrics))
    open_paths = {"/health", "/version", "/openapi.json"} | (set() if metrics else {"/metrics"})
    c = TestClient(app)
    seen = set()
    for route in app.routes:
        for method in route.methods - {"HEAD"}:
            r = c.request(method, route.path)
            assert (r.status_code == 401) == (route.path not in open_paths), (method, route.path)
            seen.add(route.path)
    assert seen >= open_paths | {"/tokenize", "/detokenize", "/v1/completions"}
    assert c.get("/no-such-route").status_code != 200
