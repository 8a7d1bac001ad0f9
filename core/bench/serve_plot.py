"""``pagebatch bench serve --plot FILE.png``: latency against load, one point per rate of a
``--rates`` sweep (matplotlib, imported only here; ``pip install 'pagebatch[plot]'``).

Left: TTFT, right: ITL and TPOT, each at its median and its highest ``--percentiles`` value in
milliseconds, against the measured request throughput (req/s; a rate of ``inf`` has no x of
its own otherwise). Each point is labelled with its requested rate.
"""

from __future__ import annotations

from typing import Any


def plot_sweep(runs: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Write the PNG of ``runs`` (serve.py's results, one per rate) to ``path``. Raises
    ImportError with the install line when matplotlib is missing."""
    plot_sweeps({"": runs}, path, title)


def plot_sweeps(sweeps: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
    """One PNG of several sweeps side by side (e.g. ``{"pagebatch": runs, "vllm": runs}``, each
    serve.py's results, one per rate; the label leads each line's legend entry), written to
    ``path``. Raises ImportError with the install line when matplotlib is missing, ValueError
    when no sweep has a run."""
    if not any(sweeps.values()):
        raise ValueError("plot_sweeps: no runs to plot")
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'pagebatch[plot]'") from e
    matplotlib.use("Agg")  # no display; a file only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    # one colour per sweep; the line style tells median from the top percentile, the marker
    # ITL from TPOT
    for n, (label, runs) in enumerate(sweeps.items()):
        if not runs:
            continue
        top = [k for k in runs[0]["ttft"] if k.startswith("p")][-1:] or ["median_ms"]
        x = [r["request_throughput"] for r in runs]
        for ax, names in ((axes[0], ("ttft",)), (axes[1], ("itl", "tpot"))):
            for name in names:
                for k, line in (("median_ms", "-"), (top[0], "--")):
                    ax.plot(x, [r[name][k] for r in runs], "^" if name == "tpot" else "o",
                            linestyle=line, color=f"C{n % 10}",
                            label=f"{label} {name.upper()} {k[:-3]}".strip())
            for xi, r in zip(x, runs):
                ax.annotate(f"{r['request_rate']}/s", (xi, r[names[0]][top[0]]),
                            textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax in axes:
        ax.set_xlabel("request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("time to first token")
    axes[1].set_title("inter-token latency / time per output token")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
