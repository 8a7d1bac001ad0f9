"""The quantizer behind ``pagebatch quantize``: AWQ, GPTQ and round-to-nearest on calibration
text, layer by layer, written as AutoAWQ / AutoGPTQ / int8 checkpoints.

rtn.py (grid and neutral form), awq.py, gptq.py, decoder.py (a decoder layer's linears and
order), runner.py (the layer-by-layer driver), writer.py (the checkpoint folder).
"""

from .runner import QuantizeSpec, quantize

__all__ = ["QuantizeSpec", "quantize"]
