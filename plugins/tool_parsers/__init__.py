"""Tool-call parser plugins (core/tool_parser.py): ``hermes`` and ``llama3_json``."""
