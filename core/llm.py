"""`LLM`: offline batched generation in vLLM's shape.

    from pagebatch import LLM, SamplingParams
    llm = LLM()                                   # smollm2-135m, on cpu or cuda
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .config import EngineConfig
from .engine import LLMEngine, PromptType
from .errors import InvalidRequestError
from .request import RequestOutput, SamplingParams
from .tokenizer import read_chat_template


class LLM:
    """``LLM(model=..., config_file=..., **engine_keys)``; keywords override the file."""

    def __init__(self, model: str | None = None, *, config_file: str | Path | None = None,
                 **kwargs: Any):
        cli = dict(kwargs)
        if model is not None:
            cli["model"] = model
        self.config = EngineConfig.from_sources(cli=cli, file=config_file)
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        A prompt is a string or ``{"prompt_token_ids": [...]}``, a dict optionally with a
        ``"cache_salt"``. ``priority``: one integer per prompt for the ``priority`` policy (lower
        first). Every prompt is validated before any is queued: a bad one raises its
        InvalidRequestError and nothing runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"got {len(params)} sampling_params for "
                                          f"{len(prompts)} prompts; give one or one each")
        prios = [0] * len(prompts) if priority is None else list(priority)
        if len(prios) != len(prompts):
            raise InvalidRequestError(f"got {len(prios)} priorities for {len(prompts)} prompts")
        prepared = [self.engine.prepare(p, sp, priority=pr)
                    for p, sp, pr in zip(prompts, params, prios)]
        for core_req, state in prepared:
            state.want_final_only()  # generate returns finished outputs only
            self.engine.submit(core_req, state)
        order = {core_req.request_id: i for i, (core_req, _) in enumerate(prepared)}
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them, through the
        model's chat template (vLLM's ``LLM.chat``). ``tools``: OpenAI tool objects the template
        renders; ``chat_template``: a template file path or text used instead (the engine key
        of the same name sets it for every call). Tool calls in the output are text here: the
        HTTP server's parser turns them into ``tool_calls`` (docs/serving.md). Without
        ``sampling_params``, max_tokens is the rest of the context (as chat completions; the
        model's generation_config may cap it)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if sampling_params is None:  # as chat completions: up to the rest of the context
            sampling_params = self.engine.default_sampling_params()
            if "max_tokens" not in self.engine.sampling_defaults:
                sampling_params.max_tokens = None
        template = read_chat_template(chat_template) if chat_template else None
        prompts = [self.engine.chat_prompt(c, tools=tools, chat_template=template)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = None
        if use_tqdm and len(order) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", unit="req")
        try:
            while self.engine.has_unfinished_requests:
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]
