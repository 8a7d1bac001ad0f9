"""Plugin loading and the typed registry facade over ``pm.hook``.

Core code asks this module for components by name (``registry().scheduling_policy("fcfs")``) and
never calls ``pm.hook`` itself, nor imports a built-in plugin module by name.

Plugins are found through the entry-point group ``pagebatch``. Built-ins are listed there in
pyproject.toml and load like any third-party plugin. Environment variables:

- ``PAGEBATCH_PLUGINS``: comma-separated allow-list of third-party plugins (built-ins always load
  unless blocked).
- ``PAGEBATCH_DISABLE_PLUGIN_AUTOLOAD=1``: load built-ins only.
- ``PAGEBATCH_BLOCK_PLUGINS``: comma-separated plugin names never to load (built-ins too).

Each plugin is loaded and validated on its own: a failed import, an unknown hook name or an
exception in a hook is recorded against that plugin's name and the plugin is skipped. Asking for a
component that a broken plugin would have provided raises ``PluginError`` with the cause.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import pluggy

from . import hookspecs
from .errors import DuplicatePluginError, PluginError

if TYPE_CHECKING:
    from .frontend import Frontend
    from .model import CausalLM

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pagebatch"
BUILTIN_DISTRIBUTION = "pagebatch"

# kind -> hook name
KINDS = {
    "scheduling_policy": "register_scheduling_policies",
    "quant_method": "register_quant_methods",
    "attention_backend": "register_attention_backends",
    "model": "register_models",
    "structured_output_backend": "register_structured_output_backends",
    "tool_parser": "register_tool_parsers",
    "frontend": "register_frontends",
    "command": "register_commands",
    "config_option": "register_config_options",
}


@dataclass
class PluginInfo:
    """What one plugin is and what it registered (printed by ``pagebatch plugins``)."""

    name: str
    version: str
    builtin: bool
    provides: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None


def _hook_names() -> list[str]:
    return sorted(n for n in vars(hookspecs) if hasattr(getattr(hookspecs, n), "pagebatch_spec"))


def _env_list(var: str) -> set[str]:
    return {s.strip() for s in os.environ.get(var, "").split(",") if s.strip()}


class Registry:
    """Components registered by plugins, by kind and name, each remembering its plugin."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        # kind -> name -> (object, plugin name)
        self._components: dict[str, dict[str, tuple[Any, str]]] = {k: {} for k in KINDS}
        self._blocked: set[str] = set()

    # ---- loading -----------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every allowed plugin of the ``pagebatch`` entry-point group."""
        self._blocked = _env_list("PAGEBATCH_BLOCK_PLUGINS")
        allow = _env_list("PAGEBATCH_PLUGINS")
        builtins_only = os.environ.get("PAGEBATCH_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0")
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            builtin = dist == BUILTIN_DISTRIBUTION
            if ep.name in self._blocked or ep.name in self.plugins:
                continue
            if not builtin and (builtins_only or (allow and ep.name not in allow)):
                continue
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                obj = ep.load()
            except Exception as e:  # a broken plugin is reported, not fatal
                self._broken(ep.name, version, builtin, f"import failed: {type(e).__name__}: {e}")
                continue
            self.register_plugin(obj, ep.name, version=version, builtin=builtin)

    def register_plugin(
        self, obj: Any, name: str, *, version: str = "?", builtin: bool = False
    ) -> PluginInfo:
        """Register one plugin object (module or instance) and collect what it provides.

        Used by entry-point loading and by tests that register a plugin directly. A blocked name
        is ignored; loading the same name twice is a no-op (idempotent).
        """
        if name in self._blocked:
            return PluginInfo(name, version, builtin, error="blocked by PAGEBATCH_BLOCK_PLUGINS")
        if name in self.plugins:
            return self.plugins[name]
        try:
            self.pm.register(obj, name=name)
        except Exception as e:
            return self._broken(name, version, builtin, f"{type(e).__name__}: {e}")
        unknown = [
            hook.name  # the name pluggy looked up, not the function's own __name__
            for hook in self.pm.get_hookcallers(obj) or []
            for impl in hook.get_hookimpls()
            if impl.plugin is obj and hook.spec is None
        ]
        if unknown:
            self.pm.unregister(obj)
            return self._broken(
                name, version, builtin,
                f"unknown hook(s) {sorted(set(unknown))}; known hooks: {_hook_names()}",
            )
        info = PluginInfo(name, version, builtin)
        staged: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
        try:
            for kind, hook_name in KINDS.items():
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin is obj:
                        impl.function(register=self._collector(kind, name, staged[kind]))
        except DuplicatePluginError:
            self.pm.unregister(obj)
            raise
        except Exception as e:
            self.pm.unregister(obj)
            return self._broken(name, version, builtin, f"hook raised {type(e).__name__}: {e}")
        for kind, comps in staged.items():
            for cname, cobj in comps.items():
                self._components[kind][cname] = (cobj, name)
            if comps:
                info.provides[kind] = sorted(comps)
        self.plugins[name] = info
        return info

    def _collector(self, kind: str, plugin: str, staged: dict[str, Any]) -> Callable:
        def register(*args: Any) -> None:
            if kind == "config_option":
                (opt,) = args
                cname, cobj = opt.name, opt
            else:
                cname, cobj = args
            owner = self._components[kind].get(cname)
            if owner is not None or cname in staged:
                other = owner[1] if owner is not None else plugin
                raise DuplicatePluginError(
                    f"{kind.replace('_', ' ')} {cname!r} is registered by two plugins: "
                    f"{other!r} and {plugin!r}; block one with PAGEBATCH_BLOCK_PLUGINS"
                )
            staged[cname] = cobj

        return register

    def _broken(self, name: str, version: str, builtin: bool, error: str) -> PluginInfo:
        logger.warning("plugin %r skipped: %s", name, error)
        info = PluginInfo(name, version, builtin, error=error)
        self.plugins[name] = info
        return info

    # ---- typed lookups ------------------------------------------------------------------------

    def names(self, kind: str) -> list[str]:
        return sorted(self._components[kind])

    def get(self, kind: str, name: str) -> Any:
        """The component of ``kind`` named ``name``; raises PluginError naming the choices."""
        found = self._components[kind].get(name)
        if found is not None:
            return found[0]
        msg = f"no {kind.replace('_', ' ')} named {name!r}; registered: {self.names(kind)}"
        broken = {n: p.error for n, p in self.plugins.items() if p.error}
        if name in broken:
            msg += f". Plugin {name!r} failed to load: {broken[name]}"
        elif broken:
            msg += f". Plugins that failed to load: {broken}"
        if name in self._blocked:
            msg += f". {name!r} is blocked by PAGEBATCH_BLOCK_PLUGINS"
        raise PluginError(msg)

    def provider(self, kind: str, name: str) -> str:
        """The plugin name that registered ``name``."""
        self.get(kind, name)
        return self._components[kind][name][1]

    def scheduling_policy(self, name: str) -> type:
        return self.get("scheduling_policy", name)

    def quant_method(self, name: str) -> type:
        return self.get("quant_method", name)

    def attention_backend(self, name: str) -> type:
        return self.get("attention_backend", name)

    def structured_output_backend(self, name: str) -> type:
        """The `StructuredOutputBackend` class named ``name`` (core/structured_output.py)."""
        return self.get("structured_output_backend", name)

    def tool_parser(self, name: str) -> type:
        """The `ToolParser` class named ``name`` (core/tool_parser.py)."""
        return self.get("tool_parser", name)

    def model_class(self, architecture: str) -> type[CausalLM]:
        """The model class of a Hugging Face architecture name (core/model.py)."""
        return self.get("model", architecture)

    def frontend(self, name: str) -> Frontend:
        """The frontend named ``name`` (core/frontend.py)."""
        return self.get("frontend", name)

    def command(self, name: str) -> Any:
        """The CLI subcommand ``name`` a plugin registered (``register_commands``)."""
        return self.get("command", name)

    def config_options(self) -> dict[str, Any]:
        return {n: c for n, (c, _) in self._components["config_option"].items()}

    # ---- lifecycle hooks ----------------------------------------------------------------------

    def engine_started(self, config: Any) -> None:
        self.pm.hook.engine_started(config=config)

    def request_finished(self, output: Any) -> None:
        self.pm.hook.request_finished(output=output)

    @property
    def has_request_finished_hooks(self) -> bool:
        return bool(self.pm.hook.request_finished.get_hookimpls())


_registry: Registry | None = None
_lock = threading.Lock()


def registry() -> Registry:
    """The process-wide registry, loading entry-point plugins on first use (idempotent)."""
    global _registry
    with _lock:
        if _registry is None:
            reg = Registry()
            reg.load_entry_points()
            _registry = reg
        return _registry


def reset_registry() -> None:
    """Forget loaded plugins; the next ``registry()`` reloads from entry points (for tests)."""
    global _registry
    with _lock:
        _registry = None
