"""How long the structured output backend takes to compile a wide JSON schema (an object of N
integer properties) against a model's tokenizer: the figures docs/serving.md and
docs/configuration.md quote for `structured_outputs_compile_timeout`.

    python scripts/bench_grammar_compile.py [--model smollm2-135m] 100 1000 3000
Prints one row per property count: schema bytes, compile seconds.
"""

from __future__ import annotations

import argparse
import time

from pagebatch.model_loader import resolve_model
from pagebatch.plugins.structured_output.xgrammar_backend import XGrammarBackend
from pagebatch.structured_output import StructuredOutputsParams
from pagebatch.tokenizer import load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("counts", nargs="+", type=int)
    a = p.parse_args()
    tok = load_tokenizer(resolve_model(a.model).folder)
    backend = XGrammarBackend(tok, len(tok), [])
    print(f"{'properties':>10} {'schema bytes':>12} {'compile s':>10}")
    for n in a.counts:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
        c = StructuredOutputsParams(json=schema).constraint()
        t = time.perf_counter()
        backend.compile(c)
        print(f"{n:>10} {len(c.spec):>12} {time.perf_counter() - t:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
