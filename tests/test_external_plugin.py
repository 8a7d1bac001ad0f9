"""The out-of-tree plugin package in examples/: installed into the test environment, listed by
`pagebatch plugins`, selected by name from a config file, and run."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pagebatch import LLM, SamplingParams
from pagebatch.registry import reset_registry

PKG = Path(__file__).resolve().parents[1] / "examples" / "plugin-shortest-first"


@pytest.fixture(scope="module")
def installed_plugin():
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation", str(PKG)], check=True)
    importlib.invalidate_caches()
    reset_registry()
    yield
    subprocess.run(pip + ["uninstall", "-y", "pagebatch-shortest-first"], check=True)
    importlib.invalidate_caches()
    reset_registry()


def test_pagebatch_plugins_lists_it(installed_plugin):
    out = subprocess.run([sys.executable, "-m", "pagebatch.cli", "plugins"], check=True,
                         capture_output=True, text=True).stdout
    assert "shortest_first 0.1.0 (third-party)" in out
    assert "scheduling_policy: shortest_first" in out
    assert "config_option: shortest_first_max_wait" in out


def test_selected_from_a_config_file_and_run(installed_plugin, tiny_model_dir, tmp_path):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\ndevice: cpu\nnum_kv_blocks: 64\nblock_size: 4\n"
                   f"scheduling_policy: shortest_first\nshortest_first_max_wait: 5\n"
                   f"max_num_seqs: 1\n")
    llm = LLM(config_file=cfg)
    policy = llm.engine.core.scheduler.policy
    assert type(policy).__name__ == "ShortestFirstPolicy" and policy.max_wait == 5.0
    prompts = [{"prompt_token_ids": [5] * n} for n in (30, 3, 12)]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p in prompts]
    finished = []
    while engine.has_unfinished_requests:
        finished += [o.request_id for o in engine.step() if o.finished]
    # one at a time (max_num_seqs 1): the first admitted is the shortest, then by length
    assert finished == [ids[1], ids[2], ids[0]]


def test_blocked_by_name(installed_plugin, tiny_model_dir, monkeypatch):
    from pagebatch.errors import PluginError

    monkeypatch.setenv("PAGEBATCH_BLOCK_PLUGINS", "shortest_first")
    reset_registry()
    try:
        with pytest.raises(PluginError, match="shortest_first"):
            LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64,
                scheduling_policy="shortest_first")
    finally:
        monkeypatch.delenv("PAGEBATCH_BLOCK_PLUGINS")
        reset_registry()
