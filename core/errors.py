"""Typed user errors.

Every message names the offending value and the limit or the allowed values, so a user (or the
HTTP frontend, which maps these to 4xx responses) can act on it without reading code.
"""

from __future__ import annotations


class PagebatchError(Exception):
    """Base of every error pagebatch raises on purpose."""


class ConfigError(PagebatchError, ValueError):
    """A config key or value is invalid (unknown key, wrong type, out of range)."""


class PluginError(PagebatchError):
    """A plugin failed to load, or a name asked for is not registered."""


class DuplicatePluginError(PluginError):
    """Two plugins registered the same name for the same kind of component."""


class ModelNotFoundError(PagebatchError, FileNotFoundError):
    """The model name or path resolves to nothing loadable."""


class CacheTooSmallError(ConfigError):
    """The KV cache cannot hold one request of `max_model_len` tokens."""


class InvalidRequestError(PagebatchError, ValueError):
    """A request is malformed; raised before anything is queued."""


class ContextLengthError(InvalidRequestError):
    """Prompt tokens plus max_tokens exceed `max_model_len`."""


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; ``param`` names it (an HTTP error's "param")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidTokenError(InvalidRequestError):
    """A prompt token id is outside the vocabulary."""


class RequestFailedError(PagebatchError, RuntimeError):
    """A fault on the server's side (e.g. a plugin raised) ended one request, not the engine:
    not the user's error, so no ``param`` (an HTTP 500)."""

    param: str | None = None


class EngineDeadError(PagebatchError, RuntimeError):
    """The engine core stopped; pending requests cannot complete."""
