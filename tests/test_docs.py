"""Meta-tests that keep the docs in step with the code: every config key is in
docs/configuration.md, every hook has a heading in docs/plugins.md, and the example configs
parse."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pagebatch import hookspecs
from pagebatch.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples" / "configs"


def _hook_names() -> list[str]:
    marker = f"{hookspecs.PROJECT}_spec"
    return sorted(n for n, f in vars(hookspecs).items() if hasattr(f, marker))


def _headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#")]


@pytest.mark.parametrize("key", [o.name for o in EngineConfig.core_options()])
def test_config_key_documented(key):
    text = (DOCS / "configuration.md").read_text()
    assert f"`{key}`" in text, f"config key {key!r} is not documented in docs/configuration.md"


@pytest.mark.parametrize("opt", EngineConfig.core_options(), ids=lambda o: o.name)
def test_config_default_documented(opt):
    """The key's table row gives its current default (as YAML)."""
    text = (DOCS / "configuration.md").read_text()
    row = re.search(rf"^\| `{re.escape(opt.name)}` \| `([^`]*)` \|", text, re.M)
    assert row, f"no table row `| `{opt.name}` | `DEFAULT` | ...` in docs/configuration.md"
    assert yaml.safe_load(row.group(1)) == opt.default, (
        f"docs/configuration.md gives {opt.name} default {row.group(1)!r}, code has "
        f"{opt.default!r}")


def test_hooks_exist():
    assert "register_scheduling_policies" in _hook_names()


@pytest.mark.parametrize("hook", _hook_names())
def test_hook_documented(hook):
    headings = _headings((DOCS / "plugins.md").read_text())
    assert any(f"`{hook}" in h for h in headings), (
        f"hook {hook!r} (core/hookspecs.py) has no heading in docs/plugins.md")


def test_smollm2_cpu_example_parses():
    cfg = EngineConfig.from_sources(file=EXAMPLES / "smollm2-cpu.yaml")
    assert cfg.model == "smollm2-135m"
    assert cfg.device == "cpu"
    assert cfg.dtype == "float32"
    assert cfg.kv_cache_memory == 2**30
    assert cfg.max_model_len == 2048
    assert cfg.max_num_seqs == 64


def test_full_example_in_configuration_md_parses():
    """The full example file in docs/configuration.md sets every core key to its default."""
    text = (DOCS / "configuration.md").read_text()
    block = re.search(r"## A full example.*?```yaml\n(.*?)```", text, re.S)
    assert block, "docs/configuration.md has no yaml block under '## A full example'"
    data = yaml.safe_load(block.group(1))
    assert set(data) == {o.name for o in EngineConfig.core_options()}
    cfg = EngineConfig.from_dict(data, plugin_options={})
    assert cfg.to_dict() == EngineConfig().to_dict()


# (folder, architecture, hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied)
SHAPES = [
    ("llama-3.2-1b", "LlamaForCausalLM", 2048, 16, 32, 8, 64, 8192, 128256, True),
    ("llama-3.1-8b", "LlamaForCausalLM", 4096, 32, 32, 8, 128, 14336, 128256, False),
    ("qwen3-0.6b", "Qwen3ForCausalLM", 1024, 28, 16, 8, 128, 3072, 151936, True),
    # shapes of no packaged kernel table (scripts/gpu_shapes.sh)
    ("qwen2.5-7b", "Qwen2ForCausalLM", 3584, 28, 28, 4, 128, 18944, 152064, False),
    ("qwen3-4b", "Qwen3ForCausalLM", 2560, 36, 32, 8, 128, 9728, 151936, True),
    ("mistral-nemo-12b", "MistralForCausalLM", 5120, 40, 32, 8, 128, 14336, 131072, False),
    # Mistral 7B v0.1: a 4096-token sliding window (scripts/gpu_swa.sh)
    ("mistral-7b-v0.1", "MistralForCausalLM", 4096, 32, 32, 8, 128, 14336, 32000, False),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_benchmark_shape_configs_load(shape):
    """examples/configs/*/config.json load with transformers and hold the public shapes."""
    from transformers import AutoConfig

    folder, arch, *dims = shape
    cfg = AutoConfig.from_pretrained(str(EXAMPLES / folder))
    assert cfg.architectures == [arch]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert [cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, head_dim, cfg.intermediate_size, cfg.vocab_size,
            cfg.tie_word_embeddings] == dims


# ---- built-in plugins: docs/plugins.md and docs/configuration.md against the registry ---------

def _builtins() -> dict[str, dict[str, list[str]]]:
    """Built-in plugin name -> what it provides (kind -> names), from the registry."""
    from pagebatch.registry import registry

    return {i.name: i.provides for i in registry().plugins.values() if i.builtin}


def test_plugins_md_names_every_builtin():
    text = (DOCS / "plugins.md").read_text()
    para = text.split("The built-ins (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`([a-z0-9_]+)`", para)) == set(_builtins())


def test_plugins_md_sample_output_is_the_real_output(capsys):
    """The sample `pagebatch plugins` block holds the built-ins exactly as the command prints
    them (then one broken third-party example)."""
    from pagebatch.cli import main

    assert main(["plugins"]) == 0
    real = capsys.readouterr().out
    real_builtins = real.split("(third-party)")[0].rsplit("\n", 1)[0] if "(third-party)" in real \
        else real
    text = (DOCS / "plugins.md").read_text()
    sample = text.split("### `pagebatch plugins`", 1)[1].split("```", 2)[1].strip("\n")
    sample_builtins = "\n".join(line for line in sample.splitlines()
                                if "(third-party)" not in line and "BROKEN" not in line)
    real_lines = [line for line in real_builtins.splitlines()]
    assert sample_builtins.splitlines() == real_lines[:len(sample_builtins.splitlines())]
    assert len(sample_builtins.splitlines()) == len(real_lines), "built-ins missing"


@pytest.mark.parametrize("key, kind", [("scheduling_policy", "scheduling_policy"),
                                       ("quantization", "quant_method"),
                                       ("attention_backend", "attention_backend")])
def test_configuration_md_names_the_builtins_of_each_plugin_key(key, kind):
    text = (DOCS / "configuration.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
    names = {n for p in _builtins().values() for n in p.get(kind, [])}
    missing = sorted(n for n in names if f"`{n}`" not in row)
    assert not missing, f"{key}: built-ins {missing} not named in docs/configuration.md"


def test_builtin_plugins_config_keys_are_documented_with_their_defaults():
    from pagebatch.registry import registry

    text = (DOCS / "configuration.md").read_text() + (DOCS / "serving.md").read_text()
    for opt in registry().config_options().values():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{opt.name}` |")),
                   None)
        assert row is not None, f"plugin key {opt.name} is in no table of the docs"
        cell = re.match(r"^\| `[^`]*` \| `([^`]*)` \|", row)
        assert cell and yaml.safe_load(cell.group(1)) == opt.default, (opt.name, row[:80])


def test_example_plugin_readme_matches_the_plugin():
    """The out-of-tree example's README: its flags are the plugin's config keys, its install
    line targets the README's .venv."""
    import importlib.util

    folder = ROOT / "examples" / "plugin-shortest-first"
    spec = importlib.util.spec_from_file_location(
        "_example_plugin", folder / "pagebatch_shortest_first" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    keys = []
    mod.register_config_options(lambda opt: keys.append(opt.name))
    policies = []
    mod.register_scheduling_policies(lambda name, cls: policies.append(name))
    readme = (folder / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    engine = {o.name for o in EngineConfig.core_options()}
    for flag in re.findall(r"--([a-z][a-z0-9-]+)", block):
        name = flag.replace("-", "_")
        assert name in keys or name in engine or name in ("no_deps", "prompt"), flag
    assert f"--scheduling-policy {policies[0]}" in block
    assert ".venv/bin/pip install" in block and ".venv/bin/pagebatch" in block
