"""The built-in inference engine (paged KV cache, continuous batching) and upstream clients."""
