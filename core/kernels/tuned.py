"""Kernel configurations measured on a given GPU (block sizes, split-K, warps, stages), as vLLM
keeps its fused-MoE configs: one JSON file per kernel and device, written by a sweep
(``scripts/bench_quant.py --tune``), looked up per problem shape and row count at run time, with
the kernel's own heuristics as the fallback for shapes or devices that have no entry.

File: ``<dir>/<kernel>_<device name, spaces as _>.json`` = ``{shape key: {"M": config}}`` where
``M`` is the largest row count the config was measured at (a lookup for ``m`` rows takes the
entry with the smallest ``M >= m``). Directories searched: ``$PAGEBATCH_KERNEL_CONFIG_DIR`` first
(a fresh sweep), then the packaged folder of the kernel's owner: core/kernels/configs/ for the
shared kernels (``dense_gemv``), quant/kernels/configs/ for the quant methods' (``wna16``), passed
as ``directory``. The lookup is shared; each table lives with its kernel.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
ENV_DIR = "PAGEBATCH_KERNEL_CONFIG_DIR"
logger = logging.getLogger(__name__)


def device_name(device: torch.device) -> str:
    """The GPU's name as the tables are named (spaces as _), looked up once per device."""
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def config_path(kernel: str, name: str, directory: str | Path) -> Path:
    return Path(directory) / f"{kernel}_{name}.json"


@functools.cache
def load_table(kernel: str, name: str,
               directory: Path = CONFIG_DIR) -> dict[str, dict[int, dict[str, Any]]]:
    """The table of ``kernel`` on device ``name`` ({} when there is none), from
    ``$PAGEBATCH_KERNEL_CONFIG_DIR``, else from the packaged ``directory``."""
    dirs = [d for d in (os.environ.get(ENV_DIR), directory) if d]
    for d in dirs:
        path = config_path(kernel, name, d)
        if path.is_file():
            raw = json.loads(path.read_text())
            logger.info("kernel configs for %s on %s from %s", kernel, name, path)
            return {key: {int(m): cfg for m, cfg in by_m.items()} for key, by_m in raw.items()}
    return {}


def lookup(kernel: str, device: torch.device, key: str, m: int,
           directory: Path = CONFIG_DIR) -> dict[str, Any] | None:
    """The measured config of ``kernel`` for shape ``key`` at ``m`` rows, or None (no table,
    no entry, or not CUDA). ``directory``: the packaged tables of the kernel's owner."""
    if device.type != "cuda":
        return None
    return select(load_table(kernel, device_name(device), directory).get(key) or {}, m)


def select(by_m: dict[int, dict[str, Any]], m: int) -> dict[str, Any] | None:
    """The entry measured at the smallest row count ``>= m`` (a copy), or None."""
    fits = [mm for mm in by_m if mm >= m]
    return dict(by_m[min(fits)]) if fits else None
