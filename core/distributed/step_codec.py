"""The driver -> worker step message: a `SchedulerOutput` as a few flat arrays in one byte
string (no pickled object per scheduled request), plus the sampling states of the requests added
since the previous message, pickled once each.

Layout (little-endian): a header of int64 ``[kind, B, T, NB, F, P, ids_bytes, states_bytes]``;
per scheduled request ``start_pos`` int64[B], ``num_tokens`` int32[B], ``block_offset`` int32[B]
and ``num_new_blocks`` int32[B] (the blocks from ``block_offset`` on: only those gained since
the request's previous step, or its whole table), ``sample`` uint8[B]; all token ids int32[T];
the new block ids int32[NB]; the request ids (B scheduled, F finished, P preempted) as one UTF-8
string separated by NUL; the pickled list of ``(request_id, SamplingState)``.

The encoder and the decoder are stateful (block tables): every message goes to every worker,
in order.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from ..sampling_state import SamplingState
from ..scheduler import ScheduledRequest, SchedulerOutput

STEP, SHUTDOWN, GO = 1, 2, 3  # GO: start-up, every rank has loaded its weights
_HEADER_LEN = 8

# the codec carries exactly these fields; a new field must be added here (a test checks)
ENCODED_FIELDS = {
    ScheduledRequest: {"request_id", "token_ids", "start_pos", "block_ids", "sample"},
    SchedulerOutput: {"scheduled", "num_scheduled_tokens", "finished_request_ids",
                      "preempted_request_ids"},
}


@dataclass
class StepMessage:
    kind: int
    so: SchedulerOutput | None = None
    new_states: list[tuple[str, SamplingState]] = field(default_factory=list)


def fields_match() -> bool:
    """Whether the codec covers every field of the scheduler's dataclasses."""
    return all({f.name for f in dataclasses.fields(cls)} == names
               for cls, names in ENCODED_FIELDS.items())


def encode_control(kind: int) -> bytes:
    """A message with no step: SHUTDOWN or GO."""
    return np.array([kind] + [0] * (_HEADER_LEN - 1), np.int64).tobytes()


class StepEncoder:
    """The driver's side. It remembers, per running request, which block table it sent and how
    much of it, so that a step carries only the blocks each request gained since (the table
    is the block manager's own list: the same object while it only grows, a new one after
    preemption)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[list[int], int]] = {}

    def encode(self, so: SchedulerOutput, new_states: list[tuple[str, SamplingState]]) -> bytes:
        sent = self._sent
        for rid in so.finished_request_ids:
            sent.pop(rid, None)
        for rid in so.preempted_request_ids:
            sent.pop(rid, None)
        sched = so.scheduled
        b = len(sched)
        offsets = np.empty(b, np.int32)
        new_blocks = []
        for i, sr in enumerate(sched):
            prev = sent.get(sr.request_id)
            off = prev[1] if prev is not None and prev[0] is sr.block_ids else 0
            offsets[i] = off
            new_blocks.append(sr.block_ids[off:] if off else sr.block_ids)
            sent[sr.request_id] = (sr.block_ids, len(sr.block_ids))
        n_tok = np.fromiter((len(s.token_ids) for s in sched), np.int32, b)
        n_new = np.fromiter((len(x) for x in new_blocks), np.int32, b)
        tokens = np.fromiter(chain.from_iterable(s.token_ids for s in sched), np.int32,
                             int(n_tok.sum()))
        blocks = np.fromiter(chain.from_iterable(new_blocks), np.int32, int(n_new.sum()))
        finished = list(so.finished_request_ids)
        ids = "\0".join([s.request_id for s in sched] + finished
                        + list(so.preempted_request_ids)).encode()
        states = pickle.dumps(new_states) if new_states else b""
        header = np.array([STEP, b, len(tokens), len(blocks), len(finished),
                           len(so.preempted_request_ids), len(ids), len(states)], np.int64)
        return b"".join([
            header.tobytes(),
            np.fromiter((s.start_pos for s in sched), np.int64, b).tobytes(),
            n_tok.tobytes(), offsets.tobytes(), n_new.tobytes(),
            np.fromiter((s.sample for s in sched), np.uint8, b).tobytes(),
            tokens.tobytes(), blocks.tobytes(), ids, states])


class StepDecoder:
    """A worker's side: keeps each running request's block table, extended by every step."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def decode(self, payload: bytes) -> StepMessage:
        header = np.frombuffer(payload, np.int64, _HEADER_LEN)
        kind, b, t, nb, nf, npre, ids_len, states_len = (int(x) for x in header)
        if kind != STEP:
            return StepMessage(kind)
        off = _HEADER_LEN * 8

        def take(dtype, n: int) -> np.ndarray:
            nonlocal off
            a = np.frombuffer(payload, dtype, n, off)
            off += a.nbytes
            return a

        start_pos = take(np.int64, b).tolist()
        n_tok, offsets, n_new = take(np.int32, b), take(np.int32, b).tolist(), take(np.int32, b)
        sample = take(np.uint8, b).tolist()
        tokens, blocks = take(np.int32, t).tolist(), take(np.int32, nb).tolist()
        ids = payload[off:off + ids_len].decode().split("\0") if b + nf + npre else []
        off += ids_len
        states = pickle.loads(payload[off:off + states_len]) if states_len else []
        finished, preempted = ids[b:b + nf], ids[b + nf:b + nf + npre]
        tables = self._tables
        for rid in finished:
            tables.pop(rid, None)
        for rid in preempted:
            tables.pop(rid, None)
        tok_end, blk_end = np.cumsum(n_tok).tolist(), np.cumsum(n_new).tolist()
        scheduled, t0, b0 = [], 0, 0
        for i in range(b):
            table = tables.get(ids[i])
            if table is None:
                table = tables[ids[i]] = []
            del table[offsets[i]:]
            table.extend(blocks[b0:blk_end[i]])
            scheduled.append(ScheduledRequest(ids[i], tokens[t0:tok_end[i]], start_pos[i],
                                              table, bool(sample[i])))
            t0, b0 = tok_end[i], blk_end[i]
        return StepMessage(STEP, SchedulerOutput(scheduled, t, list(finished), preempted),
                           states)
