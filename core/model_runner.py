"""`ModelRunner`: builds the model from plugins, owns the paged KV cache tensors, turns a
`SchedulerOutput` into one flattened batch, runs the model and samples.

Per step the batch is: input ids and positions [T], slot mapping [T], query start locations
[B+1], sequence lengths [B], block tables [B, max_blocks] and the rows whose logits are sampled
(plus, for requests that ask for prompt log-probs, their prompt rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .attention import AttentionMetadata
from .config import EngineConfig
from .errors import CacheTooSmallError, ConfigError
from .layers.context import ModelContext
from .layers.linear import LinearBase
from .model_loader import ModelSource, architecture, iter_safetensors
from .registry import Registry
from .request import LogprobsLists
from .sampler import LogprobsTensors, Sampler, compute_logprobs, gather_logprobs
from .sampling_state import SamplingState, SamplingStates
from .scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_CACHE_BYTES = 4 * 2**30
PROMPT_LOGPROBS_CHUNK = 512  # prompt rows per logits computation (bounds [rows, vocab] memory)

__all__ = ["ModelRunner", "SamplingState", "resolve_device", "resolve_dtype"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA device; use device: cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class _PromptLogprobsJob:
    """Prompt log-prob rows of one request in this step: flattened rows ``row0 ..
    row0 + len(targets) - 1`` predict prompt tokens ``targets``, the first at prompt index
    ``start``."""

    request_id: str
    row0: int
    start: int
    targets: list[int]
    num: int


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any,
                 registry: Registry, max_model_len: int, max_num_batched_tokens: int):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
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
        hf_quant = getattr(hf_config, "quantization_config", None)
        quant_name = config.quantization or (hf_quant or {}).get("quant_method") or "fp16"
        quant = registry.quant_method(quant_name)(config, hf_quant)
        ctx = ModelContext(self.dtype, self.device, quant, self.attn_backend, max_model_len)
        model_cls = registry.model_class(architecture(hf_config))
        self.model = model_cls(hf_config, ctx)
        self.vocab_size = int(hf_config.vocab_size)
        self._load_weights(source)
        self.model.eval()
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.sampling_states = SamplingStates(self.vocab_size, self.device)
        # log-probs of the last `execute`, request id -> LogprobsLists (see `execute`)
        self.step_logprobs: dict[str, LogprobsLists] = {}
        self.step_prompt_logprobs: dict[str, LogprobsLists] = {}

    def _load_weights(self, source: ModelSource) -> None:
        if self.config.load_format == "dummy":
            g = torch.Generator(device="cpu").manual_seed(self.config.seed)
            for name, p in self.model.named_parameters():
                if name.endswith("norm.weight"):
                    p.data.fill_(1.0)
                else:
                    p.data.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
            for mod in self.model.modules():
                if isinstance(mod, LinearBase):
                    mod.quant_method.process_weights_after_loading(mod)
            return
        with torch.no_grad():
            self.model.load_weights(iter_safetensors(source.folder, self.dtype))

    # ---- KV cache -----------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_layer = np.prod(self.attn_backend.kv_cache_shape(1, self.block_size, m.num_kv_heads,
                                                            m.head_dim))
        return int(per_layer) * elem * m.num_layers

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
            dtype=self.dtype, device=self.device)
        meta = self._metadata(np.concatenate(slots), qsl, [len(s) for s in seqs], tables)
        flat = [t for s in seqs for t in s]
        ids = torch.tensor(flat, dtype=torch.long, device=self.device) % self.vocab_size
        pos = torch.from_numpy(np.concatenate(positions)).to(self.device)
        return self.model(ids, pos, [cache] * self.model.num_layers, meta)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        need = -(-self.max_model_len // self.block_size)
        if num_blocks < need:
            raise CacheTooSmallError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens "
                f"({num_blocks * self.block_size} tokens) but one request of "
                f"max_model_len={self.max_model_len} tokens needs {need} blocks; raise "
                f"kv_cache_memory / gpu_memory_utilization / num_kv_blocks or lower "
                f"max_model_len")
        shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size,
                                                 self.model.num_kv_heads, self.model.head_dim)
        # empty, not zeros: backends must mask slots past seq_len (they may hold anything)
        self.kv_caches = [torch.empty(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.model.num_layers)]
        self.num_blocks = num_blocks

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

    def add_request_state(self, request_id: str, state: SamplingState) -> None:
        self.sampling_states.add(request_id, state)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns request id -> sampled token id for rows with ``sample``.

        Requests that ask for them also get log-probs, left until the next call in
        ``step_logprobs`` (of the sampled token) and ``step_prompt_logprobs`` (of the prompt
        positions computed in this step), request id -> `LogprobsLists`. Everything comes to
        the host in one device-to-host copy.
        """
        self.step_logprobs, self.step_prompt_logprobs = {}, {}
        self.sampling_states.remove(so.finished_request_ids)
        if so.is_empty:
            return {}
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        qsl, seq_lens, tables, logits_rows, sample_ids = [0], [], [], [], []
        prompt_jobs: list[_PromptLogprobsJob] = []
        for sr in so.scheduled:
            job = self._prompt_logprobs_job(sr, qsl[-1])
            if job is not None:
                prompt_jobs.append(job)
            n = len(sr.token_ids)
            token_ids.extend(sr.token_ids)
            pos = np.arange(sr.start_pos, sr.start_pos + n)
            positions.append(pos)
            table = np.asarray(sr.block_ids, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(sr.start_pos + n)
            tables.append(sr.block_ids)
            if sr.sample:
                logits_rows.append(qsl[-1] - 1)
                sample_ids.append(sr.request_id)
        meta = self._metadata(np.concatenate(slots), qsl, seq_lens, tables)
        dev = self.device
        ids_t = torch.tensor(token_ids, dtype=torch.long, device=dev)
        pos_np = np.concatenate(positions)
        pos_t = torch.from_numpy(pos_np).to(dev)
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        prompt_lp = self._prompt_logprobs(hidden, prompt_jobs) if prompt_jobs else None
        tokens_t, sample_lp = None, None
        if sample_ids:
            rows = torch.tensor(logits_rows, dtype=torch.long, device=dev)
            logits = self.model.compute_logits(hidden[rows])
            batch = self.sampling_states.batch(sample_ids,
                                               [int(pos_np[r]) + 1 for r in logits_rows])
            out = self.sampler(logits, batch)
            self.sampling_states.update(out.token_ids)
            tokens_t, sample_lp = out.token_ids, out.logprobs
        if sample_lp is None and prompt_lp is None:
            tokens = tokens_t.tolist() if tokens_t is not None else []  # the one D2H copy
            return dict(zip(sample_ids, tokens))
        return self._unpack(sample_ids, tokens_t, sample_lp, prompt_jobs, prompt_lp)

    # ---- log-probs ----------------------------------------------------------------------------

    def _prompt_logprobs_job(self, sr: ScheduledRequest, row0: int) -> _PromptLogprobsJob | None:
        """The prompt log-prob rows of ``sr`` whose row starts at flattened row ``row0``: rows
        at positions p (< num_prompt_tokens - 1) predict prompt token p + 1; each prompt index
        is handed out once (a recompute after preemption skips those already sent)."""
        st = self.sampling_states.states.get(sr.request_id)
        if st is None or st.prompt_logprobs is None:
            return None
        first = max(sr.start_pos, st.next_prompt_logprob - 1)
        end = min(sr.start_pos + len(sr.token_ids), st.num_prompt_tokens - 1)
        if first >= end:
            return None
        st.next_prompt_logprob = end + 1
        return _PromptLogprobsJob(sr.request_id, row0 + first - sr.start_pos, first + 1,
                                  st.prompt_token_ids[first + 1:end + 1], st.prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         jobs: list[_PromptLogprobsJob]) -> LogprobsTensors:
        """Log-probs of every job's prompt rows, PROMPT_LOGPROBS_CHUNK rows of logits at a
        time, with the largest N of the jobs."""
        dev = self.device
        rows = torch.tensor([j.row0 + i for j in jobs for i in range(len(j.targets))],
                            dtype=torch.long, device=dev)
        targets = torch.tensor([t for j in jobs for t in j.targets], dtype=torch.long,
                               device=dev)
        num = max(j.num for j in jobs)
        parts = []
        for a in range(0, rows.shape[0], PROMPT_LOGPROBS_CHUNK):
            r = rows[a:a + PROMPT_LOGPROBS_CHUNK]
            lp = compute_logprobs(self.model.compute_logits(hidden[r]))
            parts.append(gather_logprobs(lp, targets[a:a + PROMPT_LOGPROBS_CHUNK], num))
        return LogprobsTensors(torch.cat([p.token_ids for p in parts]),
                               torch.cat([p.logprobs for p in parts]),
                               torch.cat([p.ranks for p in parts]))

    def _unpack(self, sample_ids: list[str], tokens_t: torch.Tensor | None,
                sample_lp: LogprobsTensors | None, jobs: list[_PromptLogprobsJob],
                prompt_lp: LogprobsTensors | None) -> dict[str, int]:
        """Bring sampled ids and log-probs to the host in one copy (packed as fp64, which holds
        token ids and fp32 values exactly), fill ``step_logprobs`` / ``step_prompt_logprobs``
        and return the sampled ids."""
        parts: list[torch.Tensor] = [] if tokens_t is None else [tokens_t]
        for lp in (sample_lp, prompt_lp):
            if lp is not None:
                parts += [lp.token_ids.flatten(), lp.logprobs.flatten(), lp.ranks]
        host = torch.cat([p.to(torch.float64) for p in parts]).cpu().numpy()
        n = 0 if tokens_t is None else tokens_t.shape[0]
        tokens = host[:n].astype(np.int64).tolist()
        off = n

        def take(lp: LogprobsTensors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            nonlocal off
            r, w = lp.token_ids.shape
            ids = host[off:off + r * w].astype(np.int64).reshape(r, w)
            vals = host[off + r * w:off + 2 * r * w].reshape(r, w)
            ranks = host[off + 2 * r * w:off + 2 * r * w + r].astype(np.int64)
            off += 2 * r * w + r
            return ids, vals, ranks

        if sample_lp is not None:
            ids, vals, ranks = take(sample_lp)
            wanting = [r for r in sample_ids if self.sampling_states[r].logprobs is not None]
            for i, rid in enumerate(wanting):
                w = 1 + self.sampling_states[rid].logprobs
                self.step_logprobs[rid] = LogprobsLists(
                    [ids[i, :w].tolist()], [vals[i, :w].tolist()], [int(ranks[i])])
        if prompt_lp is not None:
            ids, vals, ranks = take(prompt_lp)
            a = 0
            for j in jobs:
                b, w = a + len(j.targets), 1 + j.num
                self.step_prompt_logprobs[j.request_id] = LogprobsLists(
                    ids[a:b, :w].tolist(), vals[a:b, :w].tolist(), ranks[a:b].tolist(), j.start)
                a = b
        return dict(zip(sample_ids, tokens))
