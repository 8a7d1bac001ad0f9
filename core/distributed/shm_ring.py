"""A one-writer, many-reader ring buffer of byte messages in shared memory (the idea of vLLM's
``ShmRingBuffer``): the driver writes each step's message once, every local worker reads it.

Layout of the segment: ``written[num_slots]`` int64 (1 + the chunk sequence number last written
to each slot), ``read[num_readers]`` int64 (chunks each reader has consumed, one cache line
apart), then ``num_slots`` slots of ``slot_bytes``. A message is cut into chunks of at most
``slot_bytes - 16`` bytes, each chunk ``[message length int64][chunk length int64][bytes]``,
chunk ``s`` in slot ``s % num_slots``. The writer waits until every reader has consumed the
chunk a slot held before reusing it; a reader waits until its next chunk is written. The
payload is written before the ``written`` counter, which x86's store order makes visible in that
order to the other processes.

Waiting spins for `SPIN_S` (``os.sched_yield``: a worker picks up the next step within
microseconds) and then sleeps with a growing pause up to
``MAX_SLEEP_S``, so an idle worker costs next to nothing; every ``CHECK_S`` the caller's
``check()`` runs (it raises when the other side is gone), so a wait never hangs.
"""

from __future__ import annotations

import os
import struct
import time
from multiprocessing import shared_memory
from typing import Callable

import numpy as np

SPIN_S = 5e-3  # poll with sched_yield this long before sleeping (a step's gap on a GPU)
MAX_SLEEP_S = 1e-3
CHECK_S = 0.5
_HEADER = struct.Struct("<qq")
_READER_STRIDE = 8  # int64s per reader counter: one cache line each


class ShmRingBuffer:
    """Create with ``ShmRingBuffer(num_readers)`` in the writer; pass ``.handle()`` to the
    readers, which attach with ``ShmRingBuffer.attach(handle, reader_index)``."""

    def __init__(self, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20,
                 _attach: tuple[str, int] | None = None) -> None:
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        meta = (num_slots + _READER_STRIDE * num_readers) * 8
        self._data_off = -(-meta // 64) * 64
        size = self._data_off + num_slots * slot_bytes
        if _attach is None:
            self.shm = shared_memory.SharedMemory(create=True, size=size)
            self.shm.buf[:self._data_off] = bytes(self._data_off)
            self.reader = None
        else:
            name, self.reader = _attach
            # (a "spawn" child shares its parent's resource tracker, where the name is already
            # registered once; the writer unlinks the segment)
            self.shm = shared_memory.SharedMemory(name=name)
        buf = self.shm.buf
        self._written = np.ndarray((num_slots,), np.int64, buf, 0)
        self._read = np.ndarray((num_readers, _READER_STRIDE), np.int64, buf, num_slots * 8)
        self._seq = 0  # next chunk to write (writer) or read (reader)

    def handle(self) -> tuple[str, int, int, int]:
        return self.shm.name, self.num_readers, self.num_slots, self.slot_bytes

    @classmethod
    def attach(cls, handle: tuple[str, int, int, int], reader: int) -> "ShmRingBuffer":
        name, num_readers, num_slots, slot_bytes = handle
        return cls(num_readers, num_slots, slot_bytes, _attach=(name, reader))

    # ---- writer -------------------------------------------------------------------------------

    def write(self, payload: bytes, check: Callable[[], None]) -> None:
        """Write one message (any length, empty included) for every reader."""
        mv = memoryview(payload)
        total, off, cap = len(mv), 0, self.slot_bytes - _HEADER.size
        while True:
            n = min(total - off, cap)
            s = self._seq
            oldest = s - self.num_slots + 1  # every reader must have consumed chunk s - slots
            _wait(lambda: self._read[:, 0].min() >= oldest, check)
            base = self._data_off + (s % self.num_slots) * self.slot_bytes
            _HEADER.pack_into(self.shm.buf, base, total, n)
            self.shm.buf[base + _HEADER.size:base + _HEADER.size + n] = mv[off:off + n]
            self._written[s % self.num_slots] = s + 1
            self._seq = s + 1
            off += n
            if off >= total:
                return

    # ---- reader -------------------------------------------------------------------------------

    def read(self, check: Callable[[], None]) -> bytearray:
        """The next message (a fresh buffer: no second copy of it is made)."""
        out, got, total = bytearray(), 0, None
        while total is None or got < total:
            s = self._seq
            slot = s % self.num_slots
            _wait(lambda: self._written[slot] == s + 1, check)
            base = self._data_off + slot * self.slot_bytes
            total, n = _HEADER.unpack_from(self.shm.buf, base)
            out += self.shm.buf[base + _HEADER.size:base + _HEADER.size + n]
            got += n
            self._read[self.reader, 0] = s + 1
            self._seq = s + 1
        return out

    def close(self, unlink: bool = False) -> None:
        # drop our views before closing the mapping (numpy arrays export the buffer)
        self._written = self._read = None
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes at exit
            pass
        if unlink:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _wait(ready: Callable[[], bool], check: Callable[[], None]) -> None:
    """Until ``ready()``: spin, then sleep up to MAX_SLEEP_S at a time; ``check()`` every
    CHECK_S (it raises to stop waiting)."""
    if ready():
        return
    start = time.monotonic()
    while time.monotonic() - start < SPIN_S:
        os.sched_yield()
        if ready():
            return
    pause, last = 1e-5, time.monotonic()
    while not ready():
        time.sleep(pause)
        pause = min(pause * 2, MAX_SLEEP_S)
        now = time.monotonic()
        if now - last >= CHECK_S:
            check()
            last = now
