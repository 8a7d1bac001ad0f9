"""`EngineConfig`: every engine key, its default, and how the sources merge.

Sources, highest first: command line > YAML file (``--config FILE``) > defaults. Keys are
snake_case; the file accepts dashes too and the CLI spells them with dashes. Plugins declare their
own keys through the ``register_config_options`` hook; once plugins are loaded, a key nobody
declared is an error with a did-you-mean. Defaults follow vLLM's where vLLM has one.

docs/configuration.md documents every key (a test keeps the two in step).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from .errors import ConfigError

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigOption:
    """One config key. Plugins declare theirs with this through ``register_config_options``.

    ``parse`` turns a CLI string or YAML value into the typed value and raises ``ValueError``
    with a message when the value is not allowed.
    """

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any] = str
    choices: Sequence[Any] | None = None
    is_flag: bool = False


# ---- value parsers (each raises ValueError with a short reason) --------------------------------

def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_int(minimum: int | None = None, maximum: int | None = None) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError("expected an integer")
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ValueError("expected an integer") from None
        if minimum is not None and n < minimum:
            raise ValueError(f"must be >= {minimum}")
        if maximum is not None and n > maximum:
            raise ValueError(f"must be <= {maximum}")
        return n

    return parse


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def wrapped(v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null")):
            return None
        return parse(v)

    return wrapped


def _number(v: Any) -> float:
    """``v`` as a float; ValueError("expected a number") for a list, a word, a bool."""
    if isinstance(v, bool):
        raise ValueError("expected a number")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError("expected a number") from None


def _fraction(v: Any) -> float:
    x = _number(v)
    if not 0.0 < x <= 1.0:
        raise ValueError("must be in (0, 1]")
    return x


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12,
               "tb": 10**12}


def parse_size(v: Any) -> int:
    """Bytes from ``4GiB``, ``512MiB``, ``2.5GB`` or a plain integer. Raises ValueError."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = v
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(v))
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError("expected a size such as 4GiB, 512MiB or a number of bytes")
        x = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if isinstance(x, float) and not math.isfinite(x):  # YAML .inf: ValueError, not OverflowError
        raise ValueError("expected a finite size")
    n = int(x)
    if n <= 0:
        raise ValueError("must be a positive size")
    return n


def _choice(choices: Sequence[str]) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        s = str(v)
        if s not in choices:
            raise ValueError(f"allowed: {list(choices)}")
        return s

    return parse


def _opt(name: str, default: Any, help: str, parse: Callable = str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, "parse": parse, **kw})


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 = e4m3 with per-layer scales
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DIST_BACKENDS = ("auto", "nccl", "gloo")


def _positive_float(v: Any) -> float:
    x = _number(v)
    if not math.isfinite(x) or x <= 0:
        raise ValueError("must be a positive number")
    return x
GENERATION_CONFIGS = ("auto", "vllm", "none")


@dataclass
class EngineConfig:
    """All engine settings. See docs/configuration.md for each key's meaning."""

    # model
    model: str = _opt("model", "smollm2-135m",
                      "Model name (smollm2-135m), Hugging Face folder, or .gguf file.")
    tokenizer: str | None = _opt("tokenizer", None,
                                 "Tokenizer folder; default: the model's.", _optional(str))
    chat_template: str | None = _opt(
        "chat_template", None, "Jinja chat template replacing the tokenizer's: a file path, or "
        "the template text (vLLM's --chat-template).", _optional(str))
    device: str = _opt("device", "auto", "cpu, cuda, or auto (cuda when available).",
                       _choice(DEVICES), choices=DEVICES)
    dtype: str = _opt("dtype", "auto",
                      "Weights and activations dtype; auto = bfloat16 on cuda, float32 on cpu.",
                      _choice(DTYPES), choices=DTYPES)
    max_model_len: int | None = _opt("max_model_len", None,
                                     "Longest sequence (prompt + output) in tokens; default: "
                                     "the model's max_position_embeddings.",
                                     _optional(parse_int(1)))
    load_format: str = _opt("load_format", "auto", "auto, safetensors, gguf or dummy (random).",
                            _choice(LOAD_FORMATS), choices=LOAD_FORMATS)
    seed: int = _opt("seed", 0, "Seed of the engine's random stream (dummy weights, sampling).",
                     parse_int())
    generation_config: str = _opt("generation_config", "auto",
                                  "auto: a model's generation_config.json sets sampling "
                                  "defaults; vllm or none: ignore it.",
                                  _choice(GENERATION_CONFIGS), choices=GENERATION_CONFIGS)
    # cache
    block_size: int = _opt("block_size", 16, "Tokens per KV cache block.", parse_int(1))
    gpu_memory_utilization: float = _opt("gpu_memory_utilization", 0.9,
                                         "Fraction of GPU memory for weights, activations and "
                                         "KV cache (cuda).", _fraction)
    kv_cache_memory: int | None = _opt("kv_cache_memory", None,
                                       "KV cache size in bytes (4GiB, 512MiB); default 4GiB on "
                                       "cpu. Overrides gpu_memory_utilization.",
                                       _optional(parse_size))
    num_kv_blocks: int | None = _opt("num_kv_blocks", None,
                                     "Force the number of KV cache blocks (overrides sizes).",
                                     _optional(parse_int(1)))
    enable_prefix_caching: bool = _opt("enable_prefix_caching", True,
                                       "Reuse the KV of cached prompt prefixes (hashed blocks).",
                                       parse_bool)
    disable_hybrid_kv_cache_manager: bool = _opt(
        "disable_hybrid_kv_cache_manager", False,
        "A model mixing full and sliding-window layers keeps one whole block table for all "
        "layers (no blocks returned behind the windows) instead of a table per layer group.",
        parse_bool)
    kv_cache_dtype: str = _opt("kv_cache_dtype", "auto",
                               "KV cache dtype: auto = model dtype; fp8 (fp8_e4m3) = e4m3 with "
                               "per-layer scales, twice the tokens of bf16.",
                               _choice(KV_CACHE_DTYPES), choices=KV_CACHE_DTYPES)
    # scheduler
    scheduling_policy: str = _opt("scheduling_policy", "fcfs",
                                  "Scheduling policy plugin name (fcfs, ...).")
    max_num_seqs: int = _opt("max_num_seqs", 256, "Most requests in one step's batch.",
                             parse_int(1))
    max_num_batched_tokens: int | None = _opt(
        "max_num_batched_tokens", None,
        "Token budget of one step; default 8192 with chunked prefill, else "
        "max(max_model_len, 2048).", _optional(parse_int(1)))
    enable_chunked_prefill: bool = _opt("enable_chunked_prefill", True,
                                        "Split prompts longer than the step's token budget over "
                                        "several steps, mixed with decodes.", parse_bool)
    long_prefill_token_threshold: int = _opt(
        "long_prefill_token_threshold", 0,
        "Most prompt tokens one request computes in a step (vLLM's option of that name): "
        "shorter mixed steps, so lower ITL beside new prompts, for later first tokens; 0: no "
        "cap but the step's token budget. Needs enable_chunked_prefill.", parse_int(0))
    max_mixed_prefill_tokens: int = _opt(
        "max_mixed_prefill_tokens", 0,
        "Most prompt tokens, all requests together, in a step that also carries decodes: "
        "bounds how long new prompts stall the running streams (ITL), while a step of prompts "
        "alone keeps the whole budget; 0: no cap but the step's token budget. Needs "
        "enable_chunked_prefill.", parse_int(0))
    # model execution
    quantization: str | None = _opt("quantization", None,
                                    "Quant method plugin; default: the checkpoint's, else fp16.",
                                    _optional(str))
    quantize_lm_head: bool | None = _opt(
        "quantize_lm_head", None,
        "Quantize the LM head with the quant method too (as gpt-fast's int4 does); default: "
        "the checkpoint's (GPTQModel lm_head: true), else off.", _optional(parse_bool))
    async_scheduling: bool | None = _opt(
        "async_scheduling", None,
        "Schedule step N+1 while step N runs on the GPU; default: on with CUDA.",
        _optional(parse_bool))
    enforce_eager: bool = _opt("enforce_eager", False,
                               "Run every step eagerly: no CUDA graphs for decode steps.",
                               parse_bool)
    piecewise_cuda_graph_max_tokens: int = _opt(
        "piecewise_cuda_graph_max_tokens", 512,
        "Steps with prefill tokens of up to this many tokens replay piecewise CUDA graphs "
        "(everything but attention; core/piecewise_graphs.py; CUDA, one process, not with "
        "enforce_eager); 0: such steps run eagerly.",
        parse_int(0))
    attention_backend: str | None = _opt(
        "attention_backend", None,
        "Attention backend plugin; default triton on CUDA, torch_ref on CPU.", _optional(str))
    structured_outputs_backend: str = _opt(
        "structured_outputs_backend", "xgrammar",
        "Structured output backend plugin (JSON schema, regex, choice constraints).")
    structured_outputs_compile_timeout: float = _opt(
        "structured_outputs_compile_timeout", 60.0,
        "Seconds a constraint may take to compile (off the step loop) before its requests "
        "end with an error.", _positive_float)
    # parallelism (docs/parallel.md)
    tensor_parallel_size: int = _opt("tensor_parallel_size", 1,
                                     "Ranks that split each layer (tensor parallel).",
                                     parse_int(1))
    pipeline_parallel_size: int = _opt("pipeline_parallel_size", 1,
                                       "Pipeline stages the layers are split into.",
                                       parse_int(1))
    pipeline_micro_batches: int | None = _opt(
        "pipeline_micro_batches", None,
        "Steps in flight with pipeline stages, each holding its share of the requests "
        "(default: pipeline_parallel_size); more hide the round trip of each step's sampled "
        "tokens back to the first stage, with smaller micro-batches.", _optional(parse_int(1)))
    custom_all_reduce: bool = _opt(
        "custom_all_reduce", True,
        "Tensor parallel: each row-parallel layer's (and the embedding's) all-reduce fused with "
        "the residual add and RMSNorm after it; on CUDA a one-shot Triton kernel over symmetric "
        "memory for batches up to 512 KiB per rank (NCCL above). false: an all-reduce (NCCL, "
        "gloo) after each row-parallel layer.", parse_bool)
    distributed_backend: str = _opt("distributed_backend", "auto",
                                    "torch.distributed backend: auto = nccl on cuda, gloo on "
                                    "cpu.", _choice(DIST_BACKENDS), choices=DIST_BACKENDS)
    distributed_timeout: float = _opt("distributed_timeout", 60.0,
                                      "Seconds a collective or a worker may take before the "
                                      "engine fails instead of waiting.", _positive_float)
    # options declared by plugins: name -> value
    plugin_options: dict[str, Any] = field(default_factory=dict, metadata={"internal": True})

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def core_options(cls) -> list[ConfigOption]:
        out = []
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            out.append(ConfigOption(f.name, f.default, f.metadata["help"],
                                    f.metadata.get("parse", str), f.metadata.get("choices")))
        return out

    @classmethod
    def from_sources(
        cls,
        cli: dict[str, Any] | None = None,
        file: str | Path | None = None,
        plugin_options: dict[str, ConfigOption] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> "EngineConfig":
        """Merge defaults < ``defaults`` (a frontend's own, e.g. ``pagebatch serve``'s; see
        `Frontend.engine_defaults`) < YAML file < CLI values; parse and validate every value.
        A key of ``defaults`` that the given keys rule out (``max_mixed_prefill_tokens`` with
        ``enable_chunked_prefill: false``) is left at the engine's default, with a log line.

        Raises ConfigError naming the key, the value and what is allowed; an unknown key gets a
        did-you-mean over the core keys and the keys plugins declared.
        """
        if plugin_options is None:
            from .registry import registry

            plugin_options = registry().config_options()
        given: dict[str, Any] = dict(load_yaml(file)) if file is not None else {}
        for k, v in (cli or {}).items():
            given[normalize_key(k)] = v
        soft = {k: v for k, v in ((normalize_key(k), v) for k, v in (defaults or {}).items())
                if k not in given}
        while True:
            try:
                return cls.from_dict({**soft, **given}, plugin_options)
            except ConfigError as e:  # validate() names a key it rules out as ``key=value``
                culprit = next((k for k in soft if f"{k}=" in str(e)), None)
                if culprit is None:
                    raise
                _log.info("default %s=%r left out: %s", culprit, soft.pop(culprit), e)

    @classmethod
    def from_dict(
        cls, values: dict[str, Any], plugin_options: dict[str, ConfigOption] | None = None
    ) -> "EngineConfig":
        plugin_options = plugin_options or {}
        core = {o.name: o for o in cls.core_options()}
        known = {**core, **plugin_options}
        kwargs: dict[str, Any] = {}
        plugin_vals = {n: o.default for n, o in plugin_options.items()}
        for raw_key, value in values.items():
            key = normalize_key(raw_key)
            opt = known.get(key)
            if opt is None:
                close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown config key {raw_key!r}{hint} "
                                  f"(known keys: see docs/configuration.md or `pagebatch "
                                  f"generate --help`)")
            try:
                parsed = opt.parse(value)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"config key {key!r}: bad value {value!r}: {e}") from None
            if key in core:
                kwargs[key] = parsed
            else:
                plugin_vals[key] = parsed
        cfg = cls(**kwargs, plugin_options=plugin_vals)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-key checks; raises ConfigError."""
        mb, pp = self.pipeline_micro_batches, self.pipeline_parallel_size
        if mb is not None and (pp == 1 or mb < pp):
            raise ConfigError(f"pipeline_micro_batches={mb} needs pipeline_parallel_size > 1 "
                              f"and at least one micro-batch per stage "
                              f"(pipeline_parallel_size={pp})")
        for key in ("long_prefill_token_threshold", "max_mixed_prefill_tokens"):
            if (value := getattr(self, key)) and not self.enable_chunked_prefill:
                raise ConfigError(f"{key}={value} cuts prompts into chunks: it needs "
                                  f"enable_chunked_prefill=true")
        if self.max_num_batched_tokens is not None and self.max_model_len is not None:
            check_token_budget(self.max_num_batched_tokens, self.max_model_len,
                               self.enable_chunked_prefill)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if not f.metadata.get("internal")}
        d.update(self.plugin_options)
        return d


def check_token_budget(max_num_batched_tokens: int, max_model_len: int,
                       enable_chunked_prefill: bool) -> None:
    """Without chunked prefill a prompt is scheduled whole, so the step's token budget must hold
    a prompt of max_model_len tokens. Raises ConfigError."""
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"max_num_batched_tokens={max_num_batched_tokens} is below "
            f"max_model_len={max_model_len}: without chunked prefill a prompt of "
            f"max_model_len tokens could never be scheduled; raise "
            f"max_num_batched_tokens or lower max_model_len")


def normalize_key(key: str) -> str:
    return str(key).strip().replace("-", "_")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (YAML 1.2 says
    keys are unique; PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: PyYAML merges it
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file: a YAML mapping of keys to values. Raises ConfigError."""
    p = Path(path)
    if not p.is_file():
        what = "is not a file" if p.exists() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}")
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of key: value, "
                          f"not {type(data).__name__}")
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = normalize_key(k)
        if key in out:
            first = next(raw for raw in data if normalize_key(raw) == key)
            raise ConfigError(f"config file {str(path)!r} gives key {key!r} twice, as "
                              f"{first!r} and {k!r}")
        out[key] = v
    return out


def add_cli_options(parser: argparse.ArgumentParser, options: Sequence[ConfigOption],
                    defaults: Mapping[str, Any] | None = None) -> None:
    """Add ``--kebab-name`` for each option; unset ones stay absent (so the file can set them).
    ``defaults``: the subcommand's own defaults of some keys, shown in their help instead."""
    defaults = defaults or {}
    group = parser.add_argument_group("engine options (also settable in --config FILE)")
    for opt in options:
        flag = "--" + opt.name.replace("_", "-")
        if opt.is_flag or isinstance(opt.default, bool):
            group.add_argument(flag, dest=opt.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=opt.help)
        else:
            group.add_argument(flag, dest=opt.name, default=argparse.SUPPRESS,
                               metavar=opt.name.upper(),
                               help=f"{opt.help} (default: {defaults.get(opt.name, opt.default)})")


def cli_values(args: argparse.Namespace, options: Sequence[ConfigOption]) -> dict[str, Any]:
    names = {o.name for o in options}
    return {k: v for k, v in vars(args).items() if k in names}
