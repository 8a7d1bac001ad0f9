"""pagebatch: continuous batching over a paged KV cache, every swappable part a plugin.

Public API: ``LLM``, ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``,
``EngineConfig``, ``LLMEngine``, ``AsyncEngine``, ``hookimpl`` (for plugin authors) and the
errors in ``pagebatch.errors``.
"""

from .async_engine import AsyncEngine
from .config import ConfigOption, EngineConfig
from .engine import LLMEngine
from .errors import PagebatchError
from .hookspecs import hookimpl
from .llm import LLM
from .request import CompletionOutput, FinishReason, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
    "FinishReason",
    "EngineConfig", "ConfigOption", "PagebatchError", "hookimpl", "__version__",
]
