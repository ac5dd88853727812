"""The names ``--tool-call-parser`` accepts, for the daemon's config check.

The parsers themselves live in the frontend (frontend/tool_parsers.py); the daemon never
imports the frontend (tests/test_layers.py), so it checks a name against this list and
passes it on. tests/frontend/test_tool_parsers.py keeps the two in step.
"""

BUILTIN_TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes",)
DEFAULT_TOOL_CALL_PARSER = "hermes"
