"""A torch.profiler trace of a worker rank's steps, asked for through the environment (the
driver's side is scripts/profile_engine.py; a worker has no command line of its own):

    PAGEBATCH_TRACE_STEPS=200:220 PAGEBATCH_TRACE_DIR=/tmp/out python3 scripts/profile_engine.py ...

Each worker profiles its step messages ``first`` to ``last - 1`` (counted from its first step
after start-up, empty steps included) with CPU and CUDA activity and writes
``<dir>/trace-rank<rank>.json.gz`` (a Chrome trace). Unset: nothing is done per step but a
counter increment and two comparisons."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

STEPS_ENV, DIR_ENV = "PAGEBATCH_TRACE_STEPS", "PAGEBATCH_TRACE_DIR"


def parse_steps(value: str) -> tuple[int, int]:
    """``"first:last"`` -> (first, last). Raises ValueError naming the value otherwise."""
    try:
        first, last = (int(v) for v in value.split(":"))
    except ValueError:
        raise ValueError(f"{STEPS_ENV}={value!r}: expected FIRST:LAST step numbers") from None
    if not 0 <= first < last:
        raise ValueError(f"{STEPS_ENV}={value!r}: need 0 <= FIRST < LAST")
    return first, last


class StepTrace:
    """Call `before_step` before each step message is run (also on an empty one)."""

    def __init__(self, rank: int, environ=os.environ) -> None:
        self.rank, self.step, self._prof = rank, 0, None
        steps, self.dir = environ.get(STEPS_ENV), environ.get(DIR_ENV)
        self.first, self.last = parse_steps(steps) if steps and self.dir else (-1, -1)

    def before_step(self) -> None:
        if self.step == self.first:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        elif self.step == self.last:
            self.finish()
        self.step += 1

    def finish(self) -> None:
        """Stop a running trace and write it (also at shutdown, before ``last``)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        path = os.path.join(self.dir, f"trace-rank{self.rank}.json.gz")
        prof.export_chrome_trace(path)
        logger.info("rank %d: trace of steps %d..%d written to %s", self.rank, self.first,
                    self.step - 1, path)
