"""`chat_template` (the engine key, vLLM's --chat-template) and `LLM.chat(tools=...,
chat_template=...)`: a template file or text replaces the tokenizer's and renders the tools;
a value that is neither a file nor a template is refused naming it."""

from __future__ import annotations

import shutil

import pytest

from pagebatch import LLM, SamplingParams
from pagebatch.errors import ConfigError

from tool_helpers import HERMES_TEMPLATE

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory, smollm2_dir):
    """A tiny random model with SmolLM2's tokenizer and a chat template that ignores tools."""
    from conftest import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-plain"), vocab_size=49152,
                              max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>")
    return folder


def _prompt(llm, **kw):
    tok = llm.get_tokenizer()
    return tok.decode(llm.engine.chat_prompt(CHAT, **kw)["prompt_token_ids"])


def test_the_key_replaces_the_template_file_or_text(plain_model, tmp_path):
    keys = dict(device="cpu", dtype="float32", num_kv_blocks=32, block_size=16,
                max_model_len=512)
    own = LLM(str(plain_model), **keys)
    assert "get_weather" not in _prompt(own, tools=[TOOL])  # its own template ignores tools
    path = tmp_path / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    for value in (str(path), HERMES_TEMPLATE):
        llm = LLM(str(plain_model), chat_template=value, **keys)
        text = _prompt(llm, tools=[TOOL])
        assert "<tools>" in text and "get_weather" in text, text
        out = llm.chat(CHAT, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False,
                       tools=[TOOL])
        assert len(out[0].outputs[0].token_ids) == 3
        assert out[0].prompt_token_ids == llm.engine.chat_prompt(
            CHAT, tools=[TOOL])["prompt_token_ids"]


def test_llm_chat_takes_tools_and_a_template_per_call(plain_model):
    llm = LLM(str(plain_model), device="cpu", dtype="float32", num_kv_blocks=32, block_size=16,
              max_model_len=512)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    with_tools = llm.chat(CHAT, sp, use_tqdm=False, tools=[TOOL], chat_template=HERMES_TEMPLATE)
    plain = llm.chat(CHAT, sp, use_tqdm=False)
    text = llm.get_tokenizer().decode(with_tools[0].prompt_token_ids)
    assert "get_weather" in text
    assert len(with_tools[0].prompt_token_ids) > len(plain[0].prompt_token_ids)


def test_a_value_that_is_no_file_or_template_is_refused(plain_model):
    with pytest.raises(ConfigError, match="chat_template='no-such.jinja'"):
        LLM(str(plain_model), device="cpu", chat_template="no-such.jinja", num_kv_blocks=32)
