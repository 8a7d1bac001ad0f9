"""The cost of structured output on decode (issue 24): the same batch of requests decoded with
and without a JSON schema on every request, one engine, output tokens per second of each.

The schema is an object with one string field whose ``minLength`` exceeds the output length
(in characters), so a constrained request runs its full ``--output-len`` tokens like an
unconstrained one (with ``ignore_eos``) and the two runs decode the same number of tokens: the
difference is the matcher advance, the bitmask and the lost overlap. The model folder needs a
tokenizer (the backend compiles against it); dummy weights are fine.

    python3 scripts/bench_structured.py MODEL_DIR --load-format dummy --batch-sizes 1,64
Prints one row per batch size: tok/s unconstrained, tok/s constrained, their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pagebatch import LLM, SamplingParams


def schema(output_len: int) -> dict:
    return {"type": "object", "required": ["text"], "additionalProperties": False,
            "properties": {"text": {"type": "string", "minLength": 8 * output_len}}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--json", default=None, help="write the rows as JSON")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              max_num_seqs=max(sizes))
    vocab = len(llm.get_tokenizer())
    rng = random.Random(0)
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    so = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                        structured_outputs={"json": schema(args.output_len)})

    def run(n: int, sp: SamplingParams) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
                   for _ in range(n)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    rows = []
    for n in sizes:
        run(n, plain), run(n, so)  # warm-up: kernels, graphs, the schema's compilation
        res = {}
        for name, sp in (("plain", plain), ("json_schema", so)):
            dt, toks = min(run(n, sp) for _ in range(2))
            res[name] = (toks / dt, toks)
        rows.append({"batch": n, "plain_tok_s": res["plain"][0], "plain_tokens": res["plain"][1],
                     "json_tok_s": res["json_schema"][0], "json_tokens": res["json_schema"][1],
                     "ratio": res["json_schema"][0] / res["plain"][0]})
    print(f"{'batch':>6}{'plain tok/s':>14}{'json tok/s':>13}{'json/plain':>12}{'tokens':>14}")
    for r in rows:
        print(f"{r['batch']:>6}{r['plain_tok_s']:>14.1f}{r['json_tok_s']:>13.1f}"
              f"{r['ratio']:>12.3f}{r['plain_tokens']:>7}/{r['json_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
