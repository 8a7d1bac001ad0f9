"""Kernel configurations measured on a given GPU (block sizes, split-K, warps, stages), as vLLM
keeps its fused-MoE configs: one JSON file per kernel and device, looked up per problem shape and
row count at run time, with the kernel's own rule (and the start-up autotuner,
core/kernels/autotune.py) for shapes that no table has.

File: ``<dir>/<kernel>_<device name, spaces as _>.json`` = ``{shape key: {"M": config}}`` where
``M`` is the largest row count the config was measured at (a lookup for ``m`` rows takes the
entry with the smallest ``M >= m``). Three tables per kernel and device, merged per shape key
and ``M`` (the first named wins where two have the same entry):

1. ``$PAGEBATCH_KERNEL_CONFIG_DIR`` (a fresh sweep, scripts/bench_quant.py --tune);
2. the user cache, ``$PAGEBATCH_CACHE/kernel_configs/v1/`` (default ``~/.cache/pagebatch``):
   what the autotuner measured on this machine (`remember` writes it, atomically, merged with
   what is there; a file that does not parse is ignored with a warning and then rewritten);
3. the packaged folder of the kernel's owner: core/kernels/configs/ for the shared kernels
   (``dense_gemv``), quant/kernels/configs/ for the quant methods' (``wna16``), passed as
   ``directory``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
ENV_DIR = "PAGEBATCH_KERNEL_CONFIG_DIR"
CACHE_ENV = "PAGEBATCH_CACHE"  # the folder core/gguf_loader.py converts GGUF files into, too
CACHE_VERSION = "v1"  # bumped when a kernel's parameters change meaning (old entries dropped)
logger = logging.getLogger(__name__)

Table = dict[str, dict[int, dict[str, Any]]]  # shape key -> {M: config}
_user: dict[tuple[str, str], Table] = {}  # the user cache's tables, read once per process


def device_name(device: torch.device) -> str:
    """The GPU's name as the tables are named (spaces as _), looked up once per device."""
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def config_path(kernel: str, name: str, directory: str | Path) -> Path:
    return Path(directory) / f"{kernel}_{name}.json"


def cache_dir() -> Path:
    """The user cache of autotuned configs: ``$PAGEBATCH_CACHE/kernel_configs/v1``."""
    root = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "pagebatch"))
    return root / "kernel_configs" / CACHE_VERSION


def read_table(path: Path) -> Table:
    """The table in ``path`` ({} when there is no file). A file that is not a table (bad JSON,
    wrong structure) is ignored with a warning: {}."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        table = {str(key): {int(m): dict(cfg) for m, cfg in by_m.items()}
                 for key, by_m in raw.items()}
    except (ValueError, TypeError, AttributeError, OSError) as e:
        logger.warning("kernel config file %s ignored: %s: %s", path, type(e).__name__, e)
        return {}
    logger.info("kernel configs from %s", path)
    return table


def merged(*tables: Table) -> Table:
    """One table of ``tables``, the first's entry winning per (shape key, M)."""
    out: Table = {}
    for table in reversed(tables):
        for key, by_m in table.items():
            out.setdefault(key, {}).update(by_m)
    return out


@functools.cache
def _file_table(path: Path) -> Table:
    return read_table(path)


def load_table(kernel: str, name: str, directory: Path = CONFIG_DIR) -> Table:
    """The measured table of ``kernel`` on device ``name`` ({} when there is none):
    ``$PAGEBATCH_KERNEL_CONFIG_DIR``'s over the packaged ``directory``'s (each file read
    once)."""
    return merged(_env_table(kernel, name), _file_table(config_path(kernel, name, directory)))


def _env_table(kernel: str, name: str) -> Table:
    env = os.environ.get(ENV_DIR)
    return _file_table(config_path(kernel, name, env)) if env else {}


def user_table(kernel: str, name: str) -> Table:
    """The user cache's table of ``kernel`` on ``name`` (read once per process; `remember`
    keeps it current)."""
    if (kernel, name) not in _user:
        _user[kernel, name] = read_table(config_path(kernel, name, cache_dir()))
    return _user[kernel, name]


def remember(kernel: str, name: str, key: str, m: int, cfg: dict[str, Any]) -> None:
    """Add ``cfg`` as the user cache's entry of ``key`` at ``m`` rows: the file is re-read,
    merged and replaced atomically (a temporary file renamed over it), so that processes
    tuning at once lose at most each other's newest entries. An unwritable folder is a
    warning (the entry is then kept for this process only)."""
    table = user_table(kernel, name)
    table.setdefault(key, {})[m] = dict(cfg)
    path = config_path(kernel, name, cache_dir())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        on_disk = merged({key: {m: dict(cfg)}}, read_table(path))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({k: {str(mm): c for mm, c in sorted(by_m.items())}
                       for k, by_m in sorted(on_disk.items())}, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("autotuned config not saved to %s: %s", path, e)


def clear_caches() -> None:
    """Forget the tables read so far (tests; a new $PAGEBATCH_KERNEL_CONFIG_DIR)."""
    _file_table.cache_clear()
    _user.clear()


def lookup(kernel: str, device: torch.device, key: str, m: int,
           directory: Path = CONFIG_DIR) -> dict[str, Any] | None:
    """The measured config of ``kernel`` for shape ``key`` at ``m`` rows from the three tables
    (module docstring: sweep, user cache, packaged), or None (no entry, or not CUDA).
    ``directory``: the packaged tables of the kernel's owner."""
    if device.type != "cuda":
        return None
    found = lookup_measured(kernel, device, key, m, directory)
    return None if found is None else found[1]


def lookup_measured(kernel: str, device: torch.device, key: str, m: int,
                    directory: Path = CONFIG_DIR) -> tuple[int, dict[str, Any]] | None:
    """`lookup`'s entry with the row count ``M`` it was measured at: ``(M, config)``."""
    if device.type != "cuda":
        return None
    name = device_name(device)
    by_m = merged(*({key: t.get(key, {})} for t in (
        _env_table(kernel, name), user_table(kernel, name),
        _file_table(config_path(kernel, name, directory)))))
    return select_measured(by_m.get(key) or {}, m)


def select(by_m: dict[int, dict[str, Any]], m: int) -> dict[str, Any] | None:
    """The entry measured at the smallest row count ``>= m`` (a copy), or None."""
    found = select_measured(by_m, m)
    return None if found is None else found[1]


def select_measured(by_m: dict[int, dict[str, Any]],
                    m: int) -> tuple[int, dict[str, Any]] | None:
    """``(M, a copy of the entry)`` for the smallest measured row count ``M >= m``, or None."""
    fits = [mm for mm in by_m if mm >= m]
    if not fits:
        return None
    mm = min(fits)
    return mm, dict(by_m[mm])
