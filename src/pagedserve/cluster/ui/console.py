"""The router's web console at /ui: its replicas (region, role, health, KV usage, queue, running and waiting
requests, preemptions, tokens per second, prefix-cache hit rate, KV transfers), refreshed every two seconds, and
the last requests' routing (why each went where it went, and its prefill hand-off when disaggregated).

It opens only when the router has an admin key (`admin_key_env` in its config, or `--admin-key-env`); the
security rules are web.py's. It reads the router's own state and the replicas' /metrics, and changes nothing."""
from __future__ import annotations

from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from pagedserve.cluster.cluster_config import ClusterConfig
from pagedserve.cluster.router import Router
from pagedserve.cluster.ui.journal import RequestJournal
from pagedserve.cluster.ui.scrape import Scraper
from pagedserve.cluster.ui.web import PREFIX, Console

NAV = [(PREFIX, "Replicas"), (PREFIX + "/requests", "Requests")]


class ClusterConsole:
    def __init__(self, config: ClusterConfig, admin_key: str):
        self.config = config
        self.journal = RequestJournal()
        self.web = Console("pagedserve router", admin_key, NAV,
                           docs_dir=Path(config.docs_dir) if config.docs_dir else None)
        self.router: Router | None = None
        self.scraper: Scraper | None = None

    def attach(self, router: Router, client: httpx.AsyncClient) -> None:
        """Called once the router exists (in the app's lifespan): from then on every routing choice is journaled."""
        self.router = router
        router.listeners.append(self.journal)
        self.scraper = Scraper(router.replicas, client)

    def mount(self, app: FastAPI) -> None:
        self.web.mount(app)
        self.web.page(app, PREFIX, self.overview)
        self.web.page(app, PREFIX + "/replicas", self.replicas)
        self.web.page(app, PREFIX + "/requests", self.requests)
        self.web.page(app, PREFIX + "/requests/rows", self.request_rows)

    async def _replica_context(self) -> dict:
        views = await self.scraper.views()
        rates = [v.stats.tokens_per_s for v in views if v.stats and v.stats.tokens_per_s is not None]
        tokens = self.scraper.series("tokens_per_s") | {"y": "count", "empty": "Collecting samples…"}
        kv = self.scraper.series("kv_usage") | {"y": "ratio", "empty": "Collecting samples…"}
        return {"views": views, "router": self.router, "healthy": sum(r.healthy for r in self.router.replicas),
                "tokens_per_s": sum(rates) if rates else None, "tokens_chart": tokens, "kv_chart": kv}

    async def overview(self, request: Request) -> Response:
        return self.web.render(request, "cluster.html", heading="Replicas", **await self._replica_context())

    async def replicas(self, request: Request) -> Response:
        return self.web.render(request, "cluster_replicas.html", **await self._replica_context())

    async def requests(self, request: Request) -> Response:
        return self.web.render(request, "cluster_requests.html", heading="Requests", entries=self.journal.recent(),
                               router=self.router)

    async def request_rows(self, request: Request) -> Response:
        return self.web.render(request, "cluster_request_rows.html", entries=self.journal.recent(),
                               router=self.router)


def mount_console(app: FastAPI, config: ClusterConfig) -> ClusterConsole | None:
    """The console, or (no admin key) a /ui that says how to turn it on."""
    admin_key = config.console_key()
    if not admin_key:
        async def off(_: Request) -> Response:
            return PlainTextResponse("the router's console is off: give the router an admin key (admin_key_env in "
                                     "its config, or --admin-key-env)", status_code=404)
        app.add_api_route(PREFIX, off, methods=["GET"], include_in_schema=False)
        return None
    console = ClusterConsole(config, admin_key)
    console.mount(app)
    return console
