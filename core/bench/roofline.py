"""Roofline floors of an engine run (scripts/roofline.py), worked out from the model's sizes
and the steps as scheduled, never from a trace: the time no kernel could beat on a GPU of
``peak_flops`` (FLOP/s) and ``peak_bw`` (bytes/s); the defaults are the H200's dense bf16
tensor-core peak (791 TFLOP/s without sparsity) and its HBM3e bandwidth (4.28 TB/s).

Each step's floor is ``max(FLOPs / peak_flops, bytes / peak_bw)`` per kind of work (one kernel
cannot be faster than its own roofline), summed over the steps of a category:

- GEMMs: FLOPs ``2 * linear params * tokens`` (every row of the step, decode rows of a mixed
  step included) plus ``2 * hidden * vocab`` per sampled row (the LM head runs on those rows
  only); bytes: every linear weight once, the LM head's when a row samples. Activations' bytes
  are left out (small beside the weights at decode sizes, beside the FLOPs at prefill sizes).
- attention: FLOPs ``4 * heads * head_dim * q * (ctx + (q + 1) / 2)`` per layer for a request
  computing ``q`` tokens on top of ``ctx`` cached ones (causal QK^T and PV; ``ctx + 1`` for a
  decode row); bytes: K and V of the ``ctx + q`` tokens read once and of the ``q`` new ones
  written once, per layer and KV head, plus the queries read and outputs written.
- other kernels: an estimate of the elementwise traffic, read + written once, per token and
  layer: two residual-add RMSNorms (4 x hidden each), SiLU-and-mul (3 x intermediate), rotary
  on Q and K (2 x (heads + kv_heads) x head_dim); the final norm; the sampler reading each
  sampled row's fp32 logits. A fused kernel could do better: this floor is not a hard one.

A step "has prefill" when it computes more tokens than it has requests (some request computes
more than one token); its GEMMs and attention are the prefill categories, with the decode rows
that ride along; every other step is a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

H200_PEAK_FLOPS = 791e12  # dense bf16 FLOP/s
H200_PEAK_BW = 4.28e12  # HBM bytes/s

GEMM_PREFILL, GEMM_DECODE = "prefill GEMMs", "decode GEMMs"
ATTN_PREFILL, ATTN_DECODE = "attention, prefill steps", "attention, decode steps"
OTHER, HOST = "other kernels", "host/idle"
CATEGORIES = (GEMM_PREFILL, GEMM_DECODE, ATTN_PREFILL, ATTN_DECODE, OTHER, HOST)


@dataclass(frozen=True)
class ModelShape:
    """A dense Llama-family decoder's sizes. ``weight_bytes``: bytes per linear weight element;
    ``kv_bytes``: per K or V cache element; ``act_bytes``: per activation element."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    act_bytes: float = 2.0

    @classmethod
    def from_hf_config(cls, c: Any, weight_bytes: float = 2.0, kv_bytes: float = 2.0,
                       act_bytes: float = 2.0) -> "ModelShape":
        """From a Hugging Face config (``hidden_size``, ``intermediate_size``,
        ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
        when given, ``vocab_size``)."""
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or int(c.hidden_size) // heads
        return cls(int(c.hidden_size), int(c.intermediate_size), int(c.num_hidden_layers),
                   heads, int(getattr(c, "num_key_value_heads", None) or heads), int(head_dim),
                   int(c.vocab_size), weight_bytes, kv_bytes, act_bytes)

    @property
    def linear_params(self) -> int:
        """Weight elements one token multiplies in the decoder layers: q, k, v, o and the gated
        MLP (gate, up, down), all layers; the LM head not included."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (2 * h * q + 2 * h * kv + 3 * h * self.intermediate)

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab


@dataclass(frozen=True)
class StepShape:
    """One engine step as scheduled. ``rows``: per request (q, ctx): q tokens computed this step
    on top of ctx already in its KV cache; ``num_sampled``: the rows whose logits are taken."""

    rows: tuple[tuple[int, int], ...]
    num_sampled: int

    @classmethod
    def from_scheduler_output(cls, so: Any) -> "StepShape":
        """From a `SchedulerOutput` (core/scheduler.py)."""
        return cls(tuple((len(sr.token_ids), sr.start_pos) for sr in so.scheduled),
                   sum(1 for sr in so.scheduled if sr.sample))

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.rows)

    @property
    def has_prefill(self) -> bool:
        return self.num_tokens > len(self.rows)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the requests computing more than one token (prompt chunks)."""
        return sum(q for q, _ in self.rows if q > 1)


@dataclass(frozen=True)
class Floor:
    """A floor in seconds and which roof set it: ``bound`` ``"FLOPs"`` or ``"bytes"``."""

    seconds: float
    bound: str


def _roof(flops: float, nbytes: float, peak_flops: float, peak_bw: float) -> Floor:
    t_c, t_m = flops / peak_flops, nbytes / peak_bw
    return Floor(t_c, "FLOPs") if t_c >= t_m else Floor(t_m, "bytes")


def gemm_work(m: ModelShape, s: StepShape) -> tuple[float, float]:
    """(FLOPs, weight bytes) of the step's linear layers and LM head."""
    flops = 2.0 * (m.linear_params * s.num_tokens + m.lm_head_params * s.num_sampled)
    params = m.linear_params + (m.lm_head_params if s.num_sampled else 0)
    return flops, params * m.weight_bytes


def attention_work(m: ModelShape, s: StepShape) -> tuple[float, float]:
    """(FLOPs, bytes) of the step's attention, all layers (module docstring)."""
    flops = 4.0 * m.heads * m.head_dim * m.layers * sum(q * (c + (q + 1) / 2) for q, c in s.rows)
    kv = 2 * m.kv_heads * m.head_dim * m.layers * m.kv_bytes  # K and V, per token
    qo = 2 * m.heads * m.head_dim * m.layers * m.act_bytes  # queries in, outputs out
    nbytes = sum(kv * (c + 2 * q) + qo * q for q, c in s.rows)
    return flops, nbytes


def other_bytes(m: ModelShape, s: StepShape) -> float:
    """Estimated elementwise bytes of the step (module docstring)."""
    per_layer = 8 * m.hidden + 3 * m.intermediate + 2 * (m.heads + m.kv_heads) * m.head_dim
    per_token = (m.layers * per_layer + 4 * m.hidden) * m.act_bytes
    return per_token * s.num_tokens + 4.0 * m.vocab * s.num_sampled


def step_floors(m: ModelShape, s: StepShape, peak_flops: float = H200_PEAK_FLOPS,
                peak_bw: float = H200_PEAK_BW) -> dict[str, Floor]:
    """The step's floors by category (CATEGORIES less host/idle and the other phase's two)."""
    gemm = _roof(*gemm_work(m, s), peak_flops, peak_bw)
    attn = _roof(*attention_work(m, s), peak_flops, peak_bw)
    g, a = (GEMM_PREFILL, ATTN_PREFILL) if s.has_prefill else (GEMM_DECODE, ATTN_DECODE)
    return {g: gemm, a: attn, OTHER: Floor(other_bytes(m, s) / peak_bw, "bytes")}


def run_floors(m: ModelShape, steps: Iterable[StepShape], peak_flops: float = H200_PEAK_FLOPS,
               peak_bw: float = H200_PEAK_BW) -> dict[str, dict[str, Any]]:
    """Category -> {"seconds": floor summed over the steps, "FLOPs" / "bytes": how many steps
    each roof bounded}; host/idle's floor is 0."""
    out = {c: {"seconds": 0.0, "FLOPs": 0, "bytes": 0} for c in CATEGORIES}
    for s in steps:
        for cat, f in step_floors(m, s, peak_flops, peak_bw).items():
            out[cat]["seconds"] += f.seconds
            out[cat][f.bound] += 1
    return out


def step_totals(steps: Iterable[StepShape]) -> dict[str, int]:
    """Counts for the report: steps with prefill / decode-only, prefill tokens, decode rows in
    each kind of step, sampled rows."""
    t = dict(prefill_steps=0, decode_steps=0, prefill_tokens=0, decode_rows_in_prefill_steps=0,
             decode_rows_in_decode_steps=0, sampled_rows=0)
    for s in steps:
        ones = sum(1 for q, _ in s.rows if q == 1)
        if s.has_prefill:
            t["prefill_steps"] += 1
            t["decode_rows_in_prefill_steps"] += ones
        else:
            t["decode_steps"] += 1
            t["decode_rows_in_decode_steps"] += ones
        t["prefill_tokens"] += s.num_prefill_tokens
        t["sampled_rows"] += s.num_sampled
    return t


def table(measured: dict[str, float], floors: dict[str, dict[str, Any]], wall_s: float,
          output_tokens: int) -> str:
    """The report: category | measured s | % of wall | floor s | floor basis | measured/floor,
    a total row (floors summed: a lower bound for kernels run one after another) and the
    achieved output tok/s beside the floor's. ``measured``: `kernel_split.breakdown`'s."""
    lines = [f"{'category':<26}{'measured s':>11}{'% wall':>8}{'floor s':>10}  "
             f"{'floor basis (roof: steps)':<27}{'meas/floor':>10}"]
    for c in CATEGORIES:
        f = floors[c]
        basis = ("-" if c == HOST else "elementwise bytes, est." if c == OTHER
                 else f"FLOPs {f['FLOPs']}, bytes {f['bytes']}")
        ratio = f"{measured[c] / f['seconds']:.2f}x" if f["seconds"] > 0 else "-"
        lines.append(f"{c:<26}{measured[c]:>11.3f}{measured[c] / wall_s:>8.1%}"
                     f"{f['seconds']:>10.3f}  {basis:<27}{ratio:>10}")
    floor, total = sum(f["seconds"] for f in floors.values()), sum(measured.values())
    lines.append(f"{'total':<26}{total:>11.3f}{total / wall_s:>8.1%}{floor:>10.3f}  "
                 f"{'sum of the floors':<27}{total / floor if floor else 0:>9.2f}x")
    achieved, best = output_tokens / wall_s, output_tokens / floor if floor else 0.0
    lines.append(f"output tok/s: achieved {achieved:,.0f}, floor {best:,.0f} "
                 f"(achieved {achieved / best if best else 0:.1%} of the floor's)")
    return "\n".join(lines)
