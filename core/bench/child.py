"""A compare adapter's own process: ``python -m MODULE`` reads a JSON job on stdin and prints
one marked JSON result line on stdout (`print_result`), among whatever its engine logs there;
each engine then has the device to itself."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


RESULT_MARK = "pagebatch-bench-result: "


def run_adapter(module: str, job: dict[str, Any]) -> dict[str, Any] | int:
    """Run ``module`` on ``job``; its result line (`print_result`) as a dict, or an exit status
    when it failed or printed none (the tail of its output printed)."""
    proc = subprocess.run([sys.executable, "-m", module], input=json.dumps(job),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    for line in reversed(proc.stdout.splitlines()):  # engines log to stdout too (vLLM does)
        at = line.rfind(RESULT_MARK)  # (after a log line's text without its newline, too)
        if at >= 0:
            return json.loads(line[at + len(RESULT_MARK):])
    print(f"{module} printed no result line:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}",
          file=sys.stderr)
    return 1


def print_result(result: dict[str, Any]) -> None:
    """The adapter's side: print ``result`` as its result line (found among log lines)."""
    print(RESULT_MARK + json.dumps(result), flush=True)
