"""`pagebatch bench serve` against a real `pagebatch serve` process over the tiny model (started
with `--metrics-vllm-names`): a two-rate sweep of a mixed-length, shared-prefix dataset with
goodput SLOs, the cost per 1M output tokens, the JSON's schema and the PNG plot; a chat run at
a constant rate; and /metrics after that known traffic, under both names."""

from __future__ import annotations

import json

import pytest

from http_helpers import ENGINE_KEYS, KEY, MODEL, cli_args, metric, serve_process
from pagebatch.bench.serve_dataset import DatasetSpec, make_dataset

# one run's JSON (a flat object; a --rates sweep: {"rates": [...], "runs": [one per rate]})
RUN_SCHEMA = {
    "completed": int, "failed": int, "errors": list, "duration_s": float,
    "total_input_tokens": int, "total_output_tokens": int, "request_throughput": float,
    "output_token_throughput": float, "total_token_throughput": float,
    "goodput_slos_ms": (dict, type(None)), "good_requests": (int, type(None)),
    "request_goodput": (float, type(None)), "ttft": dict, "tpot": dict, "itl": dict,
    "e2el": dict, "model": str, "base_url": str, "endpoint": str, "num_prompts": int,
    "input_len": int, "output_len": int, "range_ratio": float, "shared_prefix_len": int,
    "prompt_kind": str, "request_rate": (float, str), "arrival": str, "burstiness": float,
    "max_concurrency": (int, type(None)), "ignore_eos": bool, "seed": int,
    "client_processes": int,
}
STAT_KEYS = {"mean_ms", "median_ms", "std_ms", "p50_ms", "p90_ms", "p99_ms"}
SPEC = DatasetSpec(num_prompts=4, input_len=8, output_len=5, range_ratio=0.5,
                   shared_prefix_len=4, vocab_size=256, seed=0)


def check_run_schema(run: dict, cost: bool = False) -> None:
    want = dict(RUN_SCHEMA, **({"gpu_cost_per_hour": float,
                                "cost_per_1m_output_tokens": float} if cost else {}))
    assert set(run) == set(want)
    for key, typ in want.items():
        assert isinstance(run[key], typ), (key, run[key])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert set(run[name]) == STAT_KEYS and all(
            isinstance(v, float) for v in run[name].values()), name


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    """A real `pagebatch serve` process (conftest's `http` client talks to it)."""
    log = tmp_path_factory.mktemp("bench-serve") / "serve.log"
    with serve_process([str(tiny_model_dir), *cli_args(ENGINE_KEYS), "--metrics-vllm-names"],
                       log) as (_, url):
        yield url


def test_sweep_two_rates(base, http, tmp_path, capsys):
    from pagebatch.cli import main

    def counters():
        return {p + n: metric(http, p + n, default=0) for p in ("pagebatch:", "vllm:")
                for n in ("prompt_tokens_total", "generation_tokens_total")}

    before = counters()
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["bench", "serve", "--base-url", base, "--api-key", KEY,
               "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
               "--range-ratio", "0.5", "--shared-prefix-len", "4", "--vocab-size", "256",
               "--rates", "20,inf", "--goodput", "ttft:60000", "e2el:60000",
               "--gpu-cost-per-hour", "3.6", "--output", str(out), "--plot", str(png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "goodput req/s (ttft:60000 e2el:60000 ms)" in printed and "p90 ITL ms" in printed
    sweep = json.loads(out.read_text())
    assert set(sweep) == {"rates", "runs"} and sweep["rates"] == [20.0, "inf"]
    n_in = sum(r.prompt_len for r in make_dataset(SPEC))  # token ids: exact
    n_out = sum(r.output_len for r in make_dataset(SPEC))  # ignore_eos: exact
    for run, rate in zip(sweep["runs"], (20.0, "inf")):
        check_run_schema(run, cost=True)
        assert (run["completed"], run["failed"], run["request_rate"]) == (4, 0, rate)
        assert (run["total_input_tokens"], run["total_output_tokens"]) == (n_in, n_out)
        assert run["output_token_throughput"] == n_out / run["duration_s"]
        assert run["good_requests"] == 4 and run["request_goodput"] == 4 / run["duration_s"]
        assert run["cost_per_1m_output_tokens"] == 3.6 / (
            run["output_token_throughput"] * 3600) * 1e6
        t = run["ttft"]
        assert 0 < t["p50_ms"] == t["median_ms"] <= t["p90_ms"] <= t["p99_ms"]
        assert run["e2el"]["p99_ms"] <= run["duration_s"] * 1e3
    # 20 req/s: four requests spread over ~0.15 s (Poisson, seed 0); inf: all at once
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # /metrics moved by exactly the sweep's tokens, under both names
    after = counters()
    for p in ("pagebatch:", "vllm:"):
        assert after[p + "prompt_tokens_total"] - before[p + "prompt_tokens_total"] == 2 * n_in
        assert after[p + "generation_tokens_total"] - before[p + "generation_tokens_total"] \
            == 2 * n_out


def test_chat_at_a_constant_rate(base, http, tmp_path):
    from pagebatch.cli import main

    out = tmp_path / "chat.json"
    done = metric(http, "vllm:request_success_total", 'finished_reason="length"', default=0)
    rc = main(["bench", "serve", "--base-url", base, "--api-key", KEY,
               "--endpoint", "/v1/chat/completions", "--num-prompts", "3", "--input-len", "6",
               "--output-len", "4", "--request-rate", "30", "--arrival", "constant",
               "--percentiles", "50,90,99", "--output", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())
    check_run_schema(run)
    assert (run["completed"], run["prompt_kind"], run["arrival"]) == (3, "text", "constant")
    assert run["total_output_tokens"] == 12 and run["total_input_tokens"] > 3 * 6  # template
    assert run["request_goodput"] is None
    # /metrics: this run's requests finished by length, under both names; idle again
    for name in ("request_success_total", "num_requests_waiting", "num_requests_running"):
        labels = 'finished_reason="length"' if "success" in name else ""
        assert metric(http, "vllm:" + name, labels) == metric(http, "pagebatch:" + name, labels)
    assert metric(http, "vllm:request_success_total", 'finished_reason="length"') == done + 3
    assert metric(http, "vllm:num_requests_waiting", f'model_name="{MODEL}"') == 0


@pytest.mark.parametrize("flags, msg", [
    (["--range-ratio", "1.5"], "--range-ratio must be in [0, 1), got 1.5"),
    (["--goodput", "ttfb:5"], "goodput metric must be one of ttft, tpot, itl, e2el, got 'ttfb'"),
    (["--arrival", "constant", "--burstiness", "2"], "--arrival constant takes none"),
    (["--endpoint", "/v1/chat/completions", "--prompt-kind", "token-ids"], "text prompts"),
    (["--client-processes", "0"], "--client-processes must be >= 1, got 0"),
    (["--client-processes", "2", "--max-concurrency", "4"],
     "--max-concurrency 4 is one limit over all requests; it takes --client-processes 1"),
])
def test_bad_flags(flags, msg, capsys):
    from pagebatch.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags]) == 2
    assert msg in capsys.readouterr().err


def test_client_processes(base, tmp_path):
    """``--client-processes 2``: the same requests and token counts as from one process, each
    sent on the run's one schedule (constant 40 req/s: the last of 6 leaves 125 ms after the
    first, so the run lasts at least that), the results merged from both processes."""
    from pagebatch.cli import main

    out = tmp_path / "procs.json"
    rc = main(["bench", "serve", "--base-url", base, "--api-key", KEY, "--num-prompts", "6",
               "--input-len", "8", "--output-len", "5", "--range-ratio", "0.5",
               "--vocab-size", "256", "--rates", "40,inf", "--arrival", "constant",
               "--client-processes", "2", "--output", str(out)])
    assert rc == 0
    spec = DatasetSpec(num_prompts=6, input_len=8, output_len=5, range_ratio=0.5,
                       vocab_size=256, seed=0)
    sweep = json.loads(out.read_text())
    for i, run in enumerate(sweep["runs"]):
        check_run_schema(run)
        reqs = make_dataset(spec, variant=i)
        assert (run["completed"], run["failed"], run["client_processes"]) == (6, 0, 2)
        assert run["total_input_tokens"] == sum(r.prompt_len for r in reqs)
        assert run["total_output_tokens"] == sum(r.output_len for r in reqs)
        assert 0 < run["ttft"]["p50_ms"] <= run["e2el"]["p99_ms"] <= run["duration_s"] * 1e3
    assert sweep["runs"][0]["duration_s"] >= 5 / 40
