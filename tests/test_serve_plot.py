"""serve_plot.plot_sweeps: several engines' sweeps in one PNG (no server needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from pagebatch.bench.serve_plot import plot_sweeps  # noqa: E402


def _run(rate, tput, ttft):
    lat = {"median_ms": ttft, "p50_ms": ttft, "p99_ms": 2 * ttft}
    return {"request_rate": rate, "request_throughput": tput, "ttft": lat, "itl": dict(lat),
            "tpot": dict(lat)}


def test_two_sweeps_in_one_png_and_legend(tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    png = tmp_path / "two.png"
    plot_sweeps({"pagebatch": [_run(8.0, 7.4, 30.0), _run("inf", 45.0, 900.0)],
                 "vllm": [_run(8.0, 7.3, 31.0)]}, str(png), "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # per engine: TTFT, ITL, TPOT at median and p99
    assert sorted(labels) == sorted(f"{e} {m} {k}" for e in ("pagebatch", "vllm")
                                    for m in ("TTFT", "ITL", "TPOT") for k in ("median", "p99"))
    with pytest.raises(ValueError, match="no runs"):
        plot_sweeps({"vllm": []}, str(png))
