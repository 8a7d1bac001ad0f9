"""Ranks and process groups of tensor and pipeline parallelism (Megatron-LM's layout, as vLLM).

``world_size = tensor_parallel_size * pipeline_parallel_size``. Global rank ``r`` is TP rank
``r % tp`` of pipeline stage ``r // tp``: the ranks of one stage are consecutive (one TP group,
meant for one host's fast links) and a stage's TP rank i sends its hidden states to TP rank i of
the next stage. Rank 0 is the driver: it runs inside the engine core, schedules, and runs the
first stage's TP rank 0 itself.

`ParallelContext` is what layers and models see (through ``ModelContext.parallel``): the ranks,
the TP process group, and the communication ops of core/distributed/comm.py. A single-rank
context (`ParallelContext.single()`) has no groups and every op is the identity.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from .comm import all_gather, all_reduce, recv_tensor, send_tensor

logger = logging.getLogger(__name__)

# the torchrun environment (torch.distributed's env:// rendezvous)
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@dataclass
class ParallelContext:
    """This rank's place in the TP x PP grid. ``world_group``: every rank (hidden-state sends,
    start-up agreement); ``tp_group``: the ranks of this rank's stage. Both carry the short
    ``distributed_timeout``; None on a single rank."""

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    tp_group: Any = None
    world_group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # config custom_all_reduce: row-parallel layers leave their all-reduce to the next RMSNorm
    # (core/layers/norm.py); `one_shot` is the fused kernel's all-reduce where it could be set
    # up (core/distributed/custom_allreduce.py; CUDA), else None (NCCL / gloo, then the norm)
    fuse_all_reduce_norm: bool = False
    one_shot: Any = None
    _pending_sends: list = field(default_factory=list, repr=False)

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls()

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank this stage receives hidden states from (first stage: none)."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        """Global rank this stage sends hidden states to (last stage: none)."""
        return self.rank + self.tp_size

    def stage_layers(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers of this rank's stage."""
        return stage_layer_range(num_layers, self.pp_rank, self.pp_size)

    # ---- communication (core/distributed/comm.py) ---------------------------------------------

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the TP group (in place); identity when tp_size == 1."""
        if self.tp_size == 1:
            return x
        return all_reduce(x, self.tp_group)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                            weight: torch.Tensor, eps: float):
        """(norm(all_reduce(x) + residual) * weight, all_reduce(x) + residual) in one kernel
        where the one-shot all-reduce takes ``x`` (CUDA, small batches); None elsewhere, and
        the caller all-reduces and normalizes."""
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot.all_reduce_add_rms_norm(x, residual, weight, eps)
        return None

    def tp_all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """TP ranks' ``x`` concatenated along ``dim`` in rank order; identity when tp_size == 1."""
        if self.tp_size == 1:
            return x
        return all_gather(x, self.tp_size, dim, self.tp_group)

    def send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Send a stage's output (hidden and residual, [T, H] each) to the next stage, without
        waiting for it to be received (the previous send is waited for first)."""
        self.send_payload(torch.cat([hidden, residual], dim=-1))

    def recv_hidden(self, num_tokens: int, hidden_size: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Receive the previous stage's (hidden, residual), [num_tokens, hidden_size] each."""
        buf = self.recv_payload(num_tokens, 2 * hidden_size, dtype)
        return buf[:, :hidden_size], buf[:, hidden_size:]

    def send_payload(self, payload: torch.Tensor) -> None:
        """Send a stage's output ``payload`` ([T, width], made contiguous) to the next stage,
        without waiting for it to be received; the previous send is waited for first (on
        CUDA: the stream waits, not the host). The tensor is kept alive until then."""
        self.wait_sends()
        payload = payload.contiguous()
        work = send_tensor(payload, self.next_rank, self.world_group)
        self._pending_sends.append((work, payload))

    def recv_payload(self, num_tokens: int, width: int, dtype: torch.dtype,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Receive the previous stage's output, [num_tokens, width] in ``dtype``, into ``out``
        (a contiguous tensor of that shape, e.g. a CUDA graph's static input) or a new one."""
        if out is None:
            out = torch.empty(num_tokens, width, dtype=dtype, device=self.device)
        elif tuple(out.shape) != (num_tokens, width) or not out.is_contiguous():
            raise ValueError(f"recv_payload: out {tuple(out.shape)} is not a contiguous "
                             f"[{num_tokens}, {width}] tensor")
        recv_tensor(out, self.prev_rank, self.world_group)
        return out

    def wait_sends(self) -> None:
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers split as evenly as possible, earlier stages taking the remainder's extra layer
    (the first stage also embeds, the last also computes the LM head: neither is favoured)."""
    if pp_size > num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp_size} exceeds the model's "
                          f"{num_layers} layers: every stage needs at least one layer")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def check_model_parallel(hf_config: Any, tp_size: int, pp_size: int) -> None:
    """Raise ConfigError unless a Llama-family config splits over ``tp_size`` x ``pp_size``:
    attention heads, the MLP width and (unless fewer than the ranks, then replicated) KV heads
    divide by tp_size; every stage gets a layer."""
    stage_layer_range(int(hf_config.num_hidden_layers), 0, pp_size)
    if getattr(hf_config, "num_attention_heads", None) is None:
        return  # not a Llama-shaped config: the model's layers check their own split
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = getattr(hf_config, "intermediate_size", None)
    if heads % tp_size:
        raise ConfigError(f"tensor_parallel_size={tp_size} does not divide the model's "
                          f"{heads} attention heads")
    if kv >= tp_size and kv % tp_size or kv < tp_size and tp_size % kv:
        raise ConfigError(f"tensor_parallel_size={tp_size} and the model's {kv} KV heads: one "
                          f"must divide the other (fewer KV heads than ranks are replicated)")
    if inter is not None and int(inter) % tp_size:
        raise ConfigError(f"tensor_parallel_size={tp_size} does not divide the model's "
                          f"intermediate_size={inter}")


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` -> nccl on cuda, gloo on cpu. Raises ConfigError for nccl without cuda."""
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ConfigError("distributed_backend='nccl' needs device: cuda; use gloo on cpu")
    return name


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world_size) when the torchrun environment is set (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE) with WORLD_SIZE > 1; None otherwise. Raises ConfigError when it is only partly
    set."""
    have = [v for v in TORCHRUN_VARS if os.environ.get(v)]
    if not have or (os.environ.get("WORLD_SIZE") in ("1", None) and "RANK" not in have):
        return None
    missing = [v for v in TORCHRUN_VARS if v not in have]
    if missing:
        raise ConfigError(f"the torchrun environment is incomplete: {', '.join(missing)} "
                          f"unset ({', '.join(have)} set)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return rank, world


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous of spawned workers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(backend: str, init_method: str, rank: int, tp_size: int, pp_size: int,
                     timeout_s: float, device: torch.device,
                     rendezvous_timeout_s: float) -> ParallelContext:
    """Join the default process group (waiting up to ``rendezvous_timeout_s`` for every rank:
    hosts may start minutes apart), then build the groups the engine uses, each with
    ``timeout_s`` on every collective (gloo's default would be 30 minutes): the world, and the
    TP group of each stage (every rank creates every group, in the same order, as
    torch.distributed requires). On CUDA, ``device`` must be this rank's GPU."""
    import torch.distributed as dist

    world = tp_size * pp_size
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=rendezvous_timeout_s), **kwargs)
    world_group = dist.new_group(list(range(world)), timeout=timeout)
    tp_group = world_group
    if pp_size > 1 and tp_size > 1:
        for stage in range(pp_size):
            g = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)),
                               timeout=timeout)
            if stage == rank // tp_size:
                tp_group = g
    return ParallelContext(rank, tp_size, pp_size, tp_group, world_group, device)


def destroy_distributed(timeout_s: float = 15.0) -> bool:
    """Destroy the default process group, giving up after ``timeout_s`` (a NCCL group can
    wait forever on a peer or on resources still held; the process's exit frees them).
    Returns whether it was destroyed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="pagebatch-destroy-pg", daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("destroying the process group did not finish within %.0f s; left to "
                       "the process exit", timeout_s)
        return False
    return True
