"""The driver -> worker step message: a `SchedulerOutput` as a few flat arrays in one byte
string (no pickled object per scheduled row), plus the new-request records of the step, pickled
together once.

Layout (little-endian): a header of int64 ``[kind, B, T, NB, F, P, ids_bytes, new_bytes]``;
per scheduled row ``start_pos`` int64[B], ``num_tokens`` int32[B], ``num_new_blocks`` int32[B],
``sample`` uint8[B] and ``is_new`` uint8[B]; all token ids int32[T]; all ``new_block_ids``
int32[NB] (a new or resumed request's whole table, a running one's blocks gained this step); the
request ids (B scheduled, F finished, P preempted) as one UTF-8 string separated by NUL; the
pickled pair of the rows' `NewRequestData` (a list, in row order, for the rows with ``is_new``)
and the step's structured output bitmask (or None).

The codec keeps no state: a message is the scheduler's output, and each worker's runner keeps
its block tables from the new-request records and the new block ids, as the driver's does.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..scheduler import NewRequestData, ScheduledRequest, SchedulerOutput

STEP, SHUTDOWN, GO = 1, 2, 3  # GO: start-up, every rank has loaded its weights
_HEADER_LEN = 8

# the codec carries exactly these fields; a new field must be added here (a test checks)
ENCODED_FIELDS = {
    ScheduledRequest: {"request_id", "token_ids", "start_pos", "new_block_ids", "sample", "new"},
    SchedulerOutput: {"scheduled", "num_scheduled_tokens", "finished_request_ids",
                      "preempted_request_ids", "structured_output"},  # the last pickled
    NewRequestData: {"prompt_token_ids", "sampling"},  # pickled whole
}


@dataclass
class StepMessage:
    kind: int
    so: SchedulerOutput | None = None


def fields_match() -> bool:
    """Whether the codec covers every field of the scheduler's dataclasses."""
    return all({f.name for f in dataclasses.fields(cls)} == names
               for cls, names in ENCODED_FIELDS.items())


def encode_control(kind: int) -> bytes:
    """A message with no step: SHUTDOWN or GO."""
    return np.array([kind] + [0] * (_HEADER_LEN - 1), np.int64).tobytes()


def encode_step(so: SchedulerOutput) -> bytes:
    """``so`` as one STEP message."""
    sched = so.scheduled
    b = len(sched)
    n_tok = np.fromiter((len(s.token_ids) for s in sched), np.int32, b)
    n_new = np.fromiter((len(s.new_block_ids) for s in sched), np.int32, b)
    tokens = np.fromiter(chain.from_iterable(s.token_ids for s in sched), np.int32,
                         int(n_tok.sum()))
    blocks = np.fromiter(chain.from_iterable(s.new_block_ids for s in sched), np.int32,
                         int(n_new.sum()))
    finished = list(so.finished_request_ids)
    ids = "\0".join([s.request_id for s in sched] + finished
                    + list(so.preempted_request_ids)).encode()
    new = [s.new for s in sched if s.new is not None]
    so_batch = so.structured_output
    new_bytes = pickle.dumps((new, so_batch)) if new or so_batch is not None else b""
    header = np.array([STEP, b, len(tokens), len(blocks), len(finished),
                       len(so.preempted_request_ids), len(ids), len(new_bytes)], np.int64)
    return b"".join([
        header.tobytes(),
        np.fromiter((s.start_pos for s in sched), np.int64, b).tobytes(),
        n_tok.tobytes(), n_new.tobytes(),
        np.fromiter((s.sample for s in sched), np.uint8, b).tobytes(),
        np.fromiter((s.new is not None for s in sched), np.uint8, b).tobytes(),
        tokens.tobytes(), blocks.tobytes(), ids, new_bytes])


def decode(payload: bytes) -> StepMessage:
    """A message of `encode_step` or `encode_control`."""
    header = np.frombuffer(payload, np.int64, _HEADER_LEN)
    kind, b, t, nb, nf, npre, ids_len, new_len = (int(x) for x in header)
    if kind != STEP:
        return StepMessage(kind)
    off = _HEADER_LEN * 8

    def take(dtype, n: int) -> np.ndarray:
        nonlocal off
        a = np.frombuffer(payload, dtype, n, off)
        off += a.nbytes
        return a

    start_pos = take(np.int64, b).tolist()
    n_tok, n_new = take(np.int32, b), take(np.int32, b)
    sample, is_new = take(np.uint8, b).tolist(), take(np.uint8, b).tolist()
    tokens, blocks = take(np.int32, t).tolist(), take(np.int32, nb).tolist()
    ids = payload[off:off + ids_len].decode().split("\0") if b + nf + npre else []
    off += ids_len
    new_list, so_batch = pickle.loads(payload[off:off + new_len]) if new_len else ([], None)
    new = iter(new_list)
    tok_end, blk_end = np.cumsum(n_tok).tolist(), np.cumsum(n_new).tolist()
    scheduled, t0, b0 = [], 0, 0
    for i in range(b):
        scheduled.append(ScheduledRequest(ids[i], tokens[t0:tok_end[i]], start_pos[i],
                                          blocks[b0:blk_end[i]], bool(sample[i]),
                                          next(new) if is_new[i] else None))
        t0, b0 = tok_end[i], blk_end[i]
    return StepMessage(STEP, SchedulerOutput(scheduled, t, ids[b:b + nf],
                                             ids[b + nf:b + nf + npre], so_batch))
