"""A compare adapter's own process: ``python -m MODULE`` reads a JSON job on stdin and prints
one JSON result line on stdout (each engine then has the device to itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def run_adapter(module: str, job: dict[str, Any]) -> dict[str, Any] | int:
    """Run ``module`` on ``job``; its last stdout line as a dict, or its exit status when it
    failed (the tail of its stderr printed)."""
    proc = subprocess.run([sys.executable, "-m", module], input=json.dumps(job),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    return json.loads(proc.stdout.strip().splitlines()[-1])
