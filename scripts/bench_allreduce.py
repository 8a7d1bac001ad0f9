"""All-reduce latency on two GPUs (device kind nvidia-h200-x2): NCCL against torch's
symmetric-memory one-shot and two-shot all-reduce and pagebatch's Triton one-shot kernel
(core/kernels/allreduce.py), alone and fused with the residual add + RMSNorm that follows
(against NCCL then the norm kernel: what ``custom_all_reduce`` replaces), each captured 64 times
in one CUDA graph (as a TP=2 decode step on the Llama-3.1-8B shape has 64 all-reduces of
[tokens, 4096] bf16).

    python3 scripts/bench_allreduce.py [--tokens 1,8,64]

Prints microseconds per all-reduce and whether each result equals the exact sum. Symmetric
memory needs peer access between the GPUs; NVLink multicast stays off (the machine sets
TORCH_SYMM_MEM_DISABLE_MULTICAST=1), so the multimem variants are not tried."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, CALLS, REPLAYS = 4096, 64, 50


def timed_graph(fn, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Microseconds per call of ``fn(x)`` replayed from one graph of CALLS calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            out = fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            out = fn(x)
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS), out


def worker(rank: int, world: int, port: int, tokens: list[int], q) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    rows = []
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(max(tokens) * HIDDEN, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group.group_name)
        symm = buf
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        rows.append(("symm_mem rendezvous", 0, float("nan"), f"{type(e).__name__}: {e}"[:120]))
    from pagebatch.distributed.custom_allreduce import create_one_shot
    from pagebatch.kernels.norm import rms_norm

    ours = create_one_shot(group, HIDDEN, torch.bfloat16, torch.device("cuda", rank))
    if ours is None:
        rows.append(("triton one-shot", 0, float("nan"), "set-up failed (see the log)"))
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    for t in tokens:
        x = torch.full((t, HIDDEN), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        residual = torch.zeros_like(x)
        want = float(world * (world + 1) // 2)

        def nccl(x):
            y = x.clone()  # in place would sum the sums replay after replay
            dist.all_reduce(y, group=group)
            return y

        variants = [("nccl", nccl)]
        if symm is not None:
            n = t * HIDDEN

            def one_shot(x, n=n):
                symm[:n].copy_(x.view(-1))
                return torch.ops.symm_mem.one_shot_all_reduce(symm[:n], "sum", group.group_name)

            def two_shot(x, n=n):
                symm[:n].copy_(x.view(-1))
                torch.ops.symm_mem.two_shot_all_reduce_(symm[:n], "sum", group.group_name)
                return symm[:n].clone()

            variants += [("symm one_shot", one_shot), ("symm two_shot", two_shot)]
        if ours is not None and ours.fits(x):
            variants.append(("triton one-shot", ours.all_reduce))
        fused = []  # (name, fn): all-reduce + residual add + RMSNorm, the sum's residual out

        def nccl_norm(x):
            return rms_norm(nccl(x), weight, 1e-6, residual)[1]

        fused.append(("nccl + norm", nccl_norm))
        if ours is not None and ours.fits(x):
            fused.append(("triton fused", lambda x: ours.all_reduce_add_rms_norm(
                x, residual, weight, 1e-6)[1]))
        variants += fused
        for name, fn in variants:
            try:
                us, out = timed_graph(fn, x)
                ok = bool((out.float() == want).all())
                rows.append((name, t, us, "ok" if ok else "WRONG SUM"))
            except Exception as e:  # noqa: BLE001
                rows.append((name, t, float("nan"), f"{type(e).__name__}: {e}"[:120]))
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,64")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    world = 2
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, world, port, tokens, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=300)
    for p in procs:
        p.join(60)
    print(f"\n{'all-reduce':<16}{'tokens':>7}{'bytes':>10}{'us/call':>10}  result")
    for name, t, us, res in rows:
        print(f"{name:<16}{t:>7}{t * HIDDEN * 2:>10}{us:>10.2f}  {res}")


if __name__ == "__main__":
    main()
