"""Output processing of the front half: stop strings, log-prob dicts, and the per-request state
that turns the core's `EngineCoreOutput`s into `RequestOutput`s.

Stop strings (vLLM's semantics): the text is searched as it grows; a match ends the sample with
finish reason ``stop`` and ``stop_reason`` the string, and the text is cut before it (after it
with ``include_stop_str_in_output``). Until then, a tail of the text that could still grow into a
stop string is held back, so no intermediate output ever shows a stop string or part of one,
and every output's text is a prefix of the final text. As in vLLM, stop strings are not searched
while the sample has ``min_tokens`` tokens or fewer.
"""

from __future__ import annotations

from typing import Callable

from .detokenizer import IncrementalDetokenizer
from .engine_core import EngineCoreOutput
from .request import (CompletionOutput, FinishReason, Logprob, LogprobsLists, PositionLogprobs,
                      RequestOutput, SamplingParams)


class StopStrings:
    """Finds stop strings in a growing text and says how much of it may be shown."""

    def __init__(self, stop: list[str], include_in_output: bool):
        self.stop = stop
        self.include_in_output = include_in_output
        self.committed = 0  # text before this index is final: matches start at or after it
        self.searched = 0  # text length already searched

    def check(self, text: str, active: bool = True) -> tuple[str, int] | None:
        """Search the part of the cumulative ``text`` not searched yet (plus the overlap a stop
        string may straddle). Returns (stop string, length of text to keep) for the earliest
        match (ties: the first in the list), or None. ``active`` False (min_tokens not
        reached): nothing is searched and the text so far becomes final as it is."""
        if not active:
            self.committed = self.searched = len(text)
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, max(self.committed, self.searched - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        self.searched = len(text)
        if best is None:
            return None
        i, s = best
        return s, i + len(s) if self.include_in_output else i

    def visible(self, text: str) -> int:
        """How much of ``text`` (already checked, no match) may be shown: all but the longest
        tail that is the beginning of some stop string (with include_stop_str_in_output
        everything: a match is shown anyway)."""
        if self.include_in_output or not text:
            return len(text)
        hold, last = 0, text[-1]
        for s in self.stop:
            k = min(len(s) - 1, len(text) - self.committed)
            while k > hold:  # only the k whose prefix s[:k] ends in text's last character
                k = s.rfind(last, 0, k) + 1
                if k > hold and text.endswith(s[:k]):
                    hold = k
                    break
                k -= 1
        return len(text) - hold


def position_logprobs(lists: LogprobsLists,
                      decode: Callable[[int], str] | None) -> list[PositionLogprobs]:
    """One dict per row: the actual token first (its own rank), then the top-N (ranks 1..N)."""
    out = []
    for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
        d = {ids[0]: Logprob(lps[0], rank, decode(ids[0]) if decode else None)}
        for j in range(1, len(ids)):
            if ids[j] not in d:
                d[ids[j]] = Logprob(lps[j], j, decode(ids[j]) if decode else None)
        out.append(d)
    return out


class SampleState:
    """One of a request's n samples, as the front half sees it: token ids, text, stop strings,
    log-probs and how it finished. ``core_id`` and ``seed``: its request id and seed in the
    engine core. ``decode``: token id -> text, for log-prob dicts."""

    def __init__(self, index: int, core_id: str, seed: int, params: SamplingParams,
                 detok: IncrementalDetokenizer | None, decode: Callable[[int], str] | None):
        self.index = index
        self.core_id = core_id
        self.seed = seed
        self.params = params
        self.detok = detok
        self.decode = decode
        stops = params.stop_strings
        self.stop = StopStrings(stops, params.include_stop_str_in_output) if stops else None
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = (
            [] if params.logprobs is not None else None)
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text_end: int | None = None  # where a stop string cut the text
        # final-only requests without stop strings decode their text once, at the end
        self.defer_text = False
        self._undecoded: list[int] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, o: EngineCoreOutput) -> bool:
        """Apply one core output. Returns True when a stop string finished the sample here
        while the core has not (the caller aborts it in the core)."""
        new = o.new_token_ids
        self.token_ids.extend(new)
        if self.logprobs is not None and o.logprobs is not None:
            self.logprobs.extend(position_logprobs(o.logprobs, self.decode))
            self.cumulative_logprob += sum(row[0] for row in o.logprobs.logprobs)
        core_done = o.finish_reason is not None
        stop_string = None
        if self.detok is not None:
            text_ids = new
            if o.finish_reason == FinishReason.STOP.value and new and \
                    not self.params.include_stop_str_in_output:
                text_ids = new[:-1]  # as vLLM: the stop token's (or EOS's) text is not shown
            if self.defer_text and self.stop is None and not core_done:
                self._undecoded.extend(text_ids)
                text_ids = None
            elif self._undecoded:
                text_ids, self._undecoded = self._undecoded + text_ids, []
            grew = text_ids is not None and bool(self.detok.add_tokens(text_ids,
                                                                        final=core_done))
            if self.stop is not None and grew:
                active = len(self.token_ids) > self.params.min_tokens
                stop_string = self.stop.check(self.detok.text, active)
        if stop_string is not None:
            self.finish_reason = FinishReason.STOP.value
            self.stop_reason, self.text_end = stop_string
            return not core_done
        if core_done:
            self.finish_reason = o.finish_reason
            last = self.token_ids[-1] if self.token_ids else None
            if o.finish_reason == FinishReason.STOP.value and last in self.params.stop_token_ids:
                self.stop_reason = last
        return False

    @property
    def text(self) -> str:
        if self.detok is None:
            return ""
        text = self.detok.text
        if self.text_end is not None:
            return text[:self.text_end]
        if self.stop is not None and not self.finished:
            return text[:self.stop.visible(text)]
        return text

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
            list(self.logprobs) if self.logprobs is not None else None,
            self.cumulative_logprob if self.logprobs is not None else None)


class RequestState:
    """A request in the front half: its prompt, its n samples and its prompt log-probs."""

    def __init__(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 samples: list[SampleState]):
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.samples = samples
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.error: str | None = None
        self.error_param: str | None = None  # the request field at fault, for a user error
        self.final_only = False

    def want_final_only(self) -> None:
        """Only the final output is wanted (offline generate, vLLM's FINAL_ONLY): no per-step
        `RequestOutput` (each one copies the token lists), text decoded once at the end."""
        self.final_only = True
        for s in self.samples:
            s.defer_text = True

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def add_prompt_logprobs(self, lists: LogprobsLists,
                            decode: Callable[[int], str] | None) -> None:
        if self.prompt_logprobs is None:
            return
        rows = position_logprobs(lists, decode)
        del self.prompt_logprobs[lists.start:]  # a row is never sent twice; this keeps it so
        self.prompt_logprobs.extend(rows)

    def output(self, request_id: str) -> RequestOutput:
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids,
                             [s.completion() for s in self.samples], self.finished, self.error,
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None
                             else None, self.error_param)
