"""Shared pieces of the web console tests: Debian's headless Chromium driven by Playwright (never a downloaded
browser), logging in, what the browser asked for, screenshots, and the checks every console must pass."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
XSS = '<img src=x onerror="window.__xss=1">'  # what an attacker would name a user, a document or write in a prompt


def playwright_browser():
    """(playwright, browser), or a skip saying what is missing."""
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium): the console tests need a real "
                    "browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed (pip install playwright; never `playwright "
                    "install`: the tests drive /usr/bin/chromium)")
    from playwright.sync_api import expect

    expect.set_options(timeout=20_000)
    driver = sync_playwright().start()
    browser = driver.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
                                     headless=True, args=FLAGS)
    return driver, browser


def screenshot_dir(tmp_path_factory, name: str) -> Path:
    """$PAGEDSERVE_SCREENSHOTS/name when set (CI collects it), else a folder under pytest's tmp."""
    root = os.environ.get("PAGEDSERVE_SCREENSHOTS")
    if root:
        folder = Path(root) / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return tmp_path_factory.mktemp(name)


@dataclass
class Watch:
    """What the pages of one browser context asked of the server, and what went wrong in them."""
    origin: str
    requests: set[tuple[str, str]] = field(default_factory=set)  # (method, path with query)
    errors: list[str] = field(default_factory=list)  # console errors (a CSP violation is one) and page errors
    bodies: list[str] = field(default_factory=list)  # every text answer the browser got

    def attach(self, context) -> None:
        context.on("request", self._request)
        context.on("response", self._response)
        context.on("console", self._console)
        context.on("weberror", lambda e: self.errors.append(str(e.error)))

    def _console(self, message) -> None:
        # A refused CSP rule or a script error is an error; a 4xx the test asked for (a form refused) is not.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            self.errors.append(message.text)

    def _request(self, request) -> None:
        if not request.url.startswith(self.origin):
            self.errors.append(f"a request left the server: {request.url}")
            return
        parts = urlsplit(request.url)
        self.requests.add((request.method, parts.path + (f"?{parts.query}" if parts.query else "")))

    def _response(self, response) -> None:
        if response.status >= 500:
            self.errors.append(f"{response.status} from {response.url}")
        from playwright.sync_api import Error

        kind = response.headers.get("content-type", "")
        if kind.startswith(("text/", "application/json")) and not 300 <= response.status < 400:
            with contextlib.suppress(Error):  # a page left before its body arrived: nothing to read
                self.bodies.append(response.text())


@contextlib.contextmanager
def console_page(browser, base: str, admin_key: str, shots: Path):
    """A logged-in page in a fresh browser context (confirm() dialogs accepted), its Watch as `page.watch` and a
    `page.shot(name)` that saves a full-page screenshot; at the end, no console error (a refused CSP rule is one)
    and no request to anywhere but the server."""
    context = browser.new_context(viewport=DESKTOP)
    context.on("dialog", lambda dialog: dialog.accept())
    watch = Watch(base)
    watch.attach(context)
    page = context.new_page()
    login(page, base, admin_key)
    page.watch = watch
    page.shot = lambda name: page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    yield page
    context.close()
    assert watch.errors == []


def login(page, base: str, admin_key: str) -> None:
    page.goto(base + "/ui")
    assert urlsplit(page.url).path == "/ui/login"  # no session yet: the login form, not the console
    page.fill("#admin_key", admin_key)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/ui")


def check_cookie(context, admin_key: str) -> None:
    """The session cookie: HttpOnly, SameSite=Strict, scoped to /ui, and not the admin key."""
    cookies = [c for c in context.cookies() if c["name"] == "pagedserve_console"]
    assert len(cookies) == 1, context.cookies()
    cookie = cookies[0]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert admin_key not in cookie["value"]


def check_refused(base: str, watch: Watch, admin_key: str, posts: list[str]) -> int:
    """Every GET the pages made, and every form action, without a session: refused, and nothing of the page's
    data in the answer. The static files (the libraries and the stylesheet, public by design) and the login form
    are the only exceptions. Returns how many URLs were checked."""
    gets = sorted(path for method, path in watch.requests if method == "GET"
                  and not path.startswith(("/ui/static/", "/ui/login")))
    assert len(gets) >= 5, gets
    with httpx.Client(base_url=base, timeout=10) as client:
        for path in gets:
            for accept in ("text/html", "*/*"):
                answer = client.get(path, headers={"accept": accept}, follow_redirects=False)
                assert answer.status_code in (303, 401), (path, answer.status_code)
                if answer.status_code == 303:
                    assert answer.headers["location"] == "/ui/login"
                assert len(answer.content) < 64, (path, answer.text[:200])  # a refusal, not the page
            htmx = client.get(path, headers={"hx-request": "true"})
            assert htmx.status_code == 401 and htmx.headers["hx-redirect"] == "/ui/login"
            wrong = client.get(path, headers={"authorization": f"Bearer {admin_key}x"}, follow_redirects=False)
            assert wrong.status_code in (303, 401)
        for path in posts:
            answer = client.post(path, data={"csrf": "guess"}, headers={"origin": base}, follow_redirects=False)
            assert answer.status_code == 401, (path, answer.status_code)
    for body in watch.bodies:  # the key typed into the login form never comes back in any answer
        assert admin_key not in body
    assert not any(admin_key in path for _, path in watch.requests)  # nor in any URL
    return len(gets)


def check_csrf(context, base: str, path: str) -> None:
    """With a live session (the browser's cookie), a POST without the page's token, or from another origin, is
    refused."""
    cookie = next(c for c in context.cookies() if c["name"] == "pagedserve_console")
    with httpx.Client(base_url=base, cookies={cookie["name"]: cookie["value"]}, timeout=10) as client:
        bare = client.post(path, data={"user": "mallory"}, headers={"origin": base}, follow_redirects=False)
        assert bare.status_code == 403 and "CSRF" in bare.text
        page = client.get("/ui", follow_redirects=False)
        token = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
        foreign = client.post(path, data={"csrf": token, "user": "mallory"}, headers={"origin": "https://evil.example"},
                              follow_redirects=False)
        assert foreign.status_code == 403


def no_overflow(page) -> bool:
    """Nothing wider than the window (wide tables scroll inside their own box)."""
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")


def no_xss(page) -> None:
    assert page.evaluate("window.__xss === undefined")
    assert page.locator("img[src=x]").count() == 0
