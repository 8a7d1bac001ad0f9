"""The README's main command (its first code block after "Quick start") as a new user runs it:
the default model answers, and stderr holds nothing but pagebatch's own INFO lines — no
``nanobind: leaked`` lines from a Triton import at exit, no skipped-plugin or library warnings a
user cannot act on (issue 25, item 9)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
EXPECTED_STDERR = re.compile(r"^INFO pagebatch\.")


def _main_command() -> list[str]:
    """`.venv/bin/pagebatch generate ...` of the README's quick start, as an argv whose program
    is this interpreter's pagebatch (the set-up part, `bash scripts/setup &&`, has run)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    line = block.strip().splitlines()[0]
    setup, run = line.split("&&", 1)
    assert setup.strip() == "bash scripts/setup", line
    argv = shlex.split(run)
    assert argv[0] == ".venv/bin/pagebatch", line
    return [sys.executable, "-m", "pagebatch.cli", *argv[1:]]


def test_the_readme_main_command_answers_quietly():
    proc = subprocess.run(_main_command(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout, proc.stdout
    unexpected = [line for line in proc.stderr.splitlines()
                  if line.strip() and not EXPECTED_STDERR.match(line)]
    assert not unexpected, "\n".join(unexpected[:20])
