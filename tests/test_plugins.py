"""The plugin registry (core/registry.py): entry points, validation, env variables, lookups, CLI.

Third-party plugins are faked by replacing ``importlib.metadata.entry_points`` as
pagebatch.registry sees it; test plugins are modules built here with ``@hookimpl`` functions.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

import pagebatch.registry as registry_mod
from helpers_sched import FakeRunner, make_request, run_until_done
from pagebatch import hookspecs
from pagebatch.cli import main as cli_main
from pagebatch.config import ConfigOption
import tomllib

from pagebatch.errors import DuplicatePluginError, PluginError
from pagebatch.hookspecs import hookimpl
from pagebatch.kv_cache import KVCacheManager
from pagebatch.registry import Registry, registry, reset_registry
from pagebatch.scheduler import Scheduler, SchedulingPolicy

# every built-in is an entry point in pyproject.toml; these four are checked in detail
_PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
BUILTINS = set(_PYPROJECT["project"]["entry-points"]["pagebatch"])
BUILTIN_POLICIES = ["fcfs", "lpm", "priority"]
BUILTIN_OPTIONS = {"lpm_fcfs_threshold", "lpm_max_wait",  # lpm; then the http frontend's
                   "host", "port", "api_key", "served_model_name", "max_request_body_bytes",
                   "max_prompts_per_request", "max_n_per_request", "allowed_origins",
                   "shutdown_timeout", "metrics_vllm_names", "metrics_require_api_key",
                   "tool_call_parser", "enable_auto_tool_choice",
                   "exclude_tools_when_tool_choice_none"}
KNOWN_PROVIDES = {
    "fcfs": {"scheduling_policy": ["fcfs"]},
    "fp16": {"quant_method": ["fp16"]},
    "torch_ref": {"attention_backend": ["torch_ref"]},
    "llama": {"model": ["LlamaForCausalLM"]},
}
ENV_VARS = ("PAGEBATCH_PLUGINS", "PAGEBATCH_DISABLE_PLUGIN_AUTOLOAD", "PAGEBATCH_BLOCK_PLUGINS")


@pytest.fixture(autouse=True)
def third_party(monkeypatch):
    """Isolation for every test here: no plugin env variable from outside, the process-wide
    registry restored afterwards, and entry points = the built-ins + the fake third-party ones
    a test appends to the returned list (third-party plugins installed for real are hidden)."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(registry_mod, "_registry", None)
    real = registry_mod.importlib.metadata.entry_points
    fakes: list[FakeEntryPoint] = []

    def entry_points(**kw):
        eps = list(real(**kw))
        if kw.get("group") == registry_mod.ENTRY_POINT_GROUP:
            eps = [ep for ep in eps if ep.dist is not None
                   and ep.dist.name == registry_mod.BUILTIN_DISTRIBUTION] + fakes
        return eps

    monkeypatch.setattr(registry_mod.importlib.metadata, "entry_points", entry_points)
    return fakes


def plugin_module(name: str, **hooks) -> types.ModuleType:
    """A plugin module named ``name`` whose attributes are the given (hookimpl) functions."""
    mod = types.ModuleType(name)
    for k, fn in hooks.items():
        setattr(mod, k, fn)
    return mod


class LifoPolicy(SchedulingPolicy):
    """Admits the newest request first; preempts the oldest admitted."""

    def order_waiting(self, waiting, ctx):
        return list(reversed(waiting))

    def select_victim(self, candidates):
        return candidates[0]


class FakeQuant:
    pass


class FakeBackend:
    pass


class FakeModel:
    pass


FAKE_FRONTEND = types.SimpleNamespace(add_cli_arguments=lambda p: None, run=lambda c, a: 0)
LIFO_OPTION = ConfigOption("lifo_depth", 4, "How deep LIFO goes.", int)


@hookimpl
def register_scheduling_policies(register):
    register("lifo", LifoPolicy)


@hookimpl
def register_quant_methods(register):
    register("fakeq", FakeQuant)


@hookimpl
def register_attention_backends(register):
    register("fake_attn", FakeBackend)


@hookimpl
def register_models(register):
    register("FakeForCausalLM", FakeModel)


@hookimpl
def register_frontends(register):
    register("fake_frontend", FAKE_FRONTEND)


class FakeStructuredBackend:
    pass


@hookimpl
def register_structured_output_backends(register):
    register("fake_so", FakeStructuredBackend)


class FakeToolParser:
    pass


@hookimpl
def register_tool_parsers(register):
    register("fake_tools", FakeToolParser)


@hookimpl
def register_config_options(register):
    register(LIFO_OPTION)


def full_plugin(name="test_plugin"):
    return plugin_module(
        name, register_scheduling_policies=register_scheduling_policies,
        register_quant_methods=register_quant_methods,
        register_attention_backends=register_attention_backends,
        register_models=register_models, register_frontends=register_frontends,
        register_structured_output_backends=register_structured_output_backends,
        register_tool_parsers=register_tool_parsers,
        register_config_options=register_config_options)


def policy_plugin(name, policy_name, cls=LifoPolicy, extra=()):
    @hookimpl
    def register_scheduling_policies(register):
        for n in extra:
            register(n, cls)
        register(policy_name, cls)

    return plugin_module(name, register_scheduling_policies=register_scheduling_policies)


class FakeEntryPoint:
    """What Registry.load_entry_points reads of an importlib.metadata.EntryPoint."""

    def __init__(self, name, obj, dist="pagebatch-extras", version="1.2.3"):
        self.name = name
        self.dist = types.SimpleNamespace(name=dist, version=version)
        self._obj = obj
        self.loads = 0

    def load(self):
        self.loads += 1
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def loaded_registry() -> Registry:
    reg = Registry()
    reg.load_entry_points()
    return reg


def healthy(reg):
    return {n for n, p in reg.plugins.items() if p.error is None}


# ---- built-ins ----------------------------------------------------------------------------------

def test_builtins_load_from_entry_points():
    from pagebatch.plugins.attention.torch_ref import TorchRefBackend
    from pagebatch.plugins.models.llama import LlamaForCausalLM
    from pagebatch.quant.fp16 import UnquantizedMethod
    from pagebatch.schedulers.fcfs import FCFSPolicy

    reg = loaded_registry()
    for name, provides in KNOWN_PROVIDES.items():
        info = reg.plugins[name]
        assert (info.builtin, info.error, info.provides) == (True, None, provides)
        assert info.version == "0.1.0"
    assert reg.scheduling_policy("fcfs") is FCFSPolicy
    assert reg.quant_method("fp16") is UnquantizedMethod
    assert reg.attention_backend("torch_ref") is TorchRefBackend
    assert reg.model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert reg.provider("scheduling_policy", "fcfs") == "fcfs"
    assert reg.names("scheduling_policy") == BUILTIN_POLICIES


def test_loading_is_idempotent():
    reg = loaded_registry()
    before = {n: p for n, p in reg.plugins.items()}
    reg.load_entry_points()  # worker processes load again: no duplicate errors
    assert reg.plugins == before
    assert reg.names("scheduling_policy") == BUILTIN_POLICIES
    from pagebatch.schedulers import fcfs

    assert reg.register_plugin(fcfs, "fcfs") is before["fcfs"]


def test_registry_singleton_and_reset():
    a = registry()
    assert registry() is a
    assert set(BUILTINS) <= healthy(a)
    reset_registry()
    b = registry()
    assert b is not a and registry() is b
    assert set(BUILTINS) <= healthy(b)


# ---- a test plugin ------------------------------------------------------------------------------

def test_register_plugin_and_look_its_components_up():
    reg = loaded_registry()
    info = reg.register_plugin(full_plugin(), "test_plugin", version="9.9")
    assert (info.name, info.version, info.builtin, info.error) == (
        "test_plugin", "9.9", False, None)
    assert info.provides == {
        "scheduling_policy": ["lifo"], "quant_method": ["fakeq"],
        "attention_backend": ["fake_attn"], "model": ["FakeForCausalLM"],
        "frontend": ["fake_frontend"], "config_option": ["lifo_depth"],
        "structured_output_backend": ["fake_so"], "tool_parser": ["fake_tools"],
    }
    assert reg.structured_output_backend("fake_so") is FakeStructuredBackend
    assert reg.tool_parser("fake_tools") is FakeToolParser
    assert reg.scheduling_policy("lifo") is LifoPolicy
    assert reg.quant_method("fakeq") is FakeQuant
    assert reg.attention_backend("fake_attn") is FakeBackend
    assert reg.model_class("FakeForCausalLM") is FakeModel
    assert reg.frontend("fake_frontend") is FAKE_FRONTEND
    assert reg.config_options()["lifo_depth"] == LIFO_OPTION
    assert set(reg.config_options()) == {"lifo_depth", *BUILTIN_OPTIONS}
    assert reg.provider("scheduling_policy", "lifo") == "test_plugin"
    assert reg.names("scheduling_policy") == sorted(BUILTIN_POLICIES + ["lifo"])


def test_plugin_as_a_class_with_static_hooks():
    class Plugin:
        @staticmethod
        @hookimpl
        def register_quant_methods(register):
            register("classq", FakeQuant)

    reg = Registry()
    assert reg.register_plugin(Plugin, "class_plugin").provides == {"quant_method": ["classq"]}
    assert reg.quant_method("classq") is FakeQuant


def test_unknown_name_lists_registered_names():
    reg = loaded_registry()
    with pytest.raises(PluginError, match=r"no scheduling policy named 'nope'; "
                                          r"registered: \['fcfs', 'lpm', 'priority'\]"):
        reg.scheduling_policy("nope")
    with pytest.raises(PluginError, match=r"no model named 'GPT2LMHeadModel'; "
                                          r"registered: \[.*'LlamaForCausalLM'.*\]"):
        reg.model_class("GPT2LMHeadModel")
    with pytest.raises(PluginError, match="no frontend named 'grpc'; registered: \\['serve'\\]"):
        reg.frontend("grpc")


# ---- validation ---------------------------------------------------------------------------------

def test_duplicate_name_names_both_plugins():
    reg = loaded_registry()
    dup = policy_plugin("dup_plugin", "fcfs", extra=["other_policy"])
    with pytest.raises(DuplicatePluginError) as e:
        reg.register_plugin(dup, "dup_plugin")
    msg = str(e.value)
    assert "'fcfs'" in msg and "'dup_plugin'" in msg and "scheduling policy" in msg
    # nothing of the failed plugin stays registered; the built-in is untouched
    assert "dup_plugin" not in reg.plugins
    assert reg.names("scheduling_policy") == BUILTIN_POLICIES
    assert reg.provider("scheduling_policy", "fcfs") == "fcfs"
    assert not reg.pm.is_registered(dup)


def test_duplicate_between_two_test_plugins():
    reg = Registry()
    reg.register_plugin(policy_plugin("first", "shared"), "first")
    with pytest.raises(DuplicatePluginError, match=r"'shared'.*'first' and 'second'"):
        reg.register_plugin(policy_plugin("second", "shared"), "second")
    assert reg.provider("scheduling_policy", "shared") == "first"


def test_misspelled_hook_is_reported_and_skipped():
    @hookimpl
    def register_scheduling_policy(register):  # singular: no such hook
        register("typo", LifoPolicy)

    reg = loaded_registry()
    bad = plugin_module("typo_plugin", register_scheduling_policy=register_scheduling_policy)
    info = reg.register_plugin(bad, "typo_plugin")
    assert info.error is not None
    assert "unknown hook(s) ['register_scheduling_policy']" in info.error
    assert "register_scheduling_policies" in info.error  # the known hooks are listed
    assert reg.plugins["typo_plugin"] is info and not info.provides
    assert not reg.pm.is_registered(bad)
    with pytest.raises(PluginError, match="typo_plugin"):
        reg.scheduling_policy("typo")
    # the others still load and work
    assert reg.register_plugin(full_plugin(), "good").error is None
    assert reg.scheduling_policy("lifo") is LifoPolicy
    assert set(BUILTINS) <= healthy(reg)


def test_hook_with_wrong_argument_is_reported():
    @hookimpl
    def register_models(registrar):  # the spec's argument is 'register'
        registrar("X", FakeModel)

    reg = Registry()
    info = reg.register_plugin(plugin_module("argbad", register_models=register_models), "argbad")
    assert info.error is not None and "registrar" in info.error
    assert reg.names("model") == []


def test_hook_that_raises_is_skipped_with_its_partial_registrations():
    @hookimpl
    def register_scheduling_policies(register):
        register("half_done", LifoPolicy)
        raise RuntimeError("boom")

    started = []

    @hookimpl
    def engine_started(config):
        started.append(config)

    reg = loaded_registry()
    raiser = plugin_module("raiser", register_scheduling_policies=register_scheduling_policies,
                           register_models=register_models, engine_started=engine_started)
    info = reg.register_plugin(raiser, "raiser")
    assert info.error == "hook raised RuntimeError: boom"
    assert not reg.pm.is_registered(raiser)
    reg.engine_started("cfg")
    assert started == []  # a skipped plugin gets no lifecycle calls either
    assert reg.names("scheduling_policy") == BUILTIN_POLICIES
    assert "FakeForCausalLM" not in reg.names("model")
    with pytest.raises(PluginError, match="raiser"):
        reg.scheduling_policy("half_done")
    assert reg.register_plugin(full_plugin(), "good").error is None


def test_broken_third_party_entry_points_are_skipped(third_party):
    third_party += [
        FakeEntryPoint("import_fails", ImportError("no module named 'missing_dep'")),
        FakeEntryPoint("typo", plugin_module("typo", register_model=register_models)),
        FakeEntryPoint("good", full_plugin("good")),
    ]
    reg = loaded_registry()
    assert reg.plugins["import_fails"].error == (
        "import failed: ImportError: no module named 'missing_dep'")
    assert "unknown hook(s) ['register_model']" in reg.plugins["typo"].error
    assert healthy(reg) == set(BUILTINS) | {"good"}
    good = reg.plugins["good"]
    assert (good.version, good.builtin) == ("1.2.3", False)
    assert reg.scheduling_policy("lifo") is LifoPolicy


# ---- environment variables ----------------------------------------------------------------------

@pytest.fixture
def two_third_party(third_party):
    eps = {
        "alpha": FakeEntryPoint("alpha", policy_plugin("alpha", "alpha_policy")),
        "beta": FakeEntryPoint("beta", policy_plugin("beta", "beta_policy")),
    }
    third_party += list(eps.values())
    return eps


def test_third_party_plugins_load_by_default(two_third_party):
    reg = loaded_registry()
    assert healthy(reg) == set(BUILTINS) | {"alpha", "beta"}
    assert reg.names("scheduling_policy") == sorted(["alpha_policy", "beta_policy",
                                                     *BUILTIN_POLICIES])


def test_allow_list_limits_third_party_only(monkeypatch, two_third_party):
    monkeypatch.setenv("PAGEBATCH_PLUGINS", " beta ,")
    reg = loaded_registry()
    assert healthy(reg) == set(BUILTINS) | {"beta"}
    assert two_third_party["alpha"].loads == 0  # not even imported
    assert reg.names("scheduling_policy") == sorted(["beta_policy", *BUILTIN_POLICIES])


def test_disable_autoload_loads_builtins_only(monkeypatch, two_third_party):
    monkeypatch.setenv("PAGEBATCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PAGEBATCH_PLUGINS", "alpha")  # the allow-list does not override it
    reg = loaded_registry()
    assert set(reg.plugins) == set(BUILTINS)
    assert all(ep.loads == 0 for ep in two_third_party.values())


def test_disable_autoload_zero_means_off(monkeypatch, two_third_party):
    monkeypatch.setenv("PAGEBATCH_DISABLE_PLUGIN_AUTOLOAD", "0")
    assert healthy(loaded_registry()) == set(BUILTINS) | {"alpha", "beta"}


def test_block_list_blocks_builtins_and_third_party(monkeypatch, two_third_party):
    monkeypatch.setenv("PAGEBATCH_BLOCK_PLUGINS", "fp16,alpha")
    reg = loaded_registry()
    assert set(reg.plugins) == set(BUILTINS) - {"fp16"} | {"beta"}
    assert two_third_party["alpha"].loads == 0
    with pytest.raises(PluginError, match="blocked by PAGEBATCH_BLOCK_PLUGINS"):
        reg.quant_method("fp16")
    # registering a blocked plugin name by hand is ignored too
    info = reg.register_plugin(policy_plugin("alpha", "alpha_policy"), "alpha")
    assert "blocked" in info.error and "alpha_policy" not in reg.names("scheduling_policy")


def test_blocked_builtin_replaced_by_test_plugin_and_scheduler_runs_with_it(monkeypatch):
    """Built-ins are plugins like any other: block fcfs, register another 'fcfs', run."""
    monkeypatch.setenv("PAGEBATCH_BLOCK_PLUGINS", "fcfs")
    reg = loaded_registry()
    assert "fcfs" not in reg.plugins and "fcfs" not in reg.names("scheduling_policy")
    assert set(BUILTINS) - {"fcfs"} <= healthy(reg)
    info = reg.register_plugin(policy_plugin("my_policies", "fcfs"), "my_policies")
    assert info.provides == {"scheduling_policy": ["fcfs"]}
    assert reg.provider("scheduling_policy", "fcfs") == "my_policies"

    policy = reg.scheduling_policy("fcfs")(None)
    assert isinstance(policy, LifoPolicy)
    sched = Scheduler(KVCacheManager(16, 4), policy, max_num_seqs=1, max_num_batched_tokens=64,
                      clock=lambda: 0.0)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 3, max_tokens=2))
    outs = run_until_done(sched, FakeRunner(4))
    # the replacement decides: newest first (the built-in would run a, b, c)
    assert [so.scheduled[0].request_id for so in outs] == ["c", "c", "b", "b", "a", "a"]
    assert sched.kv_cache.num_free_blocks == 16


# ---- lifecycle hooks ----------------------------------------------------------------------------

def test_lifecycle_hooks_reach_every_plugin():
    calls = []

    def recorder(tag):
        @hookimpl
        def engine_started(config):
            calls.append((tag, "engine_started", config))

        @hookimpl
        def request_finished(output):
            calls.append((tag, "request_finished", output))

        return plugin_module(tag, engine_started=engine_started,
                             request_finished=request_finished)

    reg = Registry()
    assert not reg.has_request_finished_hooks
    reg.engine_started("cfg")  # no plugin: nothing happens, nothing raises
    for tag in ("stats_a", "stats_b"):
        assert reg.register_plugin(recorder(tag), tag).error is None
    assert reg.has_request_finished_hooks
    assert reg.plugins["stats_a"].provides == {}
    reg.engine_started("cfg")
    reg.request_finished("out-1")
    assert sorted(calls) == [
        ("stats_a", "engine_started", "cfg"), ("stats_a", "request_finished", "out-1"),
        ("stats_b", "engine_started", "cfg"), ("stats_b", "request_finished", "out-1"),
    ]


def test_lifecycle_hook_with_wrong_argument_is_reported():
    @hookimpl
    def request_finished(request):  # the spec's argument is 'output'
        pass

    reg = Registry()
    info = reg.register_plugin(plugin_module("bad", request_finished=request_finished), "bad")
    assert info.error is not None and not reg.has_request_finished_hooks


# ---- `pagebatch plugins` ------------------------------------------------------------------------

def test_cli_plugins_lists_builtins_and_what_they_register(capsys, third_party):
    third_party += [FakeEntryPoint("alpha", policy_plugin("alpha", "alpha_policy")),
                    FakeEntryPoint("broken", ImportError("gone"))]
    assert cli_main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name, provides in KNOWN_PROVIDES.items():
        ((kind, names),) = provides.items()
        assert re.search(rf"^{name} 0\.1\.0 \(built-in\)\n    {kind}: {', '.join(names)}$", out,
                         re.M), out
    assert re.search(r"^alpha 1\.2\.3 \(third-party\)\n    scheduling_policy: alpha_policy$",
                     out, re.M)
    assert re.search(r"^broken 1\.2\.3 \(third-party\)\n    BROKEN: import failed: "
                     r"ImportError: gone$", out, re.M)
    # built-ins first, then third-party
    assert out.index("torch_ref") < out.index("alpha") and out.index("fcfs") < out.index("alpha")


# ---- CLI subcommands of plugins (register_commands) ----------------------------------------------

class ShoutCommand:
    help = "print a word in capitals"

    def add_arguments(self, parser):
        parser.add_argument("word")
        parser.add_argument("--status", type=int, default=0)

    def run(self, args):
        print(args.word.upper())
        return args.status


def test_a_plugin_command_is_a_pagebatch_subcommand(capsys, third_party):
    @hookimpl
    def register_commands(register):
        register("shout", ShoutCommand())

    third_party.append(FakeEntryPoint("shouter", plugin_module(
        "shouter", register_commands=register_commands)))
    assert cli_main(["shout", "hello", "--status", "3"]) == 3
    assert capsys.readouterr().out == "HELLO\n"
    reg = registry()
    assert reg.plugins["shouter"].provides == {"command": ["shout"]}
    assert isinstance(reg.command("shout"), ShoutCommand)


def test_quantize_is_registered_by_the_quant_package():
    from pagebatch.quant.calibrate.command import QuantizeCommand

    reg = loaded_registry()
    info = reg.plugins["quantize"]
    assert (info.builtin, info.error, info.provides) == (True, None, {"command": ["quantize"]})
    assert isinstance(reg.command("quantize"), QuantizeCommand)


def test_blocking_the_quantize_plugin_takes_its_subcommand_away(monkeypatch, capsys):
    monkeypatch.setenv("PAGEBATCH_BLOCK_PLUGINS", "quantize")
    with pytest.raises(SystemExit):
        cli_main(["quantize", "m", "out", "--method", "awq"])
    assert "invalid choice: 'quantize'" in capsys.readouterr().err


# ---- meta: every hook is tested and documented --------------------------------------------------

def test_every_hookspec_is_implemented_by_a_test_and_documented():
    specs = [n for n in vars(hookspecs) if hasattr(getattr(hookspecs, n), "pagebatch_spec")]
    assert len(specs) >= 8
    sources = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    untested = [n for n in specs if not re.search(rf"^\s*def {n}\(", sources, re.M)]
    assert untested == [], f"hooks with no test plugin implementing them: {untested}"
    undocumented = [n for n in specs if len((getattr(hookspecs, n).__doc__ or "").strip()) < 20]
    assert undocumented == [], f"hooks with no docstring: {undocumented}"
