"""A worker rank's step trace (core/distributed/step_trace.py), asked for by environment."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from pagebatch.distributed.step_trace import StepTrace, parse_steps


def test_trace_covers_the_asked_steps_and_is_written(tmp_path):
    env = {"PAGEBATCH_TRACE_STEPS": "1:3", "PAGEBATCH_TRACE_DIR": str(tmp_path)}
    trace = StepTrace(2, env)
    marks = []
    for i in range(5):
        trace.before_step()
        with torch.profiler.record_function(f"step{i}"):
            torch.ones(4).sum()
        marks.append(trace._prof is not None)
    assert marks == [False, True, True, False, False]
    events = json.load(gzip.open(tmp_path / "trace-rank2.json.gz", "rt"))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step1", "step2"} <= names and not names & {"step0", "step3"}


def test_trace_cut_short_by_shutdown_is_still_written(tmp_path):
    trace = StepTrace(1, {"PAGEBATCH_TRACE_STEPS": "0:100", "PAGEBATCH_TRACE_DIR": str(tmp_path)})
    trace.before_step()
    trace.finish()
    assert (tmp_path / "trace-rank1.json.gz").is_file()


def test_unset_or_bad_values():
    trace = StepTrace(1, {})
    for _ in range(3):
        trace.before_step()
    assert trace._prof is None
    for bad in ("5", "a:b", "3:3", "-1:2"):
        with pytest.raises(ValueError, match="PAGEBATCH_TRACE_STEPS"):
            parse_steps(bad)
