"""The cost of one full garbage collection in a `pagebatch serve` frontend process, before and
after `gc.freeze()` (plugins/frontends/http/server.py freezes start-up's objects before uvicorn
starts). Imports the HTTP server module, loads the default model's tokenizer (the packaged
SmolLM2 GGUF, converted once into the user cache), then times `gc.collect()`:

    python3 scripts/frontend_gc_cost.py [--repeats 3]

Prints the live object count and each collection's time in ms. CPU only; no model weights.
"""

from __future__ import annotations

import argparse
import gc
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import pagebatch.plugins.frontends.http.server  # noqa: F401  (what `serve` imports)
    from pagebatch.model_loader import resolve_model
    from pagebatch.tokenizer import load_tokenizer

    load_tokenizer(resolve_model("smollm2-135m").folder)
    print(f"live objects: {len(gc.get_objects()):,}")

    def timed() -> float:
        t = time.perf_counter()
        gc.collect()
        return (time.perf_counter() - t) * 1e3

    print("full collection ms:", " / ".join(f"{timed():.1f}" for _ in range(args.repeats)))
    gc.freeze()
    print("after gc.freeze() ms:", " / ".join(f"{timed():.3f}" for _ in range(args.repeats)))


if __name__ == "__main__":
    main()
