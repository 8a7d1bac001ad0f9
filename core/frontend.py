"""`Frontend`: what a frontend plugin registers (``register_frontends``): a subcommand of the
``pagebatch`` command and the entry that runs it. The HTTP server (plugins/frontends/http) is
one: ``pagebatch serve``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .config import EngineConfig

__all__ = ["Frontend"]


@runtime_checkable
class Frontend(Protocol):
    """An object (not a class) registered as ``register(name, frontend)``; the command line
    then has ``pagebatch NAME``, with ``--config FILE``, the positional ``MODEL`` and every
    engine key as options (core/cli.py), plus the frontend's own.

    Optional attribute ``help: str``: the subcommand's one-line help (default
    ``"run the NAME frontend"``). A frontend named ``serve`` replaces the placeholder
    ``pagebatch serve``; ``generate``, ``plugins``, ``bench`` and ``quantize`` are taken.

    Optional attribute ``engine_defaults: Mapping[str, Any]``: engine keys whose default
    differs under this frontend (as vLLM picks some defaults by usage context, offline `LLM`
    or ``vllm serve``); they rank below ``--config FILE`` and the command line, and the
    subcommand's ``--help`` shows them. The HTTP server uses it for latency-leaning step
    shapes (plugins/frontends/http/__init__.py).
    """

    def add_cli_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the frontend's own options to its subcommand's parser (config keys it declared
        with ``register_config_options`` are already there, with the engine's)."""

    def run(self, config: EngineConfig, args: argparse.Namespace) -> int:
        """Run ``pagebatch NAME``: ``config`` is the merged `EngineConfig` (command line >
        file > defaults, plugin keys in ``config.plugin_options``), ``args`` the parsed
        command line. Build what it needs (e.g. ``AsyncEngine.from_config(config)``); return
        the exit status. A `PagebatchError` raised here is printed as ``error: ...`` with
        status 2."""
