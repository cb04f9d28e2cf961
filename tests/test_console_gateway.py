"""The gateway's web console in a real headless Chromium (Debian's, driven by Playwright) against a real
`pagedserve gateway` in front of the stand-in provider (tests/gateway_stub_provider.py: instant answers, and
failures on demand for the breaker).

Log in; create a key (its secret shown once), use it through the gateway, see its spend and its trace appear,
open the trace; edit its limits (bad values refused with a message), revoke it and see its next request refused;
the cache's verdicts, a source invalidated, the near-miss guard's rejection; what a route retrieves; a provider's
breaker opening live; every page and call the pages make refused without a session, and forms without their CSRF
token; a user name, a document name and a prompt that carry HTML shown as text; pages usable at 1280 px and at a
phone's width. Screenshots go to $PAGEDSERVE_SCREENSHOTS/console-gateway, or a folder under pytest's tmp.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx
import pytest

from pagedserve.gateway.tracing import Trace, TraceSink
from pagedserve.gateway.ui.forms import read_key_form
from pagedserve.gateway.ui.reports import Reports, TraceFilter
from tests.console_support import (
    PHONE,
    XSS,
    check_cookie,
    check_csrf,
    check_refused,
    console_page,
    no_overflow,
    no_xss,
    playwright_browser,
    screenshot_dir,
)
from tests.gateway_support import gateway, set_stub_mode, start_all, stub_provider
from tests.polling import wait_for

ADMIN = "console-admin-" + secrets.token_hex(8)
DOCS = Path(__file__).resolve().parents[1] / "docs"
LEAVE = "# Leave\n\nEmployees get 30 days of paid leave a year. Parental leave in Germany lasts up to three years.\n"
TRAVEL = "# Travel\n\nTrains are booked in second class; flights only above 500 km. Hotels up to 150 EUR a night.\n"
SEED = "What is the parental leave policy in Germany?"
NEGATED = "What is NOT the parental leave policy in Germany?"  # 0.98 alike: the guard keeps them apart
POSTS = ["/ui/keys", "/ui/keys/0123456789ab/limits", "/ui/keys/0123456789ab/revoke", "/ui/cache/sources/handbook/invalidate",
         "/ui/logout"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-stack")
    docs = tmp / "docs"
    docs.mkdir()
    shutil.copy(DOCS / "serve_benchmark.png", docs / "serve_benchmark.png")
    with contextlib.ExitStack() as stack:
        driver, browser = playwright_browser()  # first: without chromium, skip before starting anything
        stack.callback(driver.stop)
        stack.callback(browser.close)
        stub, stub_url = stub_provider("stub", tmp)
        start_all(stack, stub)
        config = {
            "timezone": "UTC", "docs_dir": str(docs), "budgets": {"user_daily_usd": 5.0},
            "breaker": {"failure_threshold": 2, "reset_s": 600},
            "retry": {"attempts_per_provider": 1, "backoff_s": 0.01, "request_deadline_s": 10},
            "providers": {"stub": {"base_url": stub_url + "/v1", "timeout_s": 5,
                                   "models": {"small": {"name": "stand-in", "input": 1.0, "output": 2.0}}}},
            "routes": {"chat": {"small": ["stub/small"], "sources": ["handbook"]},
                       "rag": {"small": ["stub/small"], "retrieval": {"source": "handbook", "k": 2, "min_score": None}}},
        }
        process, url = gateway("gw", config, tmp, ADMIN)
        stack.enter_context(process)
        added = httpx.post(url + "/admin/index/handbook/documents", headers={"authorization": f"Bearer {ADMIN}"},
                           timeout=120, json={"documents": [{"name": "leave.md", "content": LEAVE},
                                                            {"name": XSS + ".md", "content": TRAVEL}]})
        assert added.status_code == 200, added.text
        yield {"url": url, "stub": stub_url, "browser": browser,
               "shots": screenshot_dir(tmp_path_factory, "console-gateway")}


@pytest.fixture
def page(stack):
    with console_page(stack["browser"], stack["url"], ADMIN, stack["shots"]) as page:
        yield page


def chat(url: str, key: str, content: str, model: str = "chat") -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
                            "max_tokens": 8})


def create_key(page, user: str, team: str = "", budget: str = "") -> tuple[str, str]:
    """Through the form: (key id, secret)."""
    page.goto(page.url.split("/ui")[0] + "/ui/keys")
    form = page.locator("#create-key")
    form.locator("input[name=user]").fill(user)
    form.locator("input[name=team]").fill(team)
    form.locator("input[name=daily_budget_usd]").fill(budget)
    form.locator("button[type=submit]").click()
    secret = page.locator("#new-secret").inner_text().strip()
    key_id = page.locator("#new-key code").first.inner_text().strip()
    return key_id, secret


@pytest.mark.slow
def test_key_lifecycle_spend_trace_and_revocation(stack, page):
    from playwright.sync_api import expect

    url = stack["url"]
    check_cookie(page.context, ADMIN)
    page.shot("overview")
    key_id, secret = create_key(page, "alice", "hr", "0.5")
    assert secret.startswith("sk-ps-")
    page.shot("key-created")
    page.reload()  # sends the form again: refused, no second key, and the secret is not shown again
    expect(page.locator("#key-errors")).to_contain_text("sent already")
    assert secret not in page.content()
    assert page.locator("#keys td.user", has_text="alice").count() == 1
    expect(page.locator(f"tr[data-key='{key_id}'] .state")).to_have_text("active")

    answer = chat(url, secret, "Where are the trains booked?")
    assert answer.status_code == 200, answer.text
    trace_id = answer.headers["x-gateway-trace-id"]
    cost = 3 * 1.0 / 1e6 + 2 * 2.0 / 1e6  # the stand-in's usage at the route's prices

    page.goto(url + f"/ui/spend?scope=key:{key_id}")
    expect(page.locator(f"tr[data-scope='key:{key_id}'] .today")).to_have_text(f"${cost:.9f}".rstrip("0"))
    expect(page.locator("#chart-scope .u-legend")).to_contain_text("daily budget")  # the budget line
    assert page.locator("#chart-scope canvas").count() == 1
    expect(page.locator("#spend-by-route")).to_contain_text("chat")
    expect(page.locator("#spend-by-team")).to_contain_text("hr")
    page.shot("spend")

    page.goto(url + f"/ui/traces?key={key_id}")
    row = page.locator(f"tr[data-trace='{trace_id}']")
    expect(row).to_contain_text("chat")
    expect(row).to_contain_text("200")
    page.shot("traces")
    row.locator("a").click()
    page.wait_for_url(url + f"/ui/traces/{trace_id}")
    expect(page.locator("#attempts")).to_contain_text("stub")
    expect(page.locator("#attempts")).to_contain_text("200")
    expect(page.locator("#trace-summary")).to_contain_text("stand-in")
    page.shot("trace-detail")

    page.goto(url + "/ui/keys")  # limits: refused with a message, then saved
    row = page.locator(f"tr[data-key='{key_id}']")
    row.locator("summary").click()  # the form opens; after a refusal it comes back open, with the message
    for bad, message in (("0", "requests per minute “0”"), ("ten", "requests per minute “ten”")):
        row.locator("form.edit-key input[name=rpm]").fill(bad)
        row.locator("form.edit-key button").click()
        expect(row.locator(".notice.error")).to_contain_text(message)
    row.locator("form.edit-key input[name=rpm]").fill("120")
    row.locator("form.edit-key button").click()
    expect(page.locator(".notice.ok")).to_contain_text(key_id)
    expect(row.locator("td").nth(5)).to_have_text("120")
    check_csrf(page.context, url, f"/ui/keys/{key_id}/limits")

    row.locator("form.revoke button").click()
    expect(page.locator(f"tr[data-key='{key_id}'] .state")).to_contain_text("revoked")
    page.shot("key-revoked")
    refused = chat(url, secret, "Where are the trains booked?")
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    page.goto(url + "/ui/traces?status=401")
    expect(page.locator(f"tr[data-trace='{refused.headers['x-gateway-trace-id']}']")).to_contain_text("401")


@pytest.mark.slow
def test_cache_verdicts_invalidation_guard_and_retrieval(stack, page):
    from playwright.sync_api import expect

    url = stack["url"]
    _, secret = create_key(page, "bob", "ops")
    assert chat(url, secret, SEED).headers["x-gateway-cache"] == "miss"
    assert chat(url, secret, SEED).headers["x-gateway-cache"] == "hit"
    guarded = chat(url, secret, NEGATED)
    assert guarded.headers["x-gateway-cache"] == "miss"
    page.goto(url + "/ui/cache")
    assert int(page.locator("#total-hit").inner_text()) >= 1
    expect(page.locator("#rejections")).to_contain_text(NEGATED.lower())  # the guard's latest, as text
    expect(page.locator("#chart-guard canvas")).to_have_count(1)
    version = page.locator("tr[data-source='handbook'] .version").inner_text()
    page.shot("cache")
    page.locator("tr[data-source='handbook'] button").click()
    expect(page.locator("#bumped")).to_contain_text(f"version {int(version) + 1}")
    stale = chat(url, secret, SEED)
    assert stale.headers["x-gateway-cache"] == "stale"
    page.goto(url + f"/ui/traces/{stale.headers['x-gateway-trace-id']}")
    expect(page.locator("#stale-reason")).to_contain_text("source handbook changed")

    rag = chat(url, secret, "How many days of paid leave do employees get?", model="rag")
    assert rag.status_code == 200
    page.goto(url + f"/ui/traces/{rag.headers['x-gateway-trace-id']}")
    expect(page.locator("#chunks")).to_contain_text("leave.md")
    page.goto(url + "/ui/retrieval")
    page.select_option("select[name=target]", "route:rag")
    page.fill("input[name=q]", "paid leave days")
    page.click("#search-form button")
    expect(page.locator("#search-results tbody tr").first).to_contain_text("leave.md")  # swapped in by htmx
    assert "/ui/retrieval/search?" in " ".join(path for _, path in page.watch.requests)
    page.shot("retrieval")


@pytest.mark.slow
def test_html_in_a_user_name_a_document_name_and_a_prompt_is_shown_as_text(stack, page):
    from playwright.sync_api import expect

    url = stack["url"]
    page.goto(url + "/ui/keys")
    page.fill("#create-key input[name=user]", XSS)
    page.click("#create-key button[type=submit]")
    expect(page.locator("#key-errors")).to_contain_text(f"user “{XSS}”")
    assert page.locator("#create-key input[name=user]").input_value() == XSS
    no_xss(page)

    page.goto(url + "/ui/retrieval")
    page.locator("[data-source='handbook'] summary").click()
    expect(page.locator("td.document", has_text="onerror")).to_have_text(XSS + ".md")
    no_xss(page)

    _, secret = create_key(page, "carol")
    prompt = f"<script>window.__xss=1</script>{XSS} what is the travel policy?"
    assert chat(url, secret, prompt).status_code == 200
    page.goto(url + "/ui/cache")
    expect(page.locator("td.query", has_text="onerror").first).to_have_text(prompt)
    no_xss(page)
    page.shot("xss-as-text")


@pytest.mark.slow
def test_every_page_refused_without_a_session_and_usable_on_a_phone(stack, page):
    from playwright.sync_api import expect

    url = stack["url"]
    pages = ["/ui", "/ui/keys", "/ui/spend", "/ui/traces", "/ui/cache", "/ui/providers", "/ui/retrieval",
             "/ui/benchmarks"]
    trace_id = json.loads(httpx.get(url + "/admin/traces?limit=1", timeout=10,
                                    headers={"authorization": f"Bearer {ADMIN}"}).text)["data"][0]["trace_id"]
    for path in pages + [f"/ui/traces/{trace_id}"]:
        page.goto(url + path)
        assert page.url == url + path  # a page, not the login form
    page.goto(url + "/ui/benchmarks")
    image = page.locator("img.bench")
    expect(image).to_have_count(1)
    wait_for(lambda: image.evaluate("i => i.complete && i.naturalWidth > 0"), 10, "the benchmark PNG to load")
    page.shot("benchmarks")
    page.goto(url + "/ui/providers")
    expect(page.locator("#provider-table")).to_contain_text("stub")
    page.wait_for_event("response", lambda r: "/ui/providers/rows" in r.url)  # its live refresh is a page call too
    checked = check_refused(url, page.watch, ADMIN, POSTS)
    assert checked >= len(pages)

    page.set_viewport_size(PHONE)
    for path in pages:
        page.goto(url + path)
        assert no_overflow(page), path
        page.shot("phone" + path.replace("/", "-"))
    page.goto(url + "/ui/keys")
    assert page.locator("#create-key input[name=user]").is_visible()


@pytest.mark.slow
def test_provider_breaker_opens_live(stack, page):
    """Last: the stand-in's breaker stays open for the rest of the module."""
    from playwright.sync_api import expect

    url = stack["url"]
    _, secret = create_key(page, "dave")
    page.goto(url + "/ui/providers")
    expect(page.locator("tr[data-provider='stub'] .breaker")).to_contain_text("closed")
    set_stub_mode(stack["stub"], "fail")
    try:
        for _ in range(2):
            assert chat(url, secret, f"fail {secrets.token_hex(4)}").status_code == 502
        expect(page.locator("tr[data-provider='stub'] .breaker")).to_contain_text("open")  # no reload: htmx polls
        expect(page.locator("tr[data-provider='stub']")).to_contain_text("500")
        page.shot("providers-breaker-open")
        assert chat(url, secret, "one more").status_code == 503
    finally:
        set_stub_mode(stack["stub"], "ok")


# Fast checks of the pieces under the pages (no browser, no process).

def run(work):
    """A coroutine's result, on a thread of its own: Playwright's sync API may hold this thread's event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


def test_vendored_assets_match_their_manifest_and_pages_load_nothing_from_elsewhere():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "vendor_console_assets.py"), "--check"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    vendor = root / "src" / "pagedserve" / "cluster" / "ui" / "static" / "vendor"
    manifest = json.loads((vendor / "manifest.json").read_text())
    assert {p["name"]: (p["version"], p["license"]) for p in manifest["packages"]} == {
        "htmx.org": ("2.0.11", "0BSD"), "uplot": ("1.6.32", "MIT")}
    assert "Permission" in (vendor / "uplot" / "LICENSE").read_text()
    assert "Zero-Clause BSD" in (vendor / "htmx" / "LICENSE").read_text()
    templates = [*(root / "src" / "pagedserve").glob("*/ui/templates/*.html")]
    assert len(templates) > 10
    for template in templates:
        assert not re.search(r"(src|href|action)=[\"']?(https?:)?//", template.read_text()), template


def test_key_form_reads_what_the_admin_api_reads():
    form = read_key_form({"user": "alice", "team": "", "models": "chat, rag", "rpm": "60",
                          "daily_budget_usd": "1.5", "csrf": "x"})
    assert form.errors == [] and form.key.model_dump() == {
        "user": "alice", "team": None, "models": ["chat", "rag"], "residency": None, "rpm": 60, "tpm": None,
        "daily_budget_usd": 1.5}
    for name, bad in (("rpm", "0"), ("rpm", "1e3"), ("tpm", "-5"), ("daily_budget_usd", "inf"), ("user", ""),
                      ("residency", "e u"), ("models", "chat,<b>"), ("team", XSS)):
        form = read_key_form({"user": "alice", name: bad})
        assert form.key is None and len(form.errors) == 1, (name, bad, form.errors)
        assert f"“{bad}”" in form.errors[0]  # names the value typed: the page prints it as text
    edited = read_key_form({"user": "mallory", "rpm": "5"}, user="alice")
    assert edited.key.user == "alice" and edited.key.rpm == 5


def test_trace_reports_filter_paginate_and_sum_per_day_in_the_gateway_zone(tmp_path):
    sink = TraceSink(tmp_path / "traces.db")
    start = time.time() - 2 * 86400
    for i in range(120):
        trace = Trace(started_at=start + i * 1200, key_id="aaaaaaaaaaaa" if i % 2 else "bbbbbbbbbbbb",
                      route="rag" if i % 3 == 0 else "chat", tier="small", cache="hit" if i % 4 == 0 else "miss",
                      provider="p1", cost_usd=0.25, latency_ms=float(i),
                      attempts=[{"provider": "p1", "model": "m", "status": "500" if i % 5 == 0 else "200",
                                 "latency_ms": float(i), "error": "down" if i % 5 == 0 else None,
                                 "started_at": start + i * 1200}])
        trace.status = 429 if i % 10 == 0 else 200
        sink.write(trace)
    sink.close()
    tz = ZoneInfo("Pacific/Auckland")  # far from UTC: a day boundary that is not the server's
    reports = Reports(tmp_path / "traces.db", None, tz)
    rows, total = run(reports.page(TraceFilter(), 3, 50))
    assert total == 120 and len(rows) == 20 and rows[0]["latency_ms"] == 19.0  # newest first: the third page
    rows, total = run(reports.page(TraceFilter(status="4xx"), 1, 50))
    assert total == 12 and {r["status"] for r in rows} == {429}
    _, total = run(reports.page(TraceFilter(route="rag", key_id="bbbbbbbbbbbb", cache="hit"), 1, 50))
    assert total == sum(1 for i in range(120) if i % 3 == 0 and i % 2 == 0 and i % 4 == 0)
    _, total = run(reports.page(TraceFilter(min_latency_ms=100, since=start + 101 * 1200), 1, 50))
    assert total == 19
    per_day = run(reports.cost_by("route", 30))
    expected: dict[str, float] = {}
    for i in range(120):
        day = datetime.fromtimestamp(start + i * 1200, tz).date().isoformat()
        expected[day] = expected.get(day, 0.0) + 0.25
    assert {d: round(sum(c for c, _ in v.values()), 6) for d, v in per_day.items()} == expected
    stats = run(reports.providers(start - 1))["p1"]
    assert (stats.attempts, stats.failures, stats.last_error) == (120, 24, "500: down")
    assert stats.percentile(0.5) == statistics.median(float(i) for i in range(120) if i % 5)
    reports.close()
