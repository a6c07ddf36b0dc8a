"""One audit line per console action on the `ctxgate.audit` logger: what, on which key or file, the
outcome and the request id. Never a key, a secret or a policy's text."""

from __future__ import annotations

import logging
import re

from ctxgate.gateway.request_id import current_request

audit_logger = logging.getLogger("ctxgate.audit")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@/=-]")


def _clean(value: str) -> str:
    # Targets come from forms: nothing in them may forge a log line or a field.
    return _UNSAFE.sub("_", value)[:128] or "-"


def audit(action: str, target: str, outcome: str, detail: str = "") -> None:
    context = current_request()
    request_id = context.request_id if context is not None else "-"
    line = (
        f"console action={_clean(action)} target={_clean(target)} outcome={_clean(outcome)} "
        f"request_id={request_id}"
    )
    if detail:
        line += f" detail={_clean(detail)}"
    audit_logger.info(line)
