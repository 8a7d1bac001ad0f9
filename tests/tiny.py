"""Small helpers shared by the tests that run the tiny random model (tests/conftest.py)."""

from __future__ import annotations

import random
from typing import Any

from pagebatch.config import EngineConfig


def random_prompts(n: int, seed: int = 1, max_len: int = 40) -> list[list[int]]:
    """``n`` prompts of 1..max_len random token ids in [3, 255] (the tiny vocabulary less the
    special ids), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [[rng.randint(3, 255) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def engine_config(model_dir: Any, keys: dict[str, Any], **overrides: Any) -> EngineConfig:
    """An EngineConfig for ``model_dir`` with engine ``keys``, ``overrides`` winning."""
    return EngineConfig.from_sources(cli={"model": str(model_dir), **keys, **overrides})
