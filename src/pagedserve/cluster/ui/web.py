"""What the web consoles share (the router's, in this folder, and the gateway's, gateway/ui/, built on it): login
and sessions, CSRF checks, security headers, templates that escape every value, the static files, and the
benchmark images of a docs folder.

Security. The admin key is typed once into the login form (a POST body, never a URL) and compared in constant
time; the browser then holds only a random session id, in an HttpOnly, SameSite=Strict cookie scoped to /ui.
Every page, fragment and image under /ui, all but the login form and the static files, answers only to a live
session; every POST must also carry the session's CSRF token (a form field, or htmx's X-CSRF-Token header) and,
where the browser sends one, an Origin naming this host. Pages load scripts, styles and images from this server
only (a Content-Security-Policy tells the browser so), and Jinja escapes every value a template prints.
"""
from __future__ import annotations

import hmac
import mimetypes
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined

PREFIX = "/ui"
COOKIE = "pagedserve_console"
LOGIN_COOKIE = "pagedserve_console_login"
HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
FORM_BYTES = 64 << 10  # the consoles' forms are small: a larger body is refused before it is parsed
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",  # not no-referrer: under it a browser's form POSTs say Origin: null
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(slots=True)
class Session:
    csrf: str
    expires_at: float
    sent: deque = field(default_factory=lambda: deque(maxlen=256))  # one-time form ids already used (first_send)


class Sessions:
    """Console sessions in this process's memory (a restart logs everyone out; a session never outlives `ttl_s`)."""

    def __init__(self, admin_key: str, ttl_s: float = 8 * 3600, limit: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self.admin_key, self.ttl_s, self.limit, self.clock = admin_key.encode(), ttl_s, limit, clock
        self.live: dict[str, Session] = {}

    def is_admin_key(self, typed: str) -> bool:
        return hmac.compare_digest(typed.encode(errors="surrogatepass"), self.admin_key)

    def open(self) -> str:
        """A new session (a new id at every login: a planted id is never promoted)."""
        now = self.clock()
        self.live = {k: s for k, s in self.live.items() if s.expires_at > now}
        while len(self.live) >= self.limit:  # oldest first: dicts keep insertion order
            self.live.pop(next(iter(self.live)))
        sid = secrets.token_urlsafe(32)
        self.live[sid] = Session(secrets.token_urlsafe(32), now + self.ttl_s)
        return sid

    def get(self, sid: str | None) -> Session | None:
        session = self.live.get(sid) if sid else None
        if session is not None and session.expires_at <= self.clock():
            self.live.pop(sid, None)
            return None
        return session

    def close(self, sid: str | None) -> None:
        self.live.pop(sid or "", None)


@dataclass(slots=True)
class LoginThrottle:
    """Failed logins per client address: past `failures` within `window_s`, that address is refused a while."""
    failures: int = 10
    window_s: float = 300.0
    clock: Callable[[], float] = time.monotonic
    seen: dict[str, deque] = field(default_factory=dict)

    def blocked(self, who: str) -> bool:
        times = self.seen.get(who)
        while times and times[0] <= self.clock() - self.window_s:
            times.popleft()
        return bool(times) and len(times) >= self.failures

    def failed(self, who: str) -> None:
        if len(self.seen) > 10_000:  # an address sweep must not grow this without bound
            self.seen.clear()
        self.seen.setdefault(who, deque()).append(self.clock())


@dataclass(slots=True)
class Benchmark:
    name: str
    modified: float
    size: int


class BenchmarkImages:
    """The PNGs `pagedserve bench` writes into a docs folder, newest first; only those listed are ever served."""

    MAX_BYTES = 32 << 20

    def __init__(self, docs_dir: Path | None):
        self.docs_dir = docs_dir

    def latest(self) -> list[Benchmark]:
        if self.docs_dir is None or not self.docs_dir.is_dir():
            return []
        found = []
        for path in self.docs_dir.iterdir():
            if path.suffix.lower() == ".png" and path.is_file() and not path.is_symlink():
                stat = path.stat()
                found.append(Benchmark(path.name, stat.st_mtime, stat.st_size))
        return sorted(found, key=lambda b: b.modified, reverse=True)

    def read(self, name: str) -> bytes | None:
        listed = {b.name: b for b in self.latest()}
        if name not in listed or listed[name].size > self.MAX_BYTES:
            return None
        return (self.docs_dir / name).read_bytes()


class StaticFiles:
    """The files of the consoles' static folders, found once at start-up: a request names one of them or nothing."""

    def __init__(self, folders: list[Path]):
        self.files: dict[str, Path] = {}
        for folder in folders:
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    self.files[path.relative_to(folder).as_posix()] = path

    def response(self, name: str) -> Response:
        path = self.files.get(name)
        if path is None:
            return PlainTextResponse("not found", status_code=404, headers=SECURITY_HEADERS)
        kind = mimetypes.guess_type(path.name)[0] or "text/plain"
        if kind.startswith("text/") or kind.endswith("javascript"):
            kind += "; charset=utf-8"
        return Response(path.read_bytes(), media_type=kind, headers={**SECURITY_HEADERS, "cache-control": "max-age=300"})


def usd(value: float | None) -> str:
    """Dollars to the cent, and to the nanodollar where cents would show a small spend as $0.00."""
    if value is None:
        return "—"
    if value == 0 or abs(value) >= 0.01:
        return f"${value:,.2f}"
    return f"${value:.9f}".rstrip("0")


def when(ts: float | None, tz: tzinfo | None = None) -> str:
    return "—" if not ts else datetime.fromtimestamp(ts, tz).strftime("%Y-%m-%d %H:%M:%S")


def number(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f} ms"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


class Console:
    """One console: its pages are handlers added with `page` (GET) and `action` (POST), each refused without a
    session; `mount` adds the login and logout forms, the static files and the benchmark images."""

    def __init__(self, title: str, admin_key: str, nav: list[tuple[str, str]], template_dirs: Sequence[Path] = (),
                 static_dirs: Sequence[Path] = (), docs_dir: Path | None = None, tz: tzinfo | None = None):
        self.title, self.nav = title, nav
        self.sessions = Sessions(admin_key)
        self.throttle = LoginThrottle()
        self.env = Environment(loader=FileSystemLoader([*template_dirs, TEMPLATES]), autoescape=True,
                               undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(usd=usd, when=lambda ts: when(ts, tz), number=number, percent=percent, ms=ms)
        self.static = StaticFiles([*static_dirs, STATIC])
        self.benchmarks = BenchmarkImages(docs_dir)

    def render(self, request: Request, template: str, status: int = 200, **context) -> HTMLResponse:
        session = getattr(request.state, "console_session", None)
        html = self.env.get_template(template).render(
            title=self.title, nav=self.nav, path=request.url.path, csrf=session.csrf if session else "",
            once=secrets.token_urlsafe(16), has_benchmarks=self.benchmarks.docs_dir is not None, **context)
        return HTMLResponse(html, status_code=status, headers=no_store())

    @staticmethod
    def first_send(request: Request) -> bool:
        """Whether this POST's one-time form id (the `once` field every page offers) is new: a reload of the answer
        to a form that made something, or a double click, sends it again and must not make a second one."""
        once, sent = request.state.form.get("once", ""), request.state.console_session.sent
        if not once or once in sent:
            return False
        sent.append(once)
        return True

    def page(self, app: FastAPI, path: str, handler: Handler) -> None:
        self._add(app, "GET", path, handler)

    def action(self, app: FastAPI, path: str, handler: Handler) -> None:
        self._add(app, "POST", path, handler)

    def _add(self, app: FastAPI, method: str, path: str, handler: Handler) -> None:
        async def guarded(request: Request) -> Response:
            session = self.sessions.get(request.cookies.get(COOKIE))
            if session is None:
                return refusal(request)
            if method == "POST":
                if not same_origin(request):
                    return forbidden("cross-origin request refused")
                request.state.form = await read_form(request)
                if request.state.form is None:
                    return PlainTextResponse("a form of at most 64 KiB of UTF-8 is expected", status_code=400,
                                             headers=no_store())
                token = request.headers.get("x-csrf-token") or request.state.form.get("csrf", "")
                if not hmac.compare_digest(token.encode(errors="surrogatepass"), session.csrf.encode()):
                    return forbidden("the form's CSRF token is missing or stale: reload the page")
            request.state.console_session = session
            return await handler(request)
        app.add_api_route(path, guarded, methods=[method], include_in_schema=False)

    def mount(self, app: FastAPI) -> None:
        app.add_api_route(PREFIX + "/login", self.login_form, methods=["GET"], include_in_schema=False)
        app.add_api_route(PREFIX + "/login", self.login, methods=["POST"], include_in_schema=False)
        app.add_api_route(PREFIX + "/static/{name:path}", self.static_file, methods=["GET"], include_in_schema=False)
        self.action(app, PREFIX + "/logout", self.logout)
        self.page(app, PREFIX + "/benchmarks", self.benchmark_page)
        self.page(app, PREFIX + "/benchmarks/{name}", self.benchmark_image)

    async def static_file(self, request: Request) -> Response:
        return self.static.response(request.path_params["name"])

    async def login_form(self, request: Request) -> Response:
        if self.sessions.get(request.cookies.get(COOKIE)) is not None:
            return RedirectResponse(PREFIX, status_code=303, headers=no_store())
        return self._login_page(request, None, 200)

    def _login_page(self, request: Request, error: str | None, status: int) -> Response:
        token = secrets.token_urlsafe(24)  # double-submitted: a cross-site page cannot read or set the cookie
        response = self.render(request, "login.html", status, error=error, login_token=token)
        response.set_cookie(LOGIN_COOKIE, token, max_age=900, path=PREFIX + "/login", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
        return response

    async def login(self, request: Request) -> Response:
        who = request.client.host if request.client else "-"
        form = await read_form(request)
        if not same_origin(request) or form is None:
            return forbidden("cross-origin login refused")
        expected = request.cookies.get(LOGIN_COOKIE, "")
        if not expected or not hmac.compare_digest(form.get("login_token", "").encode(errors="surrogatepass"),
                                                   expected.encode()):
            return self._login_page(request, "The login form expired; try again.", 403)
        if self.throttle.blocked(who):
            return self._login_page(request, "Too many failed logins from this address; wait a few minutes.", 429)
        if not self.sessions.is_admin_key(form.get("admin_key", "")):
            self.throttle.failed(who)
            return self._login_page(request, "That is not the admin key.", 401)
        response = RedirectResponse(PREFIX, status_code=303, headers=no_store())
        response.set_cookie(COOKIE, self.sessions.open(), path=PREFIX, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        response.delete_cookie(LOGIN_COOKIE, path=PREFIX + "/login", httponly=True, samesite="strict")
        return response

    async def logout(self, request: Request) -> Response:
        self.sessions.close(request.cookies.get(COOKIE))
        response = RedirectResponse(PREFIX + "/login", status_code=303, headers=no_store())
        response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return response

    async def benchmark_page(self, request: Request) -> Response:
        return self.render(request, "benchmarks.html", images=self.benchmarks.latest(),
                           docs_dir=self.benchmarks.docs_dir)

    async def benchmark_image(self, request: Request) -> Response:
        data = self.benchmarks.read(request.path_params["name"])
        if data is None:
            return PlainTextResponse("no such benchmark image", status_code=404, headers=no_store())
        return Response(data, media_type="image/png", headers=no_store())


def no_store() -> dict[str, str]:
    return {**SECURITY_HEADERS, "cache-control": "no-store"}


def refusal(request: Request) -> Response:
    """No session: a page asked for by the browser goes to the login form; anything else (htmx, an image, a
    POST) gets a 401, which htmx turns into a visit to the login form."""
    if request.method == "GET" and "hx-request" not in request.headers \
            and "text/html" in request.headers.get("accept", ""):
        return RedirectResponse(PREFIX + "/login", status_code=303, headers=no_store())
    return PlainTextResponse("log in to the console first", status_code=401,
                             headers={**no_store(), "hx-redirect": PREFIX + "/login"})


def forbidden(message: str) -> Response:
    return PlainTextResponse(message, status_code=403, headers=no_store())


def same_origin(request: Request) -> bool:
    """A POST's Origin (sent by every current browser) must name this host; without one, Sec-Fetch-Site may not
    say cross-site. Scripts that send neither pass on to the CSRF token."""
    origin = request.headers.get("origin")
    if origin is not None:
        return origin != "null" and urlsplit(origin).netloc == request.headers.get("host")
    return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")


async def read_form(request: Request) -> dict[str, str] | None:
    """A urlencoded form, at most FORM_BYTES; None when it is larger or not UTF-8. One value per name."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > FORM_BYTES:
            return None
        chunks.append(chunk)
    try:
        fields = parse_qs(b"".join(chunks).decode(), keep_blank_values=True, max_num_fields=200,
                          errors="strict")
    except (UnicodeDecodeError, ValueError):
        return None
    return {name: values[0] for name, values in fields.items()}
