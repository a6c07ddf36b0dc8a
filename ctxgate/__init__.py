"""ctxgate: a RAG prompt-budget gateway with its own inference engine."""

__version__ = "0.1.0"
