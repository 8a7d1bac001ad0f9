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


class CountingStr(str):
    """A text that counts the characters its readers look at (a test double for the amount of
    work, not its time): an index counts 1, a slice its length, ``find`` the span it searched,
    ``startswith`` the prefix, iteration, ``in``, ``==`` and strips the whole text. All
    prefixes of one stream share ``counter``, a one-item list. A use that bypasses these (a
    regex on the text) would go uncounted: the scanners of core/json_scan.py use none."""

    counter: list[int] = [0]

    def __getitem__(self, k):
        r = str.__getitem__(self, k)
        self.counter[0] += max(len(r), 1)
        return r

    def find(self, sub, start=None, end=None):
        r = str.find(self, sub, start, end)
        s = 0 if start is None else start
        e = len(self) if end is None else min(end, len(self))
        self.counter[0] += max(r + len(sub) if r >= 0 else e, s) - s + 1
        return r

    def startswith(self, prefix, start=0, end=None):
        self.counter[0] += len(prefix) if isinstance(prefix, str) else max(map(len, prefix))
        return str.startswith(self, prefix, start, end)

    def _whole(self):
        self.counter[0] += len(self)

    def __iter__(self):
        self._whole()
        return str.__iter__(self)

    def __contains__(self, x):
        self._whole()
        return str.__contains__(self, x)

    def __eq__(self, other):
        self._whole()
        return str.__eq__(self, other)

    __hash__ = str.__hash__

    def rstrip(self, *chars):
        self._whole()
        return str.rstrip(self, *chars)

    def strip(self, *chars):
        self._whole()
        return str.strip(self, *chars)


def characters_read(reader, text: str, step: int = 4) -> tuple[int, int]:
    """A tool-call reader fed ``text`` ``step`` characters at a time (about a token), the last
    read final: (characters it looked at over the whole stream, reads)."""
    CountingStr.counter = [0]
    cuts = list(range(step, len(text), step)) + [len(text)]
    for k in cuts:
        reader.read(CountingStr(text[:k]), k == len(text))
    return CountingStr.counter[0], len(cuts)
