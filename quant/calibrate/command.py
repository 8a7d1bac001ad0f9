"""``pagebatch quantize MODEL OUT_DIR --method awq|gptq|int8 ...``: the quant package's CLI
subcommand, registered through the ``register_commands`` hook (entry point ``quantize``), so that
the core's CLI imports no built-in plugin."""

from __future__ import annotations

import argparse

from pagebatch.hookspecs import hookimpl

from .runner import QuantizeSpec, quantize


class QuantizeCommand:
    help = ("write an AWQ / GPTQ / int8 checkpoint from calibration text (AutoAWQ / AutoGPTQ "
            "formats)")

    def add_arguments(self, q: argparse.ArgumentParser) -> None:
        D = QuantizeSpec  # the defaults
        q.add_argument("model", metavar="MODEL", help="model name or Hugging Face folder")
        q.add_argument("out_dir", metavar="OUT_DIR", help="folder to write")
        q.add_argument("--method", required=True, choices=["awq", "gptq", "int8"])
        q.add_argument("--bits", type=int, default=D.bits, help="4 (awq), 4 or 8 (gptq)")
        q.add_argument("--group-size", type=int, default=D.group_size,
                       help="input columns per group; -1: one group per row")
        q.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                       help="symmetric grid (default: gptq yes, awq no, i.e. zero points)")
        q.add_argument("--act-order", action="store_true", help="GPTQ desc_act (writes g_idx)")
        q.add_argument("--rtn", action="store_true", help="round to nearest, no calibration")
        q.add_argument("--clip", action=argparse.BooleanOptionalAction, default=True,
                       help="AWQ's clipping search")
        q.add_argument("--damp-percent", type=float, default=D.damp_percent,
                       help="GPTQ Hessian damping")
        q.add_argument("--calib-file",
                       help="calibration text (default: the shipped English text)")
        q.add_argument("--num-samples", type=int, default=D.num_samples,
                       help="calibration windows")
        q.add_argument("--seq-len", type=int, default=D.seq_len,
                       help="tokens per calibration window")
        q.add_argument("--seed", type=int, default=D.seed, help="seed of the window offsets")
        q.add_argument("--lm-head", action="store_true",
                       help="gptq: quantize the LM head too (GPTQModel's lm_head: true)")
        q.add_argument("--device", default="cpu",
                       help="torch device for the calibration forward")

    def run(self, args: argparse.Namespace) -> int:
        """Quantize ``args.model`` into ``args.out_dir`` and print the folder; raises
        ConfigError (exit status 2) for a spec the model cannot take."""
        spec = QuantizeSpec(method=args.method, bits=args.bits, group_size=args.group_size,
                            sym=args.sym, act_order=args.act_order, rtn=args.rtn,
                            clip=args.clip, damp_percent=args.damp_percent,
                            calib_file=args.calib_file, num_samples=args.num_samples,
                            seq_len=args.seq_len, seed=args.seed, lm_head=args.lm_head)
        out = quantize(args.model, args.out_dir, spec, device=args.device)
        print(out, flush=True)
        return 0


@hookimpl
def register_commands(register):
    register("quantize", QuantizeCommand())
