"""ctxgate: a RAG prompt-budget gateway with its own inference engine.

The version is defined once, in pyproject.toml; this reads it from the installed metadata.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ctxgate")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
