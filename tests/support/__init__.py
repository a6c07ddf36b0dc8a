"""What tests share: real servers on free ports, a real redis-server, waiting for a condition."""
