"""Prompts and helpers shared by the engine tests."""

from __future__ import annotations

PARITY_TEXTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, there was a little dog who lived near the river and",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List three colours of the rainbow:",
    "Water boils at a temperature of one hundred degrees Celsius at sea level. At higher altitudes the "
    "air pressure is lower, so water",
    "Question: What is the largest planet in the solar system?\nAnswer:",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two and a half hours outside the lunar module, collecting samples and taking "
    "photographs, while Michael Collins orbited above. The mission",
]
PARITY_MAX_TOKENS = 12
