"""Helpers of tests/test_tool_calls.py: a Hermes-style chat template that renders tools, tool
calls and tool results (tests/hermes_tools.jinja: Qwen2.5-Instruct's template, its default system
line changed), and a served tiny random model with SmolLM2's vocabulary and that template."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

HERMES_TEMPLATE = (Path(__file__).parent / "hermes_tools.jinja").read_text()


def hermes_model(folder: Path, smollm2_dir: Path) -> Path:
    """A tiny random Llama in ``folder`` with SmolLM2's tokenizer (a real byte-level
    vocabulary) and HERMES_TEMPLATE as its chat template."""
    from conftest import build_tiny_model

    build_tiny_model(folder, vocab_size=49152, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return folder


SERVER_KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=256, block_size=16,
                   max_model_len=2048, max_num_seqs=8, served_model_name="tiny",
                   tool_call_parser="hermes", enable_auto_tool_choice=True)


@contextlib.contextmanager
def hermes_server(folder: Path) -> Iterator[str]:
    """``folder`` (`hermes_model`) served with the hermes tool-call parser and
    tool_choice 'auto' on; yields the base URL."""
    from http_helpers import KEY, tiny_server

    with tiny_server(folder, {**SERVER_KEYS, "api_key": KEY}) as url:
        yield url
