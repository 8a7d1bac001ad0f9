"""`ModelRunner`: builds the model from plugins, owns the paged KV cache tensors, turns a
`SchedulerOutput` into one flattened batch, runs the model and samples.

Per step the batch is: input ids and positions [T], slot mapping [T], query start locations
[B+1], sequence lengths [B], block tables [B, W] and the rows whose logits are sampled (plus, for
requests that ask for prompt log-probs, their prompt rows). They are kept in a persistent
`InputBatch` (core/input_batch.py) and reach the device in one pinned copy; decode-only steps
replay CUDA graphs (core/cuda_graphs.py); `execute_async` launches a step without waiting for
it, `collect` reads its results back (core/step_results.py).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .attention import AttentionMetadata, resolve_kv_cache_dtype
from .cpu_malloc import tune_cpu_malloc
from .config import EngineConfig
from .cuda_graphs import CUDAGraphs, capture_sizes
from .errors import CacheTooSmallError, ConfigError
from .kv_hybrid import KVCacheGroups
from .kv_window import max_blocks_held
from .input_batch import InputBatch
from .distributed.parallel_state import ParallelContext
from .layers.attention import Attention
from .layers.context import ModelContext
from .layers.dense import GEMV_MAX_M
from .layers.linear import LinearBase
from .layers.vocab import LMHead
from .model import PipelineStageLM
from .model_loader import (ModelSource, architecture, iter_safetensors, lm_head_quant,
                           select_quantization)
from .model_setup import ModelSetup
from .penalties import PenaltyState
from .piecewise_graphs import PiecewiseGraphs
from .registry import Registry
from .sampler import Sampler, apply_token_bitmask, row_argmax
from .sampling_inputs import sampling_batch
from .scheduler import SchedulerOutput
from .step_layout import PAD_SLOT
from .step_warmup import warm_up_step_variants
from .structured_output import StructuredOutputBatch
from .step_results import LaunchedStep, RunnerOutput, collect, prompt_logprobs, start_copy_back

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 4 * 2**30

__all__ = ["ModelRunner", "RunnerOutput"]


@dataclass
class PendingStep:
    """A step whose forward is launched and not yet sampled (`ModelRunner.launch_forward`):
    its prepared inputs, their device views, the hidden states [T, hidden] (a CUDA graph's
    static output when ``graph`` is its bucket). ``inp`` None: nothing to sample (an empty step,
    or a pipeline stage before the last)."""

    inp: Any
    views: dict[str, torch.Tensor] | None = None
    sampling_views: dict[str, torch.Tensor] | None = None
    hidden: torch.Tensor | None = None
    graph: int | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, setup: ModelSetup, registry: Registry,
                 parallel: ParallelContext | None = None):
        """``setup``: the resolved model, device, dtype and limits (core/model_setup.py).
        ``parallel``: this rank's place in tensor/pipeline parallelism (core/distributed/);
        None for a single rank. Its model holds this rank's part of the weights and KV heads,
        and of the layers of its pipeline stage."""
        self.config = config
        self.setup = setup
        hf_config, source = setup.hf_config, setup.source
        max_model_len = setup.max_model_len
        max_num_batched_tokens = setup.max_num_batched_tokens
        self.parallel = parallel or ParallelContext.single()
        self.device = torch.device(setup.device_type)
        if self.device.type == "cuda" and self.parallel.world_size > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU
        if self.device.type == "cpu":
            tune_cpu_malloc()  # reuse freed activation memory (core/cpu_malloc.py)
        self.dtype = setup.dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        # default: Triton kernels on CUDA, plain torch elsewhere
        backend_name = config.attention_backend or (
            "triton" if self.device.type == "cuda" else "torch_ref")
        self.attn_backend = registry.attention_backend(backend_name)()
        reason = self.attn_backend.supports(self.device, self.dtype)
        if reason:
            raise ConfigError(f"attention_backend={backend_name!r} cannot run here: {reason}")
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        reason = self.attn_backend.supports_kv_cache_dtype(self.device, self.dtype,
                                                           self.kv_cache_dtype)
        if reason:
            raise ConfigError(f"kv_cache_dtype={config.kv_cache_dtype!r} with "
                              f"attention_backend={backend_name!r}: {reason}")
        quant_name, hf_quant = select_quantization(config.quantization, hf_config,
                                                   source.folder)
        quant = registry.quant_method(quant_name)(config, hf_quant)
        if config.custom_all_reduce and self.parallel.tp_size > 1:
            self._set_up_fused_all_reduce(int(hf_config.hidden_size))
        ctx = ModelContext(self.dtype, self.device, quant, self.attn_backend, max_model_len,
                           self.parallel, lm_head_quant(config, quant))
        model_cls = registry.model_class(architecture(hf_config))
        self.model = model_cls(hf_config, ctx)
        # a pipeline stage whose model is a PipelineStageLM (core/model.py): the runner moves
        # the hidden states between stages itself (around the CUDA graphs of decode steps)
        self._stage_io = self.parallel.pp_size > 1 and isinstance(self.model, PipelineStageLM)
        self.vocab_size = int(hf_config.vocab_size)
        self._load_weights(source)
        self.model.eval()
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.penalties = PenaltyState(self.vocab_size, self.device)
        max_blocks = -(-max_model_len // self.block_size)
        groups = self.setup.kv_groups
        self.input_batch = InputBatch(config.max_num_seqs, max_blocks, self.block_size,
                                      max_num_batched_tokens,
                                      pin_memory=self.device.type == "cuda",
                                      vocab_size=self.vocab_size,
                                      num_kv_groups=groups.num_groups if groups else 1)
        if groups is not None:
            self._assign_kv_groups(groups)
        # the device buffer each step's inputs are copied into (CUDA graphs read it too)
        self._step_buf = torch.zeros(self.input_batch.capacity, dtype=torch.int32,
                                     device=self.device)
        self.graphs: CUDAGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill tokens
        self._pp_in: torch.Tensor | None = None  # a pipeline stage's graph input [seqs, 2H]
        # the last launched step's sampled ids [n] int64 on the device, and request id -> row
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

    def _assign_kv_groups(self, groups: KVCacheGroups) -> None:
        """A hybrid model (core/kv_hybrid.py): each attention layer's KV cache group. Raises
        RuntimeError when the model's attention layers (in module order) do not attend as
        its ``sliding_windows`` says."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        want = [groups.windows[k] for k in groups.layer_group]
        have = [a.sliding_window for a in layers]
        if have != want:
            raise RuntimeError(f"the model's attention layers have windows {have}, its "
                               f"sliding_windows() says {want}: cannot group its KV cache")
        for attn, k in zip(layers, groups.layer_group):
            attn.kv_group = k

    def _set_up_fused_all_reduce(self, hidden: int) -> None:
        """``custom_all_reduce``: the model's row-parallel layers leave their all-reduce to the
        RMSNorm after them; on CUDA through the one-shot kernel (core/kernels/allreduce.py)
        where symmetric memory can be set up (collective over the TP group)."""
        from .distributed.custom_allreduce import create_one_shot

        par = self.parallel
        par.fuse_all_reduce_norm = True
        par.one_shot = create_one_shot(par.tp_group, hidden, self.dtype, self.device)
        how = (f"the one-shot kernel up to {par.one_shot.max_rows} tokens"
               if par.one_shot is not None else "an all-reduce, then the norm")
        logger.info("custom_all_reduce: row-parallel all-reduces fused with the next RMSNorm "
                    "(%s)", how)

    def _load_weights(self, source: ModelSource) -> None:
        if self.config.load_format == "dummy":
            # drawn on the model's device: an 8B model's weights in seconds, not minutes
            g = torch.Generator(device=self.device).manual_seed(self.config.seed)
            for name, p in self.model.named_parameters():
                if name.endswith("norm.weight"):
                    p.data.fill_(1.0)
                elif p.dtype.is_floating_point:
                    p.data.normal_(0.0, 0.02, generator=g)
            for mod in self.model.modules():
                if isinstance(mod, LinearBase):  # quantized formats draw their own
                    mod.quant_method.load_dummy_weights(mod, g)
                    mod.quant_method.process_weights_after_loading(mod)
                elif isinstance(mod, LMHead):
                    mod.process_weights_after_loading()
            return
        with torch.no_grad():
            self.model.load_weights(iter_safetensors(source.folder, self.dtype))

    # ---- KV cache -----------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = self.kv_cache_dtype.itemsize
        per_layer = np.prod(self.attn_backend.kv_cache_shape(1, self.block_size, m.num_kv_heads,
                                                            m.head_dim))
        groups = self.setup.kv_groups  # a hybrid model: a block id spans one group's layers
        return int(per_layer) * elem * (groups.num_slots if groups else m.num_layers)

    def determine_num_blocks(self) -> int:
        """Blocks for the KV cache: num_kv_blocks, else kv_cache_memory, else (cuda) what
        gpu_memory_utilization leaves after weights and a max-size forward, else 4GiB (cpu)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_free_cuda_memory()
        else:
            budget = CPU_DEFAULT_KV_CACHE_BYTES
        return max(budget // self.kv_bytes_per_block, 0)

    def _profile_free_cuda_memory(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_forward(self.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.gpu_memory_utilization) - peak

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        """A step of ``num_tokens`` prompt tokens (sequences of at most max_model_len), logits
        for up to max_num_seqs rows and a sort of them (the sampler's worst case)."""
        n_max = self.max_model_len
        lens = [n_max] * (num_tokens // n_max) + ([num_tokens % n_max] if num_tokens % n_max
                                                   else [])
        h = self._forward_scratch([list(range(n)) for n in lens])
        if h is None:  # a pipeline stage before the last: no logits here
            return
        rows = min(self.config.max_num_seqs, h.shape[0])
        self.model.compute_logits(h[-rows:]).sort(dim=-1)

    @torch.inference_mode()
    def forward_scratch(self, token_ids: list[int],
                        logits_rows: list[int] | None = None) -> torch.Tensor:
        """Logits of one sequence computed from scratch in a private KV cache (the engine's
        cache is untouched). Returns [len(logits_rows) or len(token_ids), vocab] fp32.

        For tests that compare logits with another implementation. Raises ValueError past
        max_model_len.
        """
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len="
                             f"{self.max_model_len}")
        h = self._forward_scratch([token_ids])
        if logits_rows is not None:
            h = h[torch.tensor(logits_rows, device=self.device)]
        return self.model.compute_logits(h)

    def _forward_scratch(self, seqs: list[list[int]]) -> torch.Tensor:
        """Hidden states [sum of lengths, hidden] of whole sequences in a private KV cache."""
        bs = self.block_size
        tables, slots, positions, qsl, offset = [], [], [], [0], 0
        for s in seqs:
            nb = -(-len(s) // bs)
            table = list(range(offset, offset + nb))
            offset += nb
            pos = np.arange(len(s))
            slots.append(np.asarray(table)[pos // bs] * bs + pos % bs)
            positions.append(pos)
            tables.append(table)
            qsl.append(qsl[-1] + len(s))
        cache = torch.empty(self.attn_backend.kv_cache_shape(
            offset, bs, self.model.num_kv_heads, self.model.head_dim),
            dtype=self.kv_cache_dtype, device=self.device)
        meta = self._metadata(np.concatenate(slots), qsl, [len(s) for s in seqs], tables)
        flat = [t for s in seqs for t in s]
        ids = torch.tensor(flat, dtype=torch.long, device=self.device) % self.vocab_size
        pos = torch.from_numpy(np.concatenate(positions)).to(self.device)
        return self.model(ids, pos, [cache] * self.model.num_layers, meta)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        groups = self.setup.kv_groups
        # with a window the block manager keeps block 0 as null
        windows = groups.windows if groups else (self.setup.sliding_window,)
        step = (self.max_num_batched_tokens if self.config.enable_chunked_prefill
                else self.max_model_len)
        need = sum(max_blocks_held(self.max_model_len, w, self.block_size, step)
                   for w in windows)
        windowed = [w for w in windows if w is not None]
        if num_blocks - bool(windowed) < need:
            held = (f" (sliding windows {windows} in {len(windows)} KV cache groups, steps of "
                    f"up to {step}, and the null block)" if groups else
                    f" (a sliding window of {windowed[0]} tokens, steps of up to {step}, and "
                    f"the null block)" if windowed else "")
            raise CacheTooSmallError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens "
                f"({num_blocks * self.block_size} tokens) but one request of "
                f"max_model_len={self.max_model_len} tokens needs {need} blocks{held}; raise "
                f"kv_cache_memory / gpu_memory_utilization / num_kv_blocks or lower "
                f"max_model_len")
        shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size,
                                                 self.model.num_kv_heads, self.model.head_dim)
        # empty, not zeros: backends must mask slots past seq_len (they may hold anything)
        tensors = [torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
                   for _ in range(groups.num_slots if groups else self.model.num_layers)]
        # a hybrid model's layers share tensors: the s-th layer of each group uses tensor s
        self.kv_caches = ([tensors[s] for s in groups.layer_slot] if groups else tensors)
        self.num_blocks = num_blocks
        if self.device.type == "cuda" and self.parallel.pp_size == 1:  # core/step_warmup.py
            warm_up_step_variants(lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
                                  self.block_size, self.max_model_len,
                                  self.max_num_batched_tokens, self.device,
                                  self.config.max_num_seqs,
                                  capture_sizes(self.config.max_num_seqs)
                                  if self.use_cuda_graphs else None,
                                  self.parallel.tp_size)
        if self.use_cuda_graphs:
            if self._stage_io:  # a pipeline stage: the graph holds its layers, not the comms
                self._pp_in = None if self.parallel.is_first_stage else torch.zeros(
                    self.config.max_num_seqs, 2 * self.model.hidden_size,
                    dtype=self.dtype, device=self.device)

                def forward(ids, pos, meta):
                    hidden_in = None if self._pp_in is None else self._pp_in[:ids.shape[0]]
                    return self.model.forward_stage(ids, pos, self.kv_caches, meta, hidden_in)
            else:
                def forward(ids, pos, meta):
                    return self.model(ids, pos, self.kv_caches, meta)
            self.graphs = CUDAGraphs(forward, self._step_buf, self.config.max_num_seqs,
                                     self.input_batch.max_blocks, self.max_model_len,
                                     self.input_batch.num_kv_groups)
            self.graphs.capture()
            self._warm_lm_head(self.graphs.sizes)
        limit = min(self.config.piecewise_cuda_graph_max_tokens, self.max_num_batched_tokens)
        if self.use_cuda_graphs and not self._stage_io and self.parallel.tp_size == 1 \
                and limit > 0:
            self.piecewise = PiecewiseGraphs(
                lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta), limit,
                self.device, self._prefill_meta, self._step_buf.dtype)
            self.piecewise.capture()

    def _prefill_meta(self, n: int) -> AttentionMetadata:
        """One request of ``n`` new tokens at positions 0..n-1 that writes no KV (every slot
        padding) and reads block 0: the uncaptured run before a piecewise capture."""
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.full((n,), PAD_SLOT, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, -(-n // self.block_size), dtype=torch.int32,
                                     device=dev),
            max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])

    @torch.inference_mode()
    def _warm_lm_head(self, sizes: list[int]) -> None:
        """The LM head (outside the graphs) once at each decode bucket of ``sizes`` up to
        GEMV_MAX_M rows: its config (table, autotuner, rule: core/kernels/autotune.py) is then
        settled at start, not at the first step of that many requests. The sampler's argmax
        kernel runs once on those logits too: otherwise its variant compiled (or loaded from
        Triton's disk cache, 2-3 ms on an H100, session 39) at the first token served."""
        if not self.parallel.is_last_stage:
            return
        logits = None
        for bs in (s for s in sizes if s <= GEMV_MAX_M):
            logits = self.model.compute_logits(self.graphs.outputs[bs])
        if logits is not None:
            row_argmax(logits)

    def release_graphs(self) -> None:
        """Destroy the captured CUDA graphs (and wait for the device). Before a NCCL process
        group is destroyed: graphs that captured its collectives keep the communicator's
        resources, and destroying the group then waited forever on an H200 pair."""
        if self.graphs is not None or self.piecewise is not None:
            self.graphs = self.piecewise = None
            gc.collect()
            torch.cuda.synchronize(self.device)

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on CUDA, unless enforce_eager, with a backend that
        supports capture."""
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and self.attn_backend.supports_cuda_graphs
                and (self.parallel.pp_size == 1 or self._stage_io))

    def _replay(self, bs: int) -> torch.Tensor | None:
        """Replay decode graph ``bs``; on a pipeline stage, receive its input into the graph's
        static buffer first and send a copy of its output on after (None then, before the last
        stage): the next replay may overwrite the static output (all buckets share one pool)
        while the send is still in flight, and need not wait for it."""
        par = self.parallel
        if not self._stage_io:
            return self.graphs.replay(bs)
        if self._pp_in is not None:  # (NCCL's stream waits for the replay that last read it)
            par.recv_payload(bs, self._pp_in.shape[1], self._pp_in.dtype, out=self._pp_in[:bs])
        out = self.graphs.replay(bs)
        if par.is_last_stage:
            return out
        par.send_payload(out.clone())
        return None

    # ---- one step -----------------------------------------------------------------------------

    def _metadata(self, slots: np.ndarray, qsl: list[int], seq_lens: list[int],
                  tables: list[list[int]]) -> AttentionMetadata:
        width = max(len(t) for t in tables)
        bt = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(bt).to(dev),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its results (`execute_async` then `collect`)."""
        return self.collect(self.execute_async(so))

    def execute_async(self, so: SchedulerOutput, copy_back: bool = True) -> LaunchedStep:
        """Launch one step: the sampled token of every request with ``sample``, and log-probs
        for the requests that asked for them (of the sampled token; of the prompt positions
        computed in this step). The step's inputs reach the device in one host-to-device copy
        and the results start back in one device-to-host copy; nothing waits for the GPU, so
        the caller can prepare the next step meanwhile (`collect` waits). Input tokens given as
        PLACEHOLDER_TOKEN are taken on the device from this call's previous step's samples. A
        decode-only step replays a CUDA graph when they are captured. ``copy_back=False``: a
        rank whose results nobody reads (tensor/pipeline parallel workers) skips the copy."""
        return self.finish_step(self.launch_forward(so), so.structured_output, copy_back)

    @torch.inference_mode()
    def launch_forward(self, so: SchedulerOutput) -> "PendingStep":
        """The first half of `execute_async`: the step's inputs and its forward pass launched,
        nothing sampled yet (`finish_step` samples). Between the two the caller may wait for the
        previous step's tokens and build this step's structured output bitmask from them: the
        forward then runs on the GPU meanwhile (the engine core's overlap of constrained
        steps, core/engine_core.py)."""
        if so.is_empty:
            self.input_batch.retire(so)  # an empty step can still preempt (prepare does it else)
            return PendingStep(None)
        inp = self.input_batch.prepare(so, self._graph_bucket, self._last_rows)
        dev, dev_s = self.input_batch.copy_to(self._step_buf, inp)
        v = inp.layout.views(dev)
        s = inp.sampling.views(dev_s) if inp.sampling is not None else None
        if inp.num_fills:  # async scheduling: input tokens sampled by the previous step
            k = inp.num_fills
            v["input_ids"].index_copy_(0, v["fill_dst"][:k].long(), self._last_sampled.index_select(
                0, v["fill_src"][:k].long()).to(torch.int32))
        if (s is not None and self.parallel.is_last_stage  # (where logits are sampled)
                and (s["fresh_penalty_slots"].numel() or s["pmask_slots"].numel())):
            self.penalties.ensure(self.input_batch.sampling.num_penalty_slots)
            self.penalties.reset(s["fresh_penalty_slots"], s["pmask_slots"], s["pmask_ids"])
        graph = inp.layout.num_seqs if inp.padded else None
        if graph is not None:
            hidden = self._replay(graph)
            if hidden is None:  # a pipeline stage before the last sent its output on
                return PendingStep(None)
        else:
            meta = AttentionMetadata(
                slot_mapping=v["slot_mapping"], query_start_loc=v["query_start_loc"],
                seq_lens=v["seq_lens"], block_tables=v["block_tables"],
                max_query_len=inp.max_query_len, max_seq_len=inp.max_seq_len,
                query_start_loc_cpu=inp.query_start_loc, seq_lens_cpu=inp.seq_lens,
            ).with_groups(inp.layout.group_views(v))
            pw, ids = self.piecewise, v["input_ids"]
            if pw is not None and pw.bucket(ids.shape[0]) is not None:
                hidden = pw.run(ids, v["positions"], meta)
            else:
                hidden = self.model(ids, v["positions"], self.kv_caches, meta)
            if hidden is None:  # a pipeline stage before the last sent its output on
                return PendingStep(None)
        return PendingStep(inp, v, s, hidden, graph)

    @torch.inference_mode()
    def finish_step(self, p: "PendingStep", structured: StructuredOutputBatch | None = None,
                    copy_back: bool = True) -> LaunchedStep:
        """The second half of `execute_async`: sample a launched forward (``structured``: the
        bitmask of its constrained rows, or None) and start the copy back."""
        if p.inp is None:
            return LaunchedStep([])
        inp, v, s, hidden, graph = p.inp, p.views, p.sampling_views, p.hidden, p.graph
        prompt_jobs = inp.prompt_jobs
        prompt_lp = (prompt_logprobs(self.model.compute_logits, hidden, prompt_jobs,
                                     s["plp_rows"], s["plp_targets"]) if prompt_jobs else None)
        sample_ids = inp.sample_ids
        tokens_t, sample_lp = None, None
        if sample_ids:
            n = len(sample_ids)
            h = hidden[:n] if graph is not None else hidden[v["logits_rows"][:n]]
            logits = self.model.compute_logits(h)
            if structured is not None:  # constrained rows: forbidden tokens -inf
                logits = apply_token_bitmask(logits, structured, sample_ids)
            out = self.sampler(logits, sampling_batch(s, inp.flags, self.penalties))
            if inp.flags.has_penalties:
                self.penalties.update(s["penalty_slots"], out.token_ids)
            tokens_t, sample_lp = out.token_ids, out.logprobs
            self._last_sampled = tokens_t
            self._last_rows = {rid: i for i, rid in enumerate(sample_ids)}
        h = LaunchedStep(sample_ids, tokens_t, sample_lp, prompt_jobs, prompt_lp)
        h.logprob_widths = inp.logprob_widths
        return start_copy_back(h) if copy_back else h

    def collect(self, h: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step and return its results on the host."""
        return collect(h)  # core/step_results.py

    def _graph_bucket(self, num_reqs: int) -> int | None:
        """The CUDA-graph batch size for a decode-only step of ``num_reqs``, if captured."""
        return None if self.graphs is None else self.graphs.bucket(num_reqs)

