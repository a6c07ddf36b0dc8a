"""Sentence embeddings: the model, its padding-free encoder, micro-batching of concurrent
requests, and the child-process placement.
"""
