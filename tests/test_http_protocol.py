"""Request parsing of the `http` frontend without a socket: the model's generation_config.json
defaults (``generation_config: auto``, as vLLM's ``--generation-config auto``) for fields a
request leaves unset, through the parser, an in-process app and `pagebatch generate`; and the
server's options from the command line and the YAML file."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from pagebatch import AsyncEngine, EngineConfig
from pagebatch.cli import _config_from_args, build_parser
from pagebatch.errors import ConfigError
from pagebatch.engine import LLMEngine
from pagebatch.plugins.frontends.http import protocol as proto
from pagebatch.plugins.frontends.http.server import Settings, build_app

GEN_CONFIG = {"do_sample": True, "temperature": 0.25, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 5}
DEFAULTS = {"temperature": 0.25, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_tokens": 5}  # LLMEngine.sampling_defaults
MODEL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _fields(params) -> dict:
    return {k: getattr(params, k) for k in MODEL_FIELDS}


# ---- the parser --------------------------------------------------------------------------------

def test_unset_fields_take_the_models_defaults():
    _, p, _ = proto.completion_request({"prompt": "x"}, 8, 4, DEFAULTS)
    assert _fields(p) == {k: DEFAULTS[k] for k in MODEL_FIELDS}
    # null is unset too; the penalties OpenAI defines are not the model's
    _, p, _ = proto.completion_request({"prompt": "x", "temperature": None}, 8, 4,
                                       {**DEFAULTS, "presence_penalty": 1.0})
    assert p.temperature == 0.25 and p.presence_penalty == 0.0


def test_fields_the_request_sets_win():
    body = {"prompt": "x", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "repetition_penalty": 1.0}  # SamplingParams' own defaults, set explicitly
    _, p, _ = proto.completion_request(body, 8, 4, DEFAULTS)
    assert _fields(p) == {k: body[k] for k in MODEL_FIELDS}


@pytest.mark.parametrize("asked, got", [(None, 5), (16, 5), (3, 3), (5, 5)])
def test_max_new_tokens_caps_max_tokens(asked, got):
    """As vLLM: the model's max_new_tokens is the most tokens a request gets, asked or not."""
    _, p, _ = proto.completion_request({"prompt": "x", "max_tokens": asked}, 8, 4, DEFAULTS)
    assert p.max_tokens == got
    _, p, _ = proto.chat_request({"messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": asked}, 4, DEFAULTS)
    assert p.max_tokens == got


def test_no_defaults_keeps_openai_and_vllm_defaults():
    _, p, _ = proto.completion_request({"prompt": "x"}, 8, 4, {})
    assert _fields(p) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                          "repetition_penalty": 1.0}
    assert p.max_tokens == 16  # OpenAI's completions default
    _, p, _ = proto.chat_request({"messages": [{"role": "user", "content": "x"}]}, 4)
    assert p.max_tokens is None  # up to the context limit
    _, p, opts = proto.completion_request({"prompt": "x", "max_tokens": 0, "echo": True}, 8, 4,
                                          DEFAULTS)
    assert opts["score_only"] and p.max_tokens == 1


# ---- through the engine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def genconfig_model(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-genconfig") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return folder


KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128)


def _serve_and_capture(folder, mode: str, bodies: list[tuple[str, dict]]) -> list:
    """Run ``bodies`` through an in-process app (engine core on a thread) over ``folder``
    with ``generation_config: mode``; returns (response JSON, SamplingParams the engine got)
    per body."""
    config = EngineConfig.from_sources(cli={"model": str(folder), "generation_config": mode,
                                            **KEYS})
    engine = AsyncEngine.from_config(config, multiprocess=False)
    seen = []
    prepare = engine.engine.prepare

    def spy(prompt, params, *args, **kwargs):
        seen.append(params)
        return prepare(prompt, params, *args, **kwargs)

    engine.engine.prepare = spy

    async def main() -> list:
        transport = httpx.ASGITransport(app=build_app(engine, config))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return [(await c.post(path, json=body)).json() for path, body in bodies]

    try:
        answers = asyncio.run(main())
    finally:
        engine.shutdown()
    return list(zip(answers, seen))


def test_http_requests_get_generation_config_defaults(genconfig_model):
    chat = {"messages": [{"role": "user", "content": "w5"}], "ignore_eos": True}
    got = _serve_and_capture(genconfig_model, "auto", [
        ("/v1/completions", {"prompt": "w5 w6", "max_tokens": 50, "ignore_eos": True}),
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "w5 w6", "temperature": 0, "top_k": 0,
                             "ignore_eos": True}),
    ])
    (r1, p1), (r2, p2), (r3, p3) = got
    assert _fields(p1) == _fields(p2) == {k: DEFAULTS[k] for k in MODEL_FIELDS}
    assert r1["usage"]["completion_tokens"] == 5 == r2["usage"]["completion_tokens"]  # capped
    assert (p3.temperature, p3.top_k, p3.top_p) == (0, 0, 0.9)  # what it sets wins
    for mode in ("vllm", "none"):
        (r, p), = _serve_and_capture(genconfig_model, mode, [("/v1/chat/completions", chat)])
        assert _fields(p) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                              "repetition_penalty": 1.0}
        assert p.max_tokens is None


def test_generate_command_uses_generation_config(genconfig_model, monkeypatch, capsys):
    from pagebatch.cli import main

    seen = []
    prepare = LLMEngine.prepare

    def spy(self, prompt, params, *args, **kwargs):
        seen.append(params)
        return prepare(self, prompt, params, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "prepare", spy)
    common = ["generate", str(genconfig_model), "--device", "cpu", "--num-kv-blocks", "64",
              "--block-size", "4", "--prompt", "w5 w6", "--max-tokens", "3"]
    assert main(common + ["--top-k", "3"]) == 0
    assert main(common + ["--generation-config", "none"]) == 0
    capsys.readouterr()
    assert _fields(seen[0]) == {**{k: DEFAULTS[k] for k in MODEL_FIELDS}, "top_k": 3}
    assert seen[0].max_tokens == 3
    assert _fields(seen[1])["temperature"] == 1.0 and seen[1].top_k == 0


def test_generation_config_values():
    for v in ("auto", "vllm", "none"):
        assert EngineConfig.from_dict({"generation_config": v}).generation_config == v
    with pytest.raises(ConfigError, match="generation_config"):
        EngineConfig.from_dict({"generation_config": "model"})


# ---- the command line --------------------------------------------------------------------------

def test_serve_options_from_cli_and_file(tmp_path, tiny_model_dir):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\nport: 9001\nhost: 127.0.0.1\napi-key: k\n"
                   f"shutdown-timeout: 2.5\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--port", "9002"])
    s = Settings.from_config(_config_from_args(args))
    assert (s.port, s.host, s.api_key) == (9002, "127.0.0.1", "k")  # CLI > file > defaults
    assert s.shutdown_timeout == 2.5 and s.allowed_origins == []


def test_port_and_bench_counts_are_range_checked(tiny_model_dir, capsys):
    """A port above 65535 is a config error naming the limit (it was a bind() traceback);
    `bench --num-prompts 0` is refused by argparse (it was a traceback after loading)."""
    args = build_parser().parse_args(["serve", str(tiny_model_dir), "--port", "99999"])
    with pytest.raises(ConfigError, match="port.*99999.*<= 65535"):
        _config_from_args(args)
    for flag in ("--num-prompts", "--output-len", "--num-iters"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "throughput", str(tiny_model_dir), flag, "0"])
        assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err
