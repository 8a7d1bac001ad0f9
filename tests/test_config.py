"""EngineConfig (core/config.py): defaults, YAML file, CLI > file > defaults, errors, plugins."""

from __future__ import annotations

import argparse

import pytest

import pagebatch.registry as registry_mod
from pagebatch.config import (ConfigOption, EngineConfig, add_cli_options, cli_values,
                              load_yaml, parse_bool, parse_size)
from pagebatch.errors import ConfigError
from pagebatch.hookspecs import hookimpl
from pagebatch.registry import Registry

THRESHOLD = ConfigOption("my_threshold", 0.5, "A policy's threshold.", float)
FLAG = ConfigOption("my_flag", False, "A plugin's switch.", parse_bool, is_flag=True)
PLUGIN_OPTS = {o.name: o for o in (THRESHOLD, FLAG)}


def from_dict(values, plugin_options=None):
    return EngineConfig.from_dict(values, plugin_options or {})


def write(tmp_path, text, name="engine.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- defaults -----------------------------------------------------------------------------------

def test_defaults():
    cfg = EngineConfig()
    assert cfg.model == "smollm2-135m"
    assert (cfg.device, cfg.dtype, cfg.load_format) == ("auto", "auto", "auto")
    assert cfg.block_size == 16
    assert cfg.gpu_memory_utilization == 0.9
    assert cfg.kv_cache_memory is None and cfg.num_kv_blocks is None
    assert cfg.scheduling_policy == "fcfs"
    assert cfg.max_num_seqs == 256
    assert cfg.max_num_batched_tokens is None and cfg.max_model_len is None
    assert cfg.quantization is None and cfg.attention_backend is None
    assert cfg.plugin_options == {}
    assert EngineConfig.from_sources(plugin_options={}) == cfg


def test_core_options_cover_every_public_field():
    names = [o.name for o in EngineConfig.core_options()]
    assert "plugin_options" not in names
    assert {"model", "dtype", "block_size", "max_num_seqs", "kv_cache_memory",
            "scheduling_policy", "max_num_batched_tokens", "num_kv_blocks"} <= set(names)
    assert set(EngineConfig().to_dict()) == set(names)


# ---- sources ------------------------------------------------------------------------------------

def test_yaml_file_loading(tmp_path):
    f = write(tmp_path, "model: /models/llama\ndtype: float32\nblock_size: 32\n"
                        "kv_cache_memory: 512MiB\nmax_num_seqs: 8\n")
    cfg = EngineConfig.from_sources(file=f, plugin_options={})
    assert cfg.model == "/models/llama" and cfg.dtype == "float32"
    assert cfg.block_size == 32 and cfg.max_num_seqs == 8
    assert cfg.kv_cache_memory == 512 * 2**20
    assert cfg.device == "auto"  # untouched keys keep their defaults


def test_empty_yaml_file_gives_defaults(tmp_path):
    cfg = EngineConfig.from_sources(file=write(tmp_path, ""), plugin_options={})
    assert cfg == EngineConfig()


def test_cli_over_file_over_defaults(tmp_path):
    f = write(tmp_path, "max_num_seqs: 8\nblock_size: 32\n")
    cfg = EngineConfig.from_sources(cli={"max_num_seqs": "4", "dtype": "float16"}, file=f,
                                    plugin_options={})
    assert cfg.max_num_seqs == 4  # CLI wins over the file
    assert cfg.block_size == 32  # the file wins over the default
    assert cfg.dtype == "float16"  # CLI over the default
    assert cfg.gpu_memory_utilization == 0.9  # default


def test_dashed_keys_in_file_and_cli(tmp_path):
    f = write(tmp_path, "max-num-seqs: 8\nkv-cache-memory: 1GiB\nnum_kv_blocks: 12\n")
    cfg = EngineConfig.from_sources(file=f, plugin_options={})
    assert (cfg.max_num_seqs, cfg.kv_cache_memory, cfg.num_kv_blocks) == (8, 2**30, 12)
    cfg = EngineConfig.from_sources(cli={"max-num-seqs": 3}, file=f, plugin_options={})
    assert cfg.max_num_seqs == 3  # a dashed CLI key overrides the dashed file key


def test_cli_typos_get_the_closest_option(capsys):
    """Each unknown flag is named with its subcommand's (or the top level's) closest option."""
    from pagebatch import cli

    for argv, want in ((["generate", "--promt", "x"], "'--promt'; did you mean '--prompt'?"),
                       (["bench", "throughput", "--num-prompt", "3"],
                        "'--num-prompt'; did you mean '--num-prompts'?"),
                       (["--log-levl", "DEBUG", "plugins"],
                        "'--log-levl'; did you mean '--log-level'?"),
                       (["generate", "--prompt", "x", "--zzz"], "unknown option '--zzz'")):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(argv)
        assert want in capsys.readouterr().err, argv


@pytest.mark.parametrize("text, match", [
    ("- a\n- b\n", "must hold a mapping"),
    ("key: [unclosed\n", "not valid YAML"),
])
def test_bad_file_contents(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_sources(file=write(tmp_path, text), plugin_options={})


def test_one_key_in_both_spellings_is_an_error(tmp_path):
    f = write(tmp_path, "max-num-seqs: 8\nmax_num_seqs: 4\n")
    with pytest.raises(ConfigError, match="gives key 'max_num_seqs' twice, as 'max-num-seqs' "
                                          "and 'max_num_seqs'"):
        EngineConfig.from_sources(file=f, plugin_options={})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.from_sources(file=tmp_path / "nope.yaml", plugin_options={})


# ---- errors -------------------------------------------------------------------------------------

def test_unknown_key_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'max_num_seq'.*did you mean "
                                          r"'max_num_seqs'"):
        from_dict({"max_num_seq": 4})
    with pytest.raises(ConfigError, match=r"'schedulng_policy'.*did you mean 'scheduling_policy'"):
        EngineConfig.from_sources(file=write(tmp_path, "schedulng_policy: fcfs\n"),
                                  plugin_options={})
    with pytest.raises(ConfigError) as e:
        from_dict({"zzzz": 1})
    assert "'zzzz'" in str(e.value) and "did you mean" not in str(e.value)


@pytest.mark.parametrize("key, value, allowed", [
    ("max_num_seqs", -1, ">= 1"),
    ("max_num_seqs", "many", "int"),
    ("gpu_memory_utilization", 1.5, "(0, 1]"),
    ("gpu_memory_utilization", 0, "(0, 1]"),
    ("dtype", "float8", "float16"),
    ("device", "tpu", "cuda"),
    ("kv_cache_memory", "lots", "4GiB"),
    ("kv_cache_memory", "-5MiB", "size"),
    ("block_size", 0, ">= 1"),
    ("block_size", 2.5, "integer"),
    ("num_kv_blocks", True, "integer"),
])
def test_bad_values_name_key_value_and_limit(key, value, allowed):
    with pytest.raises(ConfigError) as e:
        from_dict({key: value})
    msg = str(e.value)
    assert repr(key) in msg and repr(value) in msg and allowed in msg


def test_infinite_size_in_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'kv_cache_memory'.*inf"):
        EngineConfig.from_sources(file=write(tmp_path, "kv_cache_memory: .inf\n"),
                                  plugin_options={})


def test_bad_value_from_file_and_cli(tmp_path):
    f = write(tmp_path, "gpu-memory-utilization: 1.5\n")
    with pytest.raises(ConfigError, match=r"'gpu_memory_utilization'.*1\.5"):
        EngineConfig.from_sources(file=f, plugin_options={})
    # a good CLI value overrides the bad file value before it is parsed
    cfg = EngineConfig.from_sources(cli={"gpu_memory_utilization": "0.5"}, file=f,
                                    plugin_options={})
    assert cfg.gpu_memory_utilization == 0.5


def test_budget_below_max_model_len_is_an_error_without_chunked_prefill():
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=100.*max_model_len=200"):
        from_dict({"max_num_batched_tokens": 100, "max_model_len": 200,
                   "enable_chunked_prefill": False})
    cfg = from_dict({"max_num_batched_tokens": 200, "max_model_len": 200,
                     "enable_chunked_prefill": False})
    assert (cfg.max_num_batched_tokens, cfg.max_model_len) == (200, 200)
    # with chunked prefill (the default) a long prompt is split over steps: allowed
    cfg = from_dict({"max_num_batched_tokens": 100, "max_model_len": 200})
    assert cfg.enable_chunked_prefill and cfg.max_num_batched_tokens == 100


def test_optional_values_accept_none_spellings():
    cfg = from_dict({"max_model_len": "none", "kv_cache_memory": None, "quantization": "null"})
    assert (cfg.max_model_len, cfg.kv_cache_memory, cfg.quantization) == (None, None, None)
    assert from_dict({"max_model_len": "2048"}).max_model_len == 2048


# ---- parse_size ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, n", [
    ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), (1000, 1000), ("1000", 1000),
    ("2.5GB", 2_500_000_000), ("64kib", 64 * 1024), (" 3 MB ", 3_000_000), (4096.0, 4096),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["lots", "4 GiBs", "", "0", 0, -1, "1.2.3GB", True,
                                 float("inf"), float("nan"), "9" * 400 + "GiB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


# ---- plugin-declared options --------------------------------------------------------------------

def test_plugin_options_are_accepted_and_stored():
    cfg = from_dict({"my-threshold": "0.75", "max_num_seqs": 2}, PLUGIN_OPTS)
    assert cfg.plugin_options == {"my_threshold": 0.75, "my_flag": False}
    assert cfg.max_num_seqs == 2
    assert not hasattr(cfg, "my_threshold")
    assert cfg.to_dict()["my_threshold"] == 0.75
    # untouched plugin keys get their declared default
    assert from_dict({}, PLUGIN_OPTS).plugin_options == {"my_threshold": 0.5, "my_flag": False}


def test_plugin_option_unknown_without_the_plugin_and_misspelled_with_it():
    with pytest.raises(ConfigError, match="unknown config key 'my_threshold'"):
        from_dict({"my_threshold": 0.1})
    with pytest.raises(ConfigError, match="did you mean 'my_threshold'"):
        from_dict({"my_treshold": 0.1}, PLUGIN_OPTS)
    with pytest.raises(ConfigError, match=r"'my_threshold'.*'high'"):
        from_dict({"my_threshold": "high"}, PLUGIN_OPTS)


def test_plugin_options_from_the_registry_by_default(tmp_path, monkeypatch):
    """With no plugin_options given, the schema is what loaded plugins declared."""
    class OptionsPlugin:
        @staticmethod
        @hookimpl
        def register_config_options(register):
            register(THRESHOLD)

    reg = Registry()
    reg.register_plugin(OptionsPlugin, "options_plugin")
    monkeypatch.setattr(registry_mod, "_registry", reg)
    f = write(tmp_path, "my_threshold: 0.25\n")
    cfg = EngineConfig.from_sources(file=f)
    assert cfg.plugin_options == {"my_threshold": 0.25}
    with pytest.raises(ConfigError, match="did you mean 'my_threshold'"):
        EngineConfig.from_sources(cli={"my-treshold": 1})


# ---- argparse round trip ------------------------------------------------------------------------

def make_parser():
    options = EngineConfig.core_options() + list(PLUGIN_OPTS.values())
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_cli_options(parser, options)
    return parser, options


def test_cli_round_trip(tmp_path):
    parser, options = make_parser()
    f = write(tmp_path, "max_num_seqs: 8\nblock_size: 32\nmy_threshold: 0.9\n")
    args = parser.parse_args(["--config", str(f), "--max-num-seqs", "4", "--kv-cache-memory",
                              "1GiB", "--my-threshold", "0.25", "--my-flag", "--dtype",
                              "float32"])
    cli = cli_values(args, options)
    # only what was given on the command line: unset options stay absent so the file can set them
    assert cli == {"max_num_seqs": "4", "kv_cache_memory": "1GiB", "my_threshold": "0.25",
                   "my_flag": True, "dtype": "float32"}
    cfg = EngineConfig.from_sources(cli=cli, file=args.config, plugin_options=PLUGIN_OPTS)
    assert cfg.max_num_seqs == 4 and cfg.block_size == 32 and cfg.dtype == "float32"
    assert cfg.kv_cache_memory == 2**30
    assert cfg.plugin_options == {"my_threshold": 0.25, "my_flag": True}


def test_cli_no_flag_and_empty_command_line():
    parser, options = make_parser()
    assert cli_values(parser.parse_args(["--no-my-flag"]), options) == {"my_flag": False}
    assert cli_values(parser.parse_args([]), options) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seq-typo", "3"])


def test_cli_bad_value_is_a_config_error():
    parser, options = make_parser()
    cli = cli_values(parser.parse_args(["--max-num-seqs", "-3"]), options)
    with pytest.raises(ConfigError, match=r"'max_num_seqs'.*'-3'.*>= 1"):
        EngineConfig.from_sources(cli=cli, plugin_options=PLUGIN_OPTS)


def test_type_errors_say_what_was_expected():
    """Values of the wrong type get "expected an integer / a number", not Python's int() or
    float() wording."""
    for key, value, want in (("max_num_seqs", [1, 2], "expected an integer"),
                             ("max_num_seqs", "lots", "expected an integer"),
                             ("gpu_memory_utilization", "lots", "expected a number"),
                             ("distributed_timeout", [3], "expected a number")):
        with pytest.raises(ConfigError, match=f"{key}.*{want}"):
            EngineConfig.from_dict({key: value})


def test_yaml_duplicate_keys_and_directories_are_errors(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("max_num_seqs: 2\nmax_num_seqs: 3\n")
    with pytest.raises(ConfigError, match="'max_num_seqs' is given twice"):
        EngineConfig.from_sources(file=str(f))
    with pytest.raises(ConfigError, match="is not a file"):
        EngineConfig.from_sources(file=str(tmp_path))
    merged = tmp_path / "merge.yaml"  # YAML merge keys still work beside the duplicate check
    merged.write_text("base: &b {max_num_seqs: 2}\nserve: {<<: *b, port: 9}\n")
    assert load_yaml(merged)["serve"] == {"max_num_seqs": 2, "port": 9}


def test_cli_options_are_not_abbreviated_and_sampling_flags_are_checked_first(monkeypatch,
                                                                              capsys):
    """`--max-num-seq` is an error, not `--max-num-seqs`; a bad sampling flag of `generate`
    is reported before any model loads."""
    from pagebatch import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "m", "--prompt", "x", "--max-num-seq", "1"])
    assert ("unknown option '--max-num-seq'; did you mean '--max-num-seqs'?"
            in capsys.readouterr().err)

    def no_engine(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("pagebatch.engine.LLMEngine", no_engine)
    monkeypatch.setattr(cli, "_config_from_args", lambda args: None)
    assert cli.main(["generate", "m", "--prompt", "x", "--max-tokens", "-5"]) == 2
    assert "max_tokens=-5 is invalid: must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["long_prefill_token_threshold", "max_mixed_prefill_tokens"])
def test_prefill_caps_need_chunked_prefill(key):
    """Both caps cut prompts into chunks: without chunked prefill the config names the key."""
    assert getattr(from_dict({key: 512}), key) == 512
    with pytest.raises(ConfigError, match=f"{key}=512 .*enable_chunked_prefill=true"):
        from_dict({key: 512, "enable_chunked_prefill": False})
    with pytest.raises(ConfigError, match=key):
        from_dict({key: -1})


def test_serve_has_its_own_step_defaults_below_file_and_command_line(tmp_path, monkeypatch,
                                                                     capsys):
    """`pagebatch serve` defaults two engine keys its own way (the http frontend's
    engine_defaults); the file and the command line still win, `generate` keeps the engine's,
    `--help` shows serve's, and a default the given keys rule out is left out, not an error."""
    import pagebatch.cli as cli
    from pagebatch.registry import registry

    fe = registry().frontend("serve")
    seen = []
    monkeypatch.setattr(type(fe), "run", lambda self, config, args: seen.append(config) or 0)
    parser = cli.build_parser()

    def serve(*argv):
        args = parser.parse_args(["serve", "m", *argv])
        assert args.func(args) == 0
        c = seen[-1]
        return c.max_mixed_prefill_tokens, c.piecewise_cuda_graph_max_tokens

    assert serve() == (4096, 2048)
    assert serve("--config", str(write(tmp_path, "max_mixed_prefill_tokens: 0\n"))) == (0, 2048)
    assert serve("--piecewise-cuda-graph-max-tokens", "512") == (4096, 512)
    assert serve("--no-enable-chunked-prefill") == (0, 2048)
    assert seen[-1].enable_chunked_prefill is False
    with pytest.raises(ConfigError, match="max_mixed_prefill_tokens=64 cuts prompts"):
        serve("--no-enable-chunked-prefill", "--max-mixed-prefill-tokens", "64")
    gen = cli._config_from_args(parser.parse_args(["generate", "m", "--prompt", "x"]))
    assert (gen.max_mixed_prefill_tokens, gen.piecewise_cuda_graph_max_tokens) == (0, 512)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "no cap but the step's token budget. Needs enable_chunked_prefill. (default: 4096)" \
        in help_text
