"""Retrieval: the indexed knowledge sources with their versions and documents, the routes that retrieve from
them, and a search box that shows what a route would put into a request for a question (its source, k and
min_score, hybrid search: the same call a request makes), or what a source holds for it."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedserve.cluster.ui.web import PREFIX
from pagedserve.gateway.retrieval.indexer import IndexInputError
from pagedserve.gateway.ui.context import GatewayUI

MAX_QUESTION = 4000  # characters; the encoder reads 256 tokens, and says so past that


def mount(app: FastAPI, ui: GatewayUI) -> None:
    routes = {name: r.retrieval for name, r in ui.config.routes.items() if r.retrieval is not None}

    async def search(request: Request) -> dict:
        """The search box's answer: {target, question, hits, error, source, version}."""
        target = request.query_params.get("target", "")
        question = request.query_params.get("q", "")[:MAX_QUESTION]
        out = {"target": target, "question": question, "hits": None, "error": None, "source": None, "version": None}
        if not question.strip() or ui.library is None:
            return out
        kind, _, name = target.partition(":")
        if kind == "route" and name in routes:
            spec = routes[name]
            source, k, min_score = spec.source, spec.k, spec.min_score
        elif kind == "source":
            source, k, min_score = name, 5, None
        else:
            return out | {"error": "choose a route or a source"}
        try:
            version, hits = await ui.library.search(source, question, k, "hybrid", min_score)
        except IndexInputError as e:
            return out | {"error": str(e), "source": source}
        except LookupError as e:
            return out | {"error": str(e.args[0]), "source": source}
        return out | {"hits": [h.public() | {"text": h.chunk.text} for h in hits], "source": source,
                      "version": version, "k": k, "min_score": min_score}

    async def page(request: Request) -> Response:
        sources, documents = {}, {}
        if ui.library is not None:
            sources = await ui.library.sources()
            for source in sources:
                documents[source] = await ui.library.documents(source)
        return ui.web.render(request, "retrieval.html", heading="Retrieval", enabled=ui.library is not None,
                             sources=sources, documents=documents, routes=routes, result=await search(request))

    async def results(request: Request) -> Response:
        return ui.web.render(request, "retrieval_results.html", result=await search(request))

    ui.web.page(app, PREFIX + "/retrieval", page)
    ui.web.page(app, PREFIX + "/retrieval/search", results)
