"""Form bodies of the console's POSTs: url-encoded only, bounded in size and field count, UTF-8."""

from __future__ import annotations

from urllib.parse import parse_qsl

from starlette.requests import Request

MAX_FORM_BYTES = 256 * 1024  # a policy file being edited is the largest field
MAX_FIELDS = 32


class FormError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


async def read_form(request: Request) -> dict[str, str]:
    """The posted fields (a repeated field: its last value)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise FormError(415, "the console's forms post application/x-www-form-urlencoded")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise FormError(413, f"form body over {MAX_FORM_BYTES} bytes")
    try:
        text = body.decode("utf-8")
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=False, max_num_fields=MAX_FIELDS)
    except UnicodeDecodeError:
        raise FormError(400, "form body is not UTF-8") from None
    except ValueError:
        raise FormError(400, f"form has more than {MAX_FIELDS} fields") from None
    return dict(pairs)
