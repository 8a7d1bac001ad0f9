"""The ``pagebatch`` command: generate | serve | bench | quantize | plugins, and frontends' own.

``serve`` comes from a frontend plugin (``register_frontends``) and ``quantize`` from the quant
package (``register_commands``): this file imports no built-in plugin.

Engine keys are options of every engine subcommand (``--max-num-seqs 64``) and keys of the
``--config FILE`` YAML; the command line wins over the file, the file over defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from .bench.command import add_bench_parser, run_bench
from .config import ConfigOption, EngineConfig, add_cli_options, cli_values
from .errors import PagebatchError
from .registry import registry


def _engine_options() -> list[ConfigOption]:
    return EngineConfig.core_options() + list(registry().config_options().values())


def _config_from_args(args: argparse.Namespace) -> EngineConfig:
    options = _engine_options()
    cli = cli_values(args, options)
    if getattr(args, "model_pos", None):
        cli.setdefault("model", args.model_pos)
    return EngineConfig.from_sources(cli=cli, file=args.config)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="model name or path (same as --model)")
    p.add_argument("--config", metavar="FILE", help="YAML file of engine keys")
    add_cli_options(p, _engine_options())


_MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine import LLMEngine
    from .request import SamplingParams

    config = _config_from_args(args)
    # sampling options not given come from the model's generation_config.json (as vLLM)
    given = {k: getattr(args, k) for k in _MODEL_DEFAULTED if getattr(args, k) is not None}
    given.update(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                 stop=args.stop or None, seed=args.sampling_seed)
    SamplingParams(**given).validate()  # before the model loads
    engine = LLMEngine(config)
    params = SamplingParams(**{**engine.sampling_defaults, **given})
    for text in args.prompt:
        prompt = (engine.chat_prompt([{"role": "user", "content": text}]) if args.chat
                  else text)
        rid = engine.add_request(prompt, params)
        final = None
        while engine.has_unfinished_requests:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    final = out
        if final is not None:
            print(final.outputs[0].text, flush=True)
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    reg = registry()
    for info in sorted(reg.plugins.values(), key=lambda i: (not i.builtin, i.name)):
        kind = "built-in" if info.builtin else "third-party"
        print(f"{info.name} {info.version} ({kind})")
        if info.error:
            print(f"    BROKEN: {info.error}")
        for k, names in info.provides.items():
            print(f"    {k}: {', '.join(names)}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(args, _config_from_args(args))


class _Parser(argparse.ArgumentParser):
    """No abbreviated long options (``--max-num-seq`` must not mean ``--max-num-seqs``: a typo
    gets argparse's error instead); subcommand parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagebatch", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    for flag, kind, default in (("--temperature", float, 1.0), ("--top-p", float, 1.0),
                                ("--top-k", int, 0), ("--min-p", float, 0.0),
                                ("--repetition-penalty", float, 1.0)):
        g.add_argument(flag, type=kind, default=None, help=f"default: the model's "
                       f"generation_config.json, else {default}")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed (--seed seeds the engine)")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_cmd_generate)

    p = sub.add_parser("plugins", help="list plugins, versions and what they register")
    p.set_defaults(func=_cmd_plugins)
    reg = registry()
    for name in reg.names("command"):  # e.g. quantize (the quant package's)
        cmd = reg.command(name)
        cp = sub.add_parser(name, help=getattr(cmd, "help", None))
        cmd.add_arguments(cp)
        cp.set_defaults(func=cmd.run)

    add_bench_parser(sub, _add_engine_args, _cmd_bench)

    for name in reg.names("frontend"):
        fe = reg.frontend(name)
        fp = sub.add_parser(name, help=getattr(fe, "help", f"run the {name} frontend"))
        _add_engine_args(fp)
        fe.add_cli_arguments(fp)
        fp.set_defaults(func=lambda a, fe=fe: fe.run(_config_from_args(a), a))
    if "serve" not in reg.names("frontend"):
        s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (frontend plugin)")
        s.set_defaults(func=lambda a: _missing_frontend("serve"))
    return parser


def _missing_frontend(name: str) -> int:
    reg = registry()
    print(f"error: no frontend plugin provides {name!r}; registered frontends: "
          f"{reg.names('frontend')}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except (PagebatchError, argparse.ArgumentError) as e:  # e.g. two plugins, one name
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except PagebatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
