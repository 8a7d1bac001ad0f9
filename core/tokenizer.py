"""Tokenizers and chat templates come from transformers (never our own code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import InvalidRequestError, ModelNotFoundError
from .prompt_length import tokenize_within


def load_tokenizer(path: str | Path) -> Any:
    """A tokenizer from a local folder (never downloaded). Raises ModelNotFoundError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ModelNotFoundError(f"cannot load a tokenizer from {str(path)!r}: {e}") from None


def read_chat_template(value: str) -> str:
    """A chat template given as a file path or as the template text itself (text with a Jinja
    ``{{`` or ``{%``). Raises ConfigError naming the value otherwise."""
    from .errors import ConfigError

    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"chat_template={value!r} is neither a file nor a Jinja template "
                          f"(no '{{{{' or '{{%' in it)")
    return path.read_text()


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True, max_model_len: int | None = None,
                    max_tokens: int | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template: str | None = None) -> list[int]:
    """Token ids of a conversation through the model's chat template.

    ``tools``: OpenAI tool objects (``{"type": "function", "function": {...}}``) the template
    renders (transformers' ``apply_chat_template(tools=...)``; a template that ignores tools
    ignores them). ``chat_template``: a template text used instead of the tokenizer's.

    The template text already holds any BOS, so it is tokenized without adding special tokens
    (one BOS, not two). Raises InvalidRequestError for malformed messages or no template; with
    ``max_model_len``, ContextLengthError as soon as a prefix of the text cannot fit it
    (core/prompt_length.py) instead of tokenizing it all.
    """
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} "
                                  f"dicts, got {messages!r:.200}")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; use generate "
                                  "with a plain prompt, or give chat_template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)
    if max_model_len is not None:
        return tokenize_within(tokenizer, text, max_model_len, max_tokens,
                               add_special_tokens=False, what="the chat prompt")
    return tokenizer(text, add_special_tokens=False)["input_ids"]
