"""The engine behind its own OpenAI-compatible HTTP server (`ctxgate engine serve`) and
the `ctxgate model` / `ctxgate engine` commands.
"""
