"""Who may use a console route: a valid session for every page, and its CSRF token on every action.

A missing session sends a page request to the login form (303) and refuses an action (401); a
missing or wrong CSRF token refuses the action (403). Tenant API keys and the admin key in a header
open nothing: the session cookie is the only credential here.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from ctxgate.gateway.console.forms import FormError, read_form
from ctxgate.gateway.console.session import COOKIE_NAME, Session
from ctxgate.gateway.console.state import Console
from ctxgate.gateway.service import Gateway

LOGIN_PATH = "/console/login"


class Refused(Exception):
    """An answer other than the page: a redirect to the login form, or an error page."""

    def __init__(self, response: Response):
        super().__init__(response.status_code)
        self.response = response


def console_of(request: Request) -> Console:
    return request.app.state.console


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def current_session(request: Request) -> Session | None:
    return console_of(request).sessions.verify(request.cookies.get(COOKIE_NAME))


def error_page(request: Request, status: int, message: str, session: Session | None = None) -> Response:
    return console_of(request).templates.render(
        "message.html",
        status=status,
        title="Refused" if status < 500 else "Error",
        message=message,
        kind="error",
        secret=None,
        back="/console" if session else LOGIN_PATH,
        session=session,
    )


def page_session(request: Request) -> Session:
    session = current_session(request)
    if session is None:
        raise Refused(RedirectResponse(LOGIN_PATH, status_code=303))
    return session


async def action_form(request: Request) -> tuple[Session, dict[str, str]]:
    """The session and the posted fields of an action, its CSRF token checked."""
    session = current_session(request)
    if session is None:
        raise Refused(
            error_page(request, 401, "Log in to the console first (the session is missing or expired).")
        )
    try:
        form = await read_form(request)
    except FormError as exc:
        raise Refused(error_page(request, exc.status, exc.message, session)) from None
    if not console_of(request).sessions.csrf_ok(session, form.get("csrf_token")):
        raise Refused(
            error_page(request, 403, "The form's CSRF token is missing or wrong; reload the page.", session)
        )
    return session, form
