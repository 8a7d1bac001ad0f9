"""Several `pagebatch bench serve --output` sweeps in one latency-against-load PNG, one set of
lines per engine (core/bench/serve_plot.py), e.g. `pagebatch serve` beside `vllm serve`:

    python3 scripts/plot_serve.py -o docs/benchmarks/h100-s42-serve.png \\
        pagebatch=docs/benchmarks/h100-s42-serve-pagebatch.json \\
        vllm=docs/benchmarks/h100-s42-serve-vllm.json
"""

from __future__ import annotations

import argparse
import json

from pagebatch.bench.serve_plot import plot_sweeps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="+", metavar="LABEL=JSON")
    p.add_argument("-o", "--output", required=True, metavar="PNG")
    p.add_argument("--title", default="")
    a = p.parse_args()
    sweeps = {}
    for arg in a.sweeps:
        label, sep, path = arg.partition("=")
        if not sep:
            p.error(f"expected LABEL=JSON, got {arg!r}")
        with open(path) as f:
            sweeps[label] = json.load(f)["runs"]
    plot_sweeps(sweeps, a.output, a.title)


if __name__ == "__main__":
    main()
