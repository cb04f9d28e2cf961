"""The router's web console in a real headless Chromium (Debian's, driven by Playwright) against a real
`pagedserve router` over two real replicas, disaggregated (a prefill worker and a decode worker), so that one
page shows both the replicas' engines and the KV hand-offs.

Log in; both replicas healthy with their role, KV usage and queues from their /metrics; requests routed through
the router appear with the policy's reason, the candidates and the prefill hand-off, the prompt (carrying HTML)
shown as text; the KV transfer counters move; the prefill worker is stopped and the page, without a reload, shows
it unhealthy. Every page and call refused without a session; usable at a phone's width. Screenshots go to
$PAGEDSERVE_SCREENSHOTS/console-cluster, or a folder under pytest's tmp.
"""
from __future__ import annotations

import contextlib
import re
import secrets
import shutil
from pathlib import Path

import httpx
import pytest

from pagedserve.cluster.app import create_app
from pagedserve.cluster.cluster_config import ClusterConfig, ReplicaSpec
from pagedserve.cluster.policies import Decision, RoutingRequest
from pagedserve.cluster.replica import Replica
from pagedserve.cluster.ui.journal import RequestJournal
from pagedserve.cluster.ui.web import Sessions
from tests.console_support import (
    PHONE,
    XSS,
    check_cookie,
    check_refused,
    console_page,
    no_overflow,
    no_xss,
    playwright_browser,
    screenshot_dir,
)
from tests.gateway_support import pagedserve_server, start_all
from tests.polling import wait_for
from tests.router_support import RouterProcess

ADMIN = "router-admin-" + secrets.token_hex(8)
DOCS = Path(__file__).resolve().parents[1] / "docs"
STORY = " Once upon a time, in a village by the sea, there lived an old fisherman who told stories every night."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster-stack")
    docs = tmp / "docs"
    docs.mkdir()
    shutil.copy(DOCS / "disagg.png", docs / "disagg.png")
    prefill, prefill_url = pagedserve_server("prefill", tmp, ["--kv-role", "prefill"])
    decode, decode_url = pagedserve_server("decode", tmp, ["--kv-role", "decode"])
    with contextlib.ExitStack() as stack:
        driver, browser = playwright_browser()  # first: without chromium, skip before starting anything
        stack.callback(driver.stop)
        stack.callback(browser.close)
        start_all(stack, prefill, decode)
        router = stack.enter_context(RouterProcess(
            tmp, admin_key=ADMIN, docs_dir=str(docs), disagg_min_prompt_tokens=0, health_interval_s=0.5,
            replicas=[{"url": prefill_url, "name": "prefill-0", "kv_role": "prefill", "region": "eu-west",
                       "tags": ["eu"]},
                      {"url": decode_url, "name": "decode-0", "kv_role": "decode", "region": "eu-west"}]))
        router.wait_healthy(["prefill-0", "decode-0"], timeout=60)
        model = httpx.get(decode_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield {"url": router.url, "browser": browser, "prefill": prefill, "model": model,
               "shots": screenshot_dir(tmp_path_factory, "console-cluster")}


@pytest.fixture
def page(stack):
    with console_page(stack["browser"], stack["url"], ADMIN, stack["shots"]) as page:
        yield page


def complete(stack, prompt: str) -> httpx.Response:
    answer = httpx.post(stack["url"] + "/v1/completions", timeout=120,
                        json={"model": stack["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer


@pytest.mark.slow
def test_refused_without_a_session_and_usable_on_a_phone(stack, page):
    from playwright.sync_api import expect

    url = stack["url"]
    check_cookie(page.context, ADMIN)
    complete(stack, "Hello" + STORY)
    for path in ("/ui", "/ui/requests", "/ui/benchmarks"):
        page.goto(url + path)
        assert page.url == url + path
    expect(page.locator("img.bench")).to_have_count(1)
    wait_for(lambda: page.locator("img.bench").evaluate("i => i.complete && i.naturalWidth > 0"), 10, "the PNG")
    page.goto(url + "/ui/requests")
    page.wait_for_event("response", lambda r: "/ui/requests/rows" in r.url)  # the live refresh is a page call too
    page.goto(url + "/ui")
    page.wait_for_event("response", lambda r: "/ui/replicas" in r.url)
    assert check_refused(url, page.watch, ADMIN, ["/ui/logout"]) >= 5

    page.set_viewport_size(PHONE)
    for path in ("/ui", "/ui/requests", "/ui/benchmarks"):
        page.goto(url + path)
        assert no_overflow(page), path
        page.shot("phone" + path.replace("/", "-"))


@pytest.mark.slow
def test_replicas_requests_and_a_replica_going_unhealthy(stack, page):
    from playwright.sync_api import expect

    url = stack["url"]
    prefill = page.locator("#replica-table tr[data-replica='prefill-0']")
    decode = page.locator("#replica-table tr[data-replica='decode-0']")
    expect(prefill.locator(".health")).to_have_text("healthy")
    expect(decode.locator(".health")).to_have_text("healthy")
    expect(prefill).to_contain_text("prefill")
    expect(prefill).to_contain_text("eu-west")
    expect(decode.locator(".kv")).to_contain_text("blocks")  # from the replica's own /metrics
    expect(page.locator("[data-testid=healthy-count]")).to_have_text("2 / 2")

    prompt = XSS + STORY * 2
    complete(stack, prompt)
    complete(stack, "Another tale:" + STORY)
    # The page refreshes itself: the decode worker's pulled blocks appear without a reload.
    moved = page.locator("#transfers tr[data-replica='decode-0'] .blocks-in")
    wait_for(lambda: moved.inner_text() not in ("", "0"), 30, "the decode worker's pulled blocks on the page")
    expect(page.locator("#chart-tokens canvas")).to_have_count(1)
    page.shot("replicas")

    page.goto(url + "/ui/requests")
    row = page.locator("#request-table tbody tr", has=page.locator("td.prompt", has_text="onerror")).first
    expect(row.locator("td.prompt")).to_contain_text(XSS + STORY.rstrip()[:40])  # the prompt, as text
    no_xss(page)
    expect(row.locator(".routing")).to_contain_text("prefill")
    expect(row.locator(".routing")).to_contain_text("decode-0")
    expect(row.locator(".handoff")).to_contain_text("handed_off")
    expect(row.locator(".handoff")).to_contain_text("leased")
    page.shot("requests")

    page.goto(url + "/ui")
    stack["prefill"].__exit__()  # SIGTERM: the worker drains and exits
    expect(prefill.locator(".health")).to_contain_text("unhealthy")  # no reload: htmx polls
    expect(page.locator("[data-testid=healthy-count]")).to_have_text("1 / 2")
    expect(decode.locator(".health")).to_have_text("healthy")
    page.shot("replica-unhealthy")
    complete(stack, "Still served:" + STORY)  # the decode worker computes the prompt itself
    page.goto(url + "/ui/requests")
    expect(page.locator("#request-table tbody tr").first.locator(".routing")).to_contain_text("decode-0")


# Fast checks of the console kit's login, sessions and form checks (in-process: no browser, no replica).

def test_login_sessions_csrf_and_throttling_in_process():
    from fastapi.testclient import TestClient

    config = ClusterConfig(replicas=[ReplicaSpec("http://127.0.0.1:9", "r0")], admin_key=ADMIN).finalize()
    with TestClient(create_app(config), base_url="http://console.test") as client:
        origin = {"origin": "http://console.test"}

        def form_token() -> str:
            return re.search(r'name="login_token" value="([^"]+)"', client.get("/ui/login").text).group(1)

        assert client.get("/ui", headers={"accept": "text/html"}, follow_redirects=False).headers["location"] == "/ui/login"
        wrong = client.post("/ui/login", data={"admin_key": ADMIN + "x", "login_token": form_token()}, headers=origin)
        assert wrong.status_code == 401 and "not the admin key" in wrong.text and ADMIN not in wrong.text
        token = form_token()
        foreign = client.post("/ui/login", data={"admin_key": ADMIN, "login_token": token},
                              headers={"origin": "https://evil.example"})
        assert foreign.status_code == 403
        client.cookies.delete("pagedserve_console_login", path="/ui/login")  # a form whose cookie is gone
        assert client.post("/ui/login", data={"admin_key": ADMIN, "login_token": token}, headers=origin).status_code == 403
        answer = client.post("/ui/login", data={"admin_key": ADMIN, "login_token": form_token()}, headers=origin,
                             follow_redirects=False)
        assert answer.status_code == 303 and answer.headers["location"] == "/ui"
        cookie = answer.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
        page = client.get("/ui")
        assert page.status_code == 200 and ADMIN not in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["cache-control"] == "no-store" and page.headers["x-frame-options"] == "DENY"
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
        assert client.post("/ui/logout", data={"csrf": "stale"}, headers=origin).status_code == 403
        assert client.post("/ui/logout", data={"csrf": csrf}, headers=origin, follow_redirects=False).status_code == 303
        assert client.get("/ui/replicas").status_code == 401  # the session ended with the logout

        for _ in range(10):  # failed logins from one address: then refused, even with the right key
            client.post("/ui/login", data={"admin_key": "guess", "login_token": form_token()}, headers=origin)
        throttled = client.post("/ui/login", data={"admin_key": ADMIN, "login_token": form_token()}, headers=origin)
        assert throttled.status_code == 429


def test_sessions_expire_and_the_oldest_give_way():
    now = [0.0]
    sessions = Sessions("key", ttl_s=10, limit=2, clock=lambda: now[0])
    assert sessions.is_admin_key("key") and not sessions.is_admin_key("key ") and not sessions.is_admin_key("kéy")
    first, second = sessions.open(), sessions.open()
    third = sessions.open()
    assert sessions.get(first) is None and sessions.get(second) and sessions.get(third)
    assert sessions.get(third).csrf != sessions.get(second).csrf
    now[0] = 10.5
    assert sessions.get(third) is None and sessions.get(None) is None


def test_the_journal_keeps_the_last_requests_and_their_hand_offs():
    journal = RequestJournal(size=3)
    replicas = [Replica("p", "http://p", kv_role="prefill"), Replica("d", "http://d", kv_role="decode")]
    requests = [RoutingRequest(prefix_key=f"prompt {i} " + "x" * 400, est_tokens=50) for i in range(5)]
    for req in requests:
        journal.decided(req, Decision(replicas[0], "no_match"), replicas[:1], True, True, [])
        journal.prefilled(req, "p", "handed_off", 0.25, {"num_blocks": 4})
        journal.decided(req, Decision(replicas[1], "prefix_match", 200), replicas[1:], False, True, [])
    recent = journal.recent()
    assert [e.seq for e in recent] == [r.seq for r in reversed(requests[2:])]
    entry = recent[0]
    assert [c.pool for c in entry.choices] == ["prefill", "decode"] and entry.handoffs[0].blocks == 4
    assert len(entry.preview) == 160 and entry.prompt_units == len(requests[-1].prefix_key)
    assert entry.matched_fraction == 200 / entry.prompt_units
