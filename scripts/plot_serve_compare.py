"""Side-by-side plot of `pagebatch bench serve --rates ... --output` results of several engines:
TTFT and ITL (median and p99, ms) against the requested rate, one line per engine.

    python3 scripts/plot_serve_compare.py OUT.png pagebatch=a.json vllm=b.json
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, pairs = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, path in pairs:
        runs = json.load(open(path))["runs"]
        labels = [str(r["request_rate"]) for r in runs]
        x = range(len(runs))
        for ax, metric in zip(axes[:2], ("ttft", "itl")):
            for key, style in (("median_ms", "o-"), ("p99_ms", "s--")):
                ax.plot(x, [r[metric][key] for r in runs], style, label=f"{name} {key[:-3]}")
            ax.set_xticks(list(x), labels)
            ax.set_yscale("log")
            ax.set_title(f"{metric.upper()} (ms)")
            ax.set_xlabel("request rate (req/s)")
        axes[2].plot(x, [r["output_token_throughput"] for r in runs], "o-", label=name)
        axes[2].set_xticks(list(x), labels)
    axes[2].set_title("output tok/s")
    axes[2].set_xlabel("request rate (req/s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
