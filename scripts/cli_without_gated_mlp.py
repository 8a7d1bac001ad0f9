#!/usr/bin/env python3
"""``pagebatch`` with the W4A16 quant methods' gated gate/up GEMV turned off (the MLP runs the
product, then the SiLU-and-mul kernel), for measuring what the fusion is worth end to end
(docs/benchmarks.md, session 6, call 4):

  python3 scripts/cli_without_gated_mlp.py bench latency examples/configs/llama-3.1-8b \\
      --load-format dummy --max-model-len 4096 --quantization awq --input-len 128 --output-len 256
"""

import runpy
import sys

from pagebatch.quant.wna16 import WNA16Method

WNA16Method.apply_silu_mul = lambda self, layer, x: None  # decline: the unfused path
sys.argv = ["pagebatch", *sys.argv[1:]]
runpy.run_module("pagebatch.cli", run_name="__main__")
