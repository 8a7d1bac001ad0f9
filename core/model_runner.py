"""`ModelRunner`: builds the model from plugins, owns the paged KV cache tensors, turns a
`SchedulerOutput` into one flattened batch, runs the model and samples.

Per step the batch is: input ids and positions [T], slot mapping [T], query start locations
[B+1], sequence lengths [B], block tables [B, max_blocks] and the rows whose logits are sampled.
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
from .request import GREEDY_EPS
from .sampler import Sampler, SamplingBatch
from .scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_CACHE_BYTES = 4 * 2**30


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
class SamplingState:
    """What the runner keeps per request to build sampling tensors (set once, at admission)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any,
                 registry: Registry, max_model_len: int, max_num_batched_tokens: int):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        backend_name = config.attention_backend or "torch_ref"
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
        self.sampling_states: dict[str, SamplingState] = {}

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

    def _dummy_forward(self, num_tokens: int) -> None:
        self.forward_scratch(list(range(num_tokens)), logits_rows=[num_tokens - 1])

    @torch.inference_mode()
    def forward_scratch(self, token_ids: list[int],
                        logits_rows: list[int] | None = None) -> torch.Tensor:
        """Logits of one sequence computed from scratch in a private KV cache (the engine's
        cache is untouched). Returns [len(logits_rows) or len(token_ids), vocab] fp32.

        For tests that compare logits with another implementation, and for memory profiling.
        """
        n = len(token_ids)
        cache = torch.empty(self.attn_backend.kv_cache_shape(
            -(-n // self.block_size), self.block_size, self.model.num_kv_heads,
            self.model.head_dim), dtype=self.dtype, device=self.device)
        meta = self._metadata(np.arange(n), [0, n], [n], [list(range(cache.shape[1]))])
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device) % self.vocab_size
        pos = torch.arange(n, device=self.device)
        h = self.model(ids, pos, [cache] * self.model.num_layers, meta)
        if logits_rows is not None:
            h = h[torch.tensor(logits_rows, device=self.device)]
        return self.model.compute_logits(h)

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
        self.sampling_states[request_id] = state

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns request id -> sampled token id for rows with ``sample``."""
        for rid in so.finished_request_ids:
            self.sampling_states.pop(rid, None)
        if so.is_empty:
            return {}
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        qsl, seq_lens, tables, logits_rows, sample_ids = [0], [], [], [], []
        for sr in so.scheduled:
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
        if not sample_ids:
            return {}
        rows = torch.tensor(logits_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden[rows])
        batch = self._sampling_batch(sample_ids, [int(pos_np[r]) + 1 for r in logits_rows])
        tokens = self.sampler(logits, batch).tolist()  # the step's one device-to-host copy
        return dict(zip(sample_ids, tokens))

    def _sampling_batch(self, request_ids: list[str], positions: list[int]) -> SamplingBatch:
        states = [self.sampling_states[r] for r in request_ids]
        dev = self.device
        temps = [s.temperature for s in states]
        top_k = [s.top_k for s in states]
        top_p = [s.top_p for s in states]
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, dtype=torch.long, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev),
            seeds=torch.tensor([s.seed for s in states], dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            all_greedy=all(t < GREEDY_EPS for t in temps),
            any_top_k=any(0 < k < self.vocab_size for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
        )
