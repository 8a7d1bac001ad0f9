"""Triton kernels of the quant methods (imported only on CUDA, or under TRITON_INTERPRET=1), and
their tuned tables in configs/ (``<kernel>_<GPU>.json``, read through core/kernels/tuned.py).

A kernel lives with its owner: the ones only quant methods use are here; shared primitives (the
split-K reduction, PDL, the tuned-table lookup, ``num_sms``) stay in core/kernels/.
"""

from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"  # the packaged tables of these kernels
