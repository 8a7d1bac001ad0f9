"""The ``pagebatch`` command: generate | serve | bench | plugins, plus frontend plugins' own.

Engine keys are options of every engine subcommand (``--max-num-seqs 64``) and keys of the
``--config FILE`` YAML; the command line wins over the file, the file over defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

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


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine import LLMEngine
    from .request import SamplingParams

    config = _config_from_args(args)
    engine = LLMEngine(config)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            stop=args.stop or None, seed=args.sampling_seed)
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
    from .bench import run_bench

    return run_bench(args, _config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagebatch", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed (--seed seeds the engine)")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_cmd_generate)

    p = sub.add_parser("plugins", help="list plugins, versions and what they register")
    p.set_defaults(func=_cmd_plugins)

    from .bench import add_bench_parser

    add_bench_parser(sub, _add_engine_args, _cmd_bench)

    reg = registry()
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
