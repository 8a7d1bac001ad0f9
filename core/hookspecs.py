"""The hook specifications of pagebatch: the whole plugin contract in one file.

A plugin is a module (or object) with functions marked ``@hookimpl`` and is found through the
entry-point group ``pagebatch``. Registration hooks take a ``register`` callback; call it once per
component the plugin provides. Names must be unique per kind across all plugins: two plugins
registering one name is an error that names both. Built-ins register exactly like this.

Example::

    from pagebatch import hookimpl

    @hookimpl
    def register_scheduling_policies(register):
        register("shortest_first", ShortestPromptFirst)
"""

from __future__ import annotations

import pluggy

PROJECT = "pagebatch"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_scheduling_policies(register):
    """Register scheduling policies: ``register(name, cls)``.

    ``cls(config: EngineConfig)`` must implement ``pagebatch.scheduler.SchedulingPolicy``.
    Selected by ``scheduling_policy: NAME`` in the config. Called once when plugins load.
    """


@hookspec
def register_quant_methods(register):
    """Register quantization methods: ``register(name, cls)``.

    ``cls(config: EngineConfig, hf_quant_config: dict | None)`` must implement
    ``pagebatch.layers.linear.QuantMethod``. Selected by ``quantization: NAME`` or by the
    checkpoint's ``quantization_config.quant_method``.
    """


@hookspec
def register_attention_backends(register):
    """Register attention backends: ``register(name, cls)``.

    ``cls()`` must implement ``pagebatch.attention.AttentionBackend``. Selected by
    ``attention_backend: NAME`` (default: ``torch_ref`` on CPU).
    """


@hookspec
def register_models(register):
    """Register model classes: ``register(hf_architecture_name, cls)``.

    The key is an entry of ``architectures`` in a Hugging Face config.json, e.g.
    ``"LlamaForCausalLM"``. ``cls(hf_config, ctx: pagebatch.layers.context.ModelContext)`` must
    implement ``pagebatch.model.CausalLM`` (``forward``, ``compute_logits``, ``load_weights``
    and the KV cache geometry); ``pagebatch.layers.decoder.DecoderForCausalLM`` implements it
    for a decoder layer of the plugin's own. See docs/plugins.md.
    """


@hookspec
def register_structured_output_backends(register):
    """Register structured output backends: ``register(name, cls)``.

    ``cls(tokenizer, vocab_size, stop_token_ids)`` must implement
    ``pagebatch.structured_output.StructuredOutputBackend``: compile a constraint (JSON
    schema, any JSON object, regex, choice, grammar) and make per-request matchers that fill
    the token bitmask the sampler applies. Selected by ``structured_outputs_backend: NAME``
    (default ``xgrammar``).
    """


@hookspec
def register_tool_parsers(register):
    """Register tool-call parsers: ``register(name, cls)``.

    ``cls(tokenizer)`` must implement ``pagebatch.tool_parser.ToolParser``: turn a model's text
    (whole, or a prefix while streaming) into OpenAI tool calls and the content around them;
    ``reader(tools)`` gives the per-choice reader the server streams and answers through.
    Selected by the HTTP server's ``tool_call_parser: NAME`` (built-ins ``hermes``,
    ``llama3_json``); used for requests with ``tool_choice: auto``.
    """


@hookspec
def register_frontends(register):
    """Register frontends: ``register(name, frontend)``.

    ``frontend`` implements ``pagebatch.frontend.Frontend``: ``add_cli_arguments(parser)`` (its
    own options on the ``pagebatch NAME`` subcommand) and ``run(config, args) -> int``. The HTTP
    server is one (``pagebatch serve``).
    """


@hookspec
def register_commands(register):
    """Register CLI subcommands that run no engine: ``register(name, command)``.

    ``command`` is an object with ``help`` (its one-line help), ``add_arguments(parser)`` (its
    positionals and options on the ``pagebatch NAME`` argparse parser) and
    ``run(args) -> int`` (the exit status; a ``PagebatchError`` prints as ``error: ...``,
    status 2). Unlike a frontend it gets no engine keys and no `EngineConfig`. The quant
    package registers ``pagebatch quantize`` this way. The names ``generate``, ``plugins``,
    ``bench`` and the frontends' are taken.
    """


@hookspec
def register_config_options(register):
    """Declare config keys this plugin reads: ``register(ConfigOption(...))``.

    Declared keys join the schema: they may appear in the YAML file and on the command line, and
    an unknown key is only an error after every plugin declared its own. Values end up in
    ``EngineConfig.plugin_options[name]``.
    """


@hookspec
def engine_started(config):
    """Called once the engine core is ready to take requests. ``config``: the EngineConfig."""


@hookspec
def request_finished(output):
    """Called in the front half when a request finishes, with its final ``RequestOutput``.

    Runs on the engine's thread: keep it short (e.g. a custom stat logger).
    """
