"""Process checks for the engine-core process tests (psutil when installed, else /proc)."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is optional
    psutil = None


def pid_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (exited, reaped or left as a zombie)."""
    if psutil is not None:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_gone(pid):
            return True
        time.sleep(0.05)
    return pid_gone(pid)


def engine_core_children(parent: int | None = None) -> set[int]:
    """Live (non-zombie) "spawn" descendants of ``parent`` (default: this process), engine core
    processes among them; not multiprocessing's resource tracker. Another ``parent`` needs
    psutil."""
    if psutil is None and parent is None:
        import multiprocessing

        return {p.pid for p in multiprocessing.active_children()}
    out = set()
    for p in psutil.Process(parent or os.getpid()).children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@contextlib.contextmanager
def one_thread_children() -> Iterator[None]:
    """Processes started inside run torch on one CPU thread (OMP_NUM_THREADS=1). The tiny model
    gains nothing from two threads, and on a busy 2-core machine their spin-waits make every
    step ~10x slower."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
