"""The frontend plugin interface (core/frontend.py): the HTTP server is a `Frontend`, and the
registry hands frontends out as such."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from pagebatch import hookimpl
from pagebatch.frontend import Frontend
from pagebatch.registry import Registry, registry


def test_http_frontend_is_a_frontend():
    serve = registry().frontend("serve")
    assert isinstance(serve, Frontend)
    for name in ("add_cli_arguments", "run"):
        ours = list(inspect.signature(getattr(serve, name)).parameters)
        want = list(inspect.signature(getattr(Frontend, name)).parameters)[1:]  # less self
        assert ours == want, name


def test_registered_object_is_returned_as_registered():
    fe = SimpleNamespace(add_cli_arguments=lambda parser: None, run=lambda config, args: 0)
    assert isinstance(fe, Frontend)
    assert not isinstance(SimpleNamespace(run=lambda config, args: 0), Frontend)
    reg = Registry()
    reg.register_plugin(SimpleNamespace(register_frontends=_hook(fe)), "echo")
    assert reg.frontend("echo") is fe


def _hook(fe):
    @hookimpl
    def register_frontends(register):
        register("echo", fe)

    return register_frontends
