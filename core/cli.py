"""The ``pagebatch`` command: generate | serve | bench | quantize | plugins, and frontends' own.

``serve`` comes from a frontend plugin (``register_frontends``) and ``quantize`` from the quant
package (``register_commands``): this file imports no built-in plugin.

Engine keys are options of every engine subcommand (``--max-num-seqs 64``) and keys of the
``--config FILE`` YAML; the command line wins over the file, the file over defaults.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from typing import Any, Mapping, Sequence

from .bench.command import add_bench_parser, run_bench
from .config import ConfigOption, EngineConfig, add_cli_options, cli_values
from .errors import PagebatchError
from .registry import registry


def _engine_options() -> list[ConfigOption]:
    return EngineConfig.core_options() + list(registry().config_options().values())


def _config_from_args(args: argparse.Namespace,
                      defaults: Mapping[str, Any] | None = None) -> EngineConfig:
    """``defaults``: a frontend's own defaults of engine keys (`Frontend.engine_defaults`),
    below the file and the command line."""
    options = _engine_options()
    cli = cli_values(args, options)
    if getattr(args, "model_pos", None):
        cli.setdefault("model", args.model_pos)
    return EngineConfig.from_sources(cli=cli, file=args.config, defaults=defaults)


def _add_engine_args(p: argparse.ArgumentParser,
                     defaults: Mapping[str, Any] | None = None) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="model name or path (same as --model)")
    p.add_argument("--config", metavar="FILE", help="YAML file of engine keys")
    add_cli_options(p, _engine_options(), defaults)


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
    rids = []  # every prompt is queued before the first step: they batch together
    for text in args.prompt:
        prompt = (engine.chat_prompt([{"role": "user", "content": text}]) if args.chat
                  else text)
        rids.append(engine.add_request(prompt, params))
    final: dict[str, str] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].text
    for rid in rids:  # in the order given
        print(final.get(rid, ""), flush=True)
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


_ARGV: list[str] = []  # the command line being parsed, for `_Parser.error`'s hints


class _Parser(argparse.ArgumentParser):
    """No abbreviated long options (``--max-num-seq`` must not mean ``--max-num-seqs``: a typo
    gets an error instead); an error names each unknown ``--flag`` of the command line with the
    closest option of its subcommand (did you mean ...?), as a mistyped config key gets.
    Subcommand parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # (subparsers get parse_known_args)
        _ARGV[:] = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str):
        hints = unknown_flag_hints(_parsers_on_path(self, _ARGV), _ARGV)
        if hints and message.startswith("unrecognized arguments"):
            message = ""  # the hints name them
        super().error("; ".join(hints + [message] if message else hints) or message)


def _parsers_on_path(parser: argparse.ArgumentParser,
                     argv: list[str]) -> list[argparse.ArgumentParser]:
    """``parser`` and the subcommand parsers that ``argv`` selects under it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for tok in argv:
                if tok in action.choices:
                    return [parser, *_parsers_on_path(action.choices[tok], argv)]
    return [parser]


def unknown_flag_hints(parsers: list[argparse.ArgumentParser], argv: list[str]) -> list[str]:
    """"unknown option '--promt'; did you mean '--prompt'?" for each ``--flag`` of ``argv``
    that none of ``parsers`` knows (a value after ``=`` ignored)."""
    known = {s for p in parsers for s in p._option_string_actions}
    longs = sorted(s for s in known if s.startswith("--"))
    hints = []
    for tok in argv:
        flag = tok.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag, longs, n=1, cutoff=0.6)
            hints.append(f"unknown option {flag!r}"
                         + (f"; did you mean {close[0]!r}?" if close else ""))
    return hints


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
        defaults = getattr(fe, "engine_defaults", None) or {}
        _add_engine_args(fp, defaults)
        fe.add_cli_arguments(fp)
        fp.set_defaults(func=lambda a, fe=fe, d=defaults: fe.run(_config_from_args(a, d), a))
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
