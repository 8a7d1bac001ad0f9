"""The pipeline-stage CUDA-graph step (core/model_runner.py `_replay`), on the CPU
with stand-ins for the graphs and the stage's communication: the order of the operations each
stage issues on its stream, and the rows each moves (the GPU path itself needs two GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagebatch.model_runner import ModelRunner

H = 4


class _Par:
    def __init__(self, first, last, log):
        self.is_first_stage, self.is_last_stage, self.log = first, last, log

    def recv_payload(self, n, width, dtype, out=None):
        assert out is not None and tuple(out.shape) == (n, width) and out.is_contiguous()
        out.fill_(float(n))
        self.log.append(("recv", n, out.data_ptr()))
        return out

    def wait_sends(self):
        self.log.append(("wait",))

    def send_payload(self, payload):
        self.sent = payload
        self.log.append(("send", tuple(payload.shape), payload.data_ptr()))


class _Graphs:
    def __init__(self, log, width):
        self.log, self.outputs = log, {bs: torch.zeros(bs, width) for bs in (1, 2, 4, 8)}

    def replay(self, bs):
        self.log.append(("replay", bs))
        return self.outputs[bs]


@pytest.mark.parametrize("stage", ["first", "middle", "last"])
@pytest.mark.parametrize("bs", [1, 4, 8])
def test_stage_replay_order_and_rows(stage, bs):
    log = []
    first, last = stage == "first", stage == "last"
    pp_in = None if first else torch.zeros(8, 2 * H)
    out_width = H if last else 2 * H
    runner = SimpleNamespace(parallel=_Par(first, last, log), _stage_io=True, _pp_in=pp_in,
                             graphs=_Graphs(log, out_width))
    out = ModelRunner._replay(runner, bs)
    kinds = [e[0] for e in log]
    if first:
        assert kinds == ["replay", "send"]
    elif last:
        assert kinds == ["recv", "replay"]
    else:
        assert kinds == ["recv", "replay", "send"]
    if not first:  # received in place into the graph's static input, bs rows
        assert log[0][1] == bs and log[0][2] == pp_in.data_ptr()
        assert torch.all(pp_in[:bs] == bs)
    if last:
        assert out is runner.graphs.outputs[bs]
    else:  # sends a copy of the graph's static output (the next replay may overwrite it while
        # the send is in flight), all bs (padded) rows
        assert out is None
        assert log[-1][1] == (bs, 2 * H) and log[-1][2] != runner.graphs.outputs[bs].data_ptr()
        assert torch.equal(runner.parallel.sent, runner.graphs.outputs[bs])
