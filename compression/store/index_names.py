"""What a retrieval index may be called (import-light: the gateway's key file checks it too).

A name is one path component of its own making: no dots (so never `.` or `..`, nor hidden files),
no separators, bounded length. The pattern has no nested repetition, so matching is linear.
"""

from __future__ import annotations

import re

INDEX_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
INDEX_NAME_RULE = "1-64 letters, digits, '_' or '-', starting with a letter or digit"
_INDEX_NAME = re.compile(INDEX_NAME_PATTERN)


class UnknownIndexError(ValueError):
    """The request names an index that does not exist (HTTP 404 in the gateway); the message names
    the index, never the directory."""


class InvalidIndexName(ValueError):
    """A name that cannot be an index (HTTP 400 in the gateway); the message never names a path."""


def check_index_name(name: str) -> str:
    # fullmatch: `$` would also accept a trailing newline.
    if not isinstance(name, str) or _INDEX_NAME.fullmatch(name) is None:
        shown = name[:64] + "..." if isinstance(name, str) and len(name) > 64 else name
        raise InvalidIndexName(f"invalid index name {shown!r}: use {INDEX_NAME_RULE}")
    return name
