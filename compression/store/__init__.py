"""What the compressor keeps: caches (in process, in Redis) and retrieval indexes."""
