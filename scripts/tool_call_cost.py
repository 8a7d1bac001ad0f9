"""Event-loop time of streamed tool-call parsing (the review's measurement, /tmp/tool_cost.py):
one ~14 KB write_file-style call fed to a ToolCallStream ~4 characters (about a token) a step,
through ``hermes`` and ``required``. Before the readers kept their place (core/json_scan.py)
each step re-parsed the whole text: 3,547 steps took 2.4-3.9 s; now ~0.02 s (best of
three runs).

    .venv/bin/python scripts/tool_call_cost.py
"""

import json
import time

from pagebatch.plugins.frontends.http.tool_calls import RequiredParser, ToolCallStream
from pagebatch.plugins.frontends.http.tools import ToolRequest
from pagebatch.plugins.tool_parsers.hermes import HermesToolParser

code = "def f(x):\n    return x * 2  # a line of code\n" * 300  # ~13 KB argument
args = json.dumps({"path": "a.py", "content": code})
req = ToolRequest([{"type": "function", "function": {"name": "write_file"}}], "auto", None, True,
                  None)
for name, parser, text in [
        ("hermes", HermesToolParser(None),
         '<tool_call>{"name": "write_file", "arguments": ' + args + "}</tool_call>"),
        ("required", RequiredParser(), '[{"name": "write_file", "arguments": ' + args + "}]")]:
    steps = list(range(4, len(text), 4)) + [len(text)]
    dt = float("inf")
    for _ in range(3):  # the best of three
        stream = ToolCallStream(req, parser)
        t0 = time.perf_counter()
        got = [stream.delta(text[:k], k == len(text)) for k in steps]
        dt = min(dt, time.perf_counter() - t0)
    sent = "".join(f["function"].get("arguments", "") for d in got for f in d.get("tool_calls", []))
    assert sent == args, name
    print(f"{name}: {len(text)} chars, {len(steps)} chunks, {dt:.3f} s of event-loop time "
          f"({dt / len(steps) * 1e6:.1f} us a chunk)")
