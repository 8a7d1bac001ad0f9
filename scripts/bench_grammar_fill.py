"""The per-token cost of a length-bounded JSON string in xgrammar (plugins/structured_output/
xgrammar_strings.py): for each bound, the mean and largest time of `fill_next_token_bitmask`
over the first tokens inside the string, with the rule the backend builds and, with
``--escapes``, with the alternation (a character or a short escape) that commit f55eeef used.

    OMP_NUM_THREADS=1 python scripts/bench_grammar_fill.py [--escapes] [--tokens 60]
Uses SmolLM2's tokenizer (the packaged model); CPU only.
"""

from __future__ import annotations

import argparse
import json
import time

BOUNDS = [{"maxLength": 5}, {"maxLength": 256}, {"minLength": 256}, {"minLength": 2048}]
ESCAPES = '(([^\\0-\\x1f\\"\\\\\\ud800-\\udfff]) | ("\\\\" [\\"\\\\/bfnrt]))'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--escapes", action="store_true")
    p.add_argument("--tokens", type=int, default=60)
    args = p.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagebatch.model_loader import resolve_model
    from pagebatch.plugins.structured_output import xgrammar_strings as xs

    if args.escapes:
        xs.JSON_CHARACTER = ESCAPES
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m").folder)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
    ma = tok.encode("Ma", add_special_tokens=False)[0]
    for bounds in BOUNDS:
        schema = {"type": "object", "required": ["t"], "additionalProperties": False,
                  "properties": {"t": {"type": "string", **bounds}}}
        grammar = xs.fix_bounded_strings(xgr.Grammar.from_json_schema(json.dumps(schema),
                                                                      any_whitespace=False))
        m = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
        mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
        for t in tok.encode('{"t": "', add_special_tokens=False):
            m.accept_token(t)
        times = []
        for _ in range(min(args.tokens, bounds.get("maxLength", 10**9) // 2 - 1)):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append((time.perf_counter() - t0) * 1e3)
            m.accept_token(ma)
        print(f"{json.dumps(bounds):<24} fill mean {sum(times) / len(times):8.3f} ms, "
              f"max {max(times):8.3f} ms ({len(times)} tokens)")


if __name__ == "__main__":
    main()
