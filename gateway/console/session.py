"""The console session: a signed, expiring cookie set once the admin key is posted to the login form.

The cookie holds a random session id and its expiry, signed with HMAC-SHA256 under a secret derived
from the admin key; nothing secret is in it. Each session has its CSRF token (an HMAC of its id), put
into every form and checked on every action. Logging out denies the session id in this process until
it would have expired (a stateless cookie cannot be recalled from other replicas: keep the TTL short).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE_NAME = "ctxgate_console"
DEFAULT_TTL_S = 8 * 3600
_ID_BYTES = 18


@dataclass(frozen=True)
class Session:
    session_id: str
    expires_at: int
    csrf_token: str


class Sessions:
    def __init__(self, secret: bytes, ttl_s: int = DEFAULT_TTL_S, clock: Callable[[], float] = time.time):
        self._secret = secret
        self.ttl_s = ttl_s
        self._clock = clock
        self._ended: dict[str, int] = {}  # logged-out session id -> its expiry
        self._lock = threading.Lock()

    def _sign(self, text: str) -> str:
        return hmac.new(self._secret, text.encode("ascii"), hashlib.sha256).hexdigest()

    def _session(self, session_id: str, expires_at: int) -> Session:
        return Session(session_id, expires_at, self._sign(f"csrf:{session_id}"))

    def issue(self) -> tuple[str, Session]:
        """(cookie value, session) for a fresh login."""
        session_id = secrets.token_urlsafe(_ID_BYTES)
        expires_at = int(self._clock()) + self.ttl_s
        payload = f"{session_id}.{expires_at}"
        return f"{payload}.{self._sign(payload)}", self._session(session_id, expires_at)

    def verify(self, cookie: str | None) -> Session | None:
        """The session this cookie proves, or None (absent, forged, expired or logged out)."""
        if not cookie or len(cookie) > 256:
            return None
        session_id, _, rest = cookie.partition(".")
        expiry_text, _, signature = rest.partition(".")
        if not session_id or not expiry_text.isdigit() or not signature:
            return None
        if not hmac.compare_digest(signature, self._sign(f"{session_id}.{expiry_text}")):
            return None
        expires_at = int(expiry_text)
        now = self._clock()
        if expires_at <= now:
            return None
        with self._lock:
            if session_id in self._ended:
                return None
        return self._session(session_id, expires_at)

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(token, session.csrf_token)

    def end(self, session: Session) -> None:
        now = self._clock()
        with self._lock:
            self._ended = {sid: at for sid, at in self._ended.items() if at > now}
            self._ended[session.session_id] = session.expires_at
