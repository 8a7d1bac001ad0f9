"""The config lookup and start-up autotuner of core/kernels/tuned.py and core/kernels/autotune.py,
on the CPU with a fake CUDA device name, fake candidates and a fake timer (no kernel runs):
the lookup order (sweep > user cache > packaged table > autotune > rule), the user cache's
round trip, merge and corrupted files, no tuning while a CUDA graph is captured, the fastest
correct candidate winning; and that the attention rule (plugins/attention/triton_backend.py
`choose_config`) gives sane tiles for the head layouts of the Llama / Qwen2 / Qwen3 / Mistral
families and their tensor-parallel shards."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagebatch.kernels import autotune, tuned

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
KEY = "n=96,k=160"


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """(sweep dir, user cache dir, packaged dir), each empty; tuning allowed; a fake GPU name."""
    sweep, cache, packaged = tmp_path / "sweep", tmp_path / "cache", tmp_path / "packaged"
    for d in (sweep, packaged):
        d.mkdir()
    monkeypatch.setenv(tuned.ENV_DIR, str(sweep))
    monkeypatch.setenv(tuned.CACHE_ENV, str(cache))
    monkeypatch.setenv(autotune.ENV_ENABLE, "1")
    monkeypatch.setattr(tuned, "_device_name", lambda index: "Fake_GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setitem(autotune._stats, "seconds", 0.0)
    tuned.clear_caches()
    yield sweep, tuned.cache_dir(), packaged
    tuned.clear_caches()


def _write(directory, table, kernel="toy"):
    directory.mkdir(parents=True, exist_ok=True)
    tuned.config_path(kernel, "Fake_GPU", directory).write_text(json.dumps(table))


class Fake:
    """Candidates ``{"id": i}``; ``times[i]`` seconds each; ``wrong``: ids whose output is off;
    counts bench() calls."""

    def __init__(self, times, wrong=(), fails=()):
        self.times, self.wrong, self.fails, self.benched = times, set(wrong), set(fails), 0

    def candidates(self, rows):
        return [{"id": i, "rows": rows} for i in range(len(self.times))]

    def bench(self, rows):
        self.benched += 1
        ref = torch.ones(rows, 4)

        def run(cfg):
            if cfg["id"] in self.fails:
                raise RuntimeError("out of resources")
            return ref * (2.0 if cfg["id"] in self.wrong else 1.0)
        return run, ref

    def timer(self, cfg, launch):
        launch()
        return self.times[cfg["id"]]

    def choose(self, m, directory):
        return autotune.choose("toy", CUDA, KEY, m, directory, self.candidates, self.bench,
                               timer=self.timer)


def test_row_bucket():
    assert [autotune.row_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8,
                                                                           16, 16]
    for bad in (0, 17):
        with pytest.raises(ValueError, match=f"m={bad}"):
            autotune.row_bucket(bad)


def test_lookup_order(dirs):
    """Per (shape, M): the sweep's entry over the user cache's over the packaged one; then the
    autotuner (which remembers its pick); with tuning off, the rule's guess."""
    sweep, cache, packaged = dirs
    _write(packaged, {KEY: {"1": {"src": "packaged"}, "2": {"src": "packaged"},
                            "4": {"src": "packaged"}}})
    _write(cache, {KEY: {"1": {"src": "cache"}, "2": {"src": "cache"}}})
    _write(sweep, {KEY: {"1": {"src": "sweep"}}})
    fake = Fake([3.0, 1.0, 2.0])
    assert fake.choose(1, packaged) == {"src": "sweep"}
    assert fake.choose(2, packaged) == {"src": "cache"}
    assert fake.choose(3, packaged) == {"src": "packaged"}  # M=4 serves 3 rows
    assert fake.benched == 0
    assert fake.choose(5, packaged) == {"id": 1, "rows": 8}  # tuned at the bucket, 8 rows
    assert fake.benched == 1
    assert tuned.read_table(tuned.config_path("toy", "Fake_GPU", cache))[KEY][8] == {
        "id": 1, "rows": 8}
    assert fake.choose(7, packaged) == {"id": 1, "rows": 8}  # remembered: no second timing
    assert fake.benched == 1
    assert Fake([1.0]).choose(16, packaged) == {"id": 0, "rows": 16}  # one candidate: no timing


def test_rule_when_tuning_is_off(dirs, monkeypatch):
    monkeypatch.setenv(autotune.ENV_ENABLE, "0")
    fake = Fake([3.0, 1.0])
    assert fake.choose(1, dirs[2]) == {"id": 0, "rows": 1}
    assert fake.benched == 0
    assert not any(dirs[1].glob("*.json")) if dirs[1].exists() else True


def test_no_tuning_while_capturing(dirs, monkeypatch):
    """Under CUDA-graph capture the rule's guess is used, nothing is timed or remembered."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fake = Fake([3.0, 1.0])
    assert fake.choose(2, dirs[2]) == {"id": 0, "rows": 2}
    assert fake.benched == 0 and not dirs[1].exists()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert fake.choose(2, dirs[2]) == {"id": 1, "rows": 2}


def test_fastest_correct_candidate_wins(dirs):
    """Candidates that raise or give a wrong result are dropped, however fast."""
    fake = Fake([5.0, 0.5, 0.1, 2.0, 1.0], wrong={2}, fails={1})
    assert fake.choose(1, dirs[2]) == {"id": 4, "rows": 1}
    none_ran = Fake([1.0, 2.0], fails={0, 1})
    assert none_ran.choose(4, dirs[2]) == {"id": 0, "rows": 4}  # the rule's guess


def test_budget_spent_uses_the_rule(dirs, monkeypatch):
    monkeypatch.setenv(autotune.ENV_MAX_S, "10")
    monkeypatch.setitem(autotune._stats, "seconds", 11.0)
    fake = Fake([3.0, 1.0])
    assert fake.choose(1, dirs[2]) == {"id": 0, "rows": 1}
    assert fake.benched == 0


def test_cache_round_trip_and_merge(dirs):
    """`remember` keeps the file's other entries (another process's), writes valid JSON of the
    packaged tables' format, and a new process (cleared caches) reads it back."""
    _, cache, _ = dirs
    _write(cache, {"other": {"16": {"block_n": 8}}})
    tuned.remember("toy", "Fake_GPU", KEY, 1, {"block_n": 64})
    tuned.remember("toy", "Fake_GPU", KEY, 4, {"block_n": 32})
    raw = json.loads(tuned.config_path("toy", "Fake_GPU", cache).read_text())
    assert raw == {"other": {"16": {"block_n": 8}},
                   KEY: {"1": {"block_n": 64}, "4": {"block_n": 32}}}
    assert not list(cache.glob("*.tmp"))  # the temporary file was renamed over it
    tuned.clear_caches()
    assert tuned.lookup("toy", CUDA, KEY, 3, dirs[2]) == {"block_n": 32}
    assert tuned.lookup("toy", CUDA, "other", 9, dirs[2]) == {"block_n": 8}


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"k": {"x": 1}}'])
def test_corrupted_cache_file_is_ignored(dirs, caplog, content):
    """A user cache file that is not a table is ignored with a warning (the packaged entry is
    used), and the next remembered entry replaces it with a valid file."""
    _, cache, packaged = dirs
    cache.mkdir(parents=True)
    path = tuned.config_path("toy", "Fake_GPU", cache)
    path.write_text(content)
    _write(packaged, {KEY: {"1": {"src": "packaged"}}})
    with caplog.at_level(logging.WARNING, logger="pagebatch.kernels.tuned"):
        assert tuned.lookup("toy", CUDA, KEY, 1, packaged) == {"src": "packaged"}
    assert "ignored" in caplog.text and str(path) in caplog.text
    tuned.remember("toy", "Fake_GPU", KEY, 2, {"src": "tuned"})
    assert json.loads(path.read_text()) == {KEY: {"2": {"src": "tuned"}}}


def test_no_lookup_off_cuda(dirs):
    _write(dirs[2], {KEY: {"1": {"src": "packaged"}}})
    assert tuned.lookup("toy", torch.device("cpu"), KEY, 1, dirs[2]) is None
    assert not autotune.tuning_allowed(torch.device("cpu"))


def test_shards_get_keys_of_their_own():
    """Tensor-parallel shards look up (and tune) the shard's shape: N or K divided by tp."""
    from pagebatch.layers.dense import gemv_key
    from pagebatch.quant.kernels.wna16_configs import shape_key

    keys = {gemv_key(18944 * 2 // tp, 3584) for tp in (1, 2, 4)}
    keys |= {gemv_key(3584, 18944 // tp) for tp in (1, 2, 4)}
    assert len(keys) == 6
    assert shape_key(4, 4736, 3584, 128) != shape_key(4, 9472, 3584, 128)


# (num_heads, num_kv_heads, head_dim) of Qwen2.5-7B (and its TP=2, TP=4 shards), Qwen3-4B,
# Mistral-Nemo / Llama-3.1-8B, Qwen2-0.5B, Llama-3.2-1B
HEADS = [(28, 4, 128), (14, 2, 128), (7, 1, 128), (32, 8, 128), (16, 4, 128), (14, 2, 64),
         (32, 8, 64)]


@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_attention_rule_for_head_layouts(hq, hkv, d, monkeypatch):
    """`choose_config` on a 132-SM GPU: tiles hold whole GQA groups (block_m a power of two >=
    the group), split-KV fills the GPU at batch 1 on long contexts and is off for batches that
    fill it, for any head count (group 7 of Qwen2.5 included)."""
    from pagebatch.plugins.attention import triton_backend as tb

    monkeypatch.setattr(tb, "num_sms", lambda device: 132)
    group = hq // hkv
    for tokens, seqs, q_len, ctx in ((1, 1, 1, 4096), (256, 256, 1, 2048), (4096, 1, 4096, 4096),
                                     (600, 4, 512, 1024)):
        cfg = tb.choose_config(tokens, seqs, q_len, ctx, hkv, group, d, torch.bfloat16, CUDA)
        assert cfg.block_m & (cfg.block_m - 1) == 0 and cfg.block_m >= max(group, 16)
        assert cfg.block_m // group >= 1 and 1 <= cfg.num_splits <= tb.MAX_SPLITS
        if seqs == 1 and q_len == 1:
            assert cfg.num_splits * hkv >= min(132, ctx // tb.MIN_TOKENS_PER_SPLIT * hkv)
        if seqs * hkv >= 2 * 132:  # the batch's programs fill the GPU twice: no split
            assert cfg.num_splits == 1


def test_an_entry_of_more_rows_does_not_serve_a_smaller_bucket(dirs):
    """A cold cache that the warm-up filled at 16 rows first (it reaches the largest decode
    bucket first) must not hand that config (the tensor-core kernel, cuBLAS) to one row: the
    smaller bucket is tuned itself, or takes the rule's guess when it cannot be."""
    sweep, cache, packaged = dirs
    _write(packaged, {KEY: {"16": {"src": "packaged-16"}}})
    fake = Fake([3.0, 1.0])
    assert fake.choose(9, packaged) == {"src": "packaged-16"}  # within bucket 16
    assert fake.choose(1, packaged) == {"id": 1, "rows": 1}  # tuned at its own bucket
    assert fake.benched == 1
    assert fake.choose(1, packaged) == {"id": 1, "rows": 1}  # remembered
    assert fake.benched == 1
    off = Fake([3.0, 1.0])
    autotune._stats["seconds"] = 1e9  # the budget spent: no tuning
    assert off.choose(2, packaged) == {"id": 0, "rows": 2}  # the rule, not the 16-row entry
    assert off.benched == 0
