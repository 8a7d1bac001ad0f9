"""``MistralForCausalLM`` (Mistral 7B v0.1-v0.3, Mistral NeMo, ...): Llama's layers unchanged.

Mistral v0.1 attends over a sliding window of ``sliding_window`` tokens on every layer (Jiang
et al. 2023, "Mistral 7B"; transformers' ``MistralModel`` masks with
``create_sliding_window_causal_mask``: position i sees keys j with i - window < j <= i). The
attention backends implement the window and the block manager returns blocks behind it, so
max_model_len is not limited by it.
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl

from pagebatch.plugins.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_windows(cls, hf_config) -> list[int | None]:
        """``sliding_window`` of config.json on every layer (None when null: Mistral v0.2 and
        later). Mistral's modeling ignores ``layer_types``, and so does this."""
        window = getattr(hf_config, "sliding_window", None)
        return [int(window) if window else None] * int(hf_config.num_hidden_layers)


@hookimpl
def register_models(register):
    register("MistralForCausalLM", MistralForCausalLM)
