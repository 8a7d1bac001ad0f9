"""Fused Triton kernels for the layers in core/layers/, used there on CUDA only (the CPU keeps
the plain torch path). Each module imports Triton, so import one only where it will run:
``TRITON_INTERPRET=1`` (tests on the CPU) is read when its kernels are decorated, at import.

- norm.py: RMSNorm with the residual add fused in (one read of x and residual, one write each).
- activation.py: SiLU-and-mul (SwiGLU's gate).
- rotary.py: rotary embedding of q and k in one launch, from the layer's cos/sin table.

Each rounds where its torch version in core/layers/ rounds, so the two agree to fp32 rounding
(e.g. ``x + residual`` is rounded to x's dtype before it is normalised).
"""
