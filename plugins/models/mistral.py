"""``MistralForCausalLM`` (Mistral 7B v0.1-v0.3, Mistral NeMo, ...): Llama's layers unchanged.

Mistral v0.1 attends over a sliding window of ``sliding_window`` tokens (Jiang et al. 2023,
"Mistral 7B"). The attention backends here attend over the whole sequence, which equals the
windowed attention as long as a sequence has at most ``sliding_window`` tokens: the model
therefore limits max_model_len to the window (the engine caps it and logs a warning).
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl

from pagebatch.plugins.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def max_model_len_limit(cls, hf_config) -> int | None:
        """``sliding_window`` of config.json (None when null: Mistral v0.2 and later)."""
        window = getattr(hf_config, "sliding_window", None)
        return int(window) if window else None


@hookimpl
def register_models(register):
    register("MistralForCausalLM", MistralForCausalLM)
