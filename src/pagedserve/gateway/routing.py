"""Stage 3, route by difficulty: the small or the large tier of a route, pinned by the request or chosen by
the classifier (its lexical guess picks the tier of a speculative call before the embedding is ready)."""
from __future__ import annotations

from pagedserve.gateway.call import Call
from pagedserve.gateway.query_vectors import QueryVectors
from pagedserve.gateway.semantic_cache import normalise


class TierRouter:
    def __init__(self, classifier, vectors: QueryVectors):
        self.classifier = classifier
        self.vectors = vectors

    def classifies(self, call: Call) -> bool:
        return call.request.route is None and bool(call.route.large) and self.classifier is not None

    async def choose_tier(self, call: Call) -> None:
        req, trace = call.request, call.trace
        if req.route is not None:
            call.tier, trace.pinned = req.route, True
        elif self.classifies(call):
            text = self._text(call)
            if text:
                score = self.classifier.score(normalise(text), await self.vectors.vector(text))
                trace.classifier_score = round(score, 4)
                call.tier = "large" if score >= call.route.hard_threshold else "small"
        trace.tier = call.tier

    def guess_tier(self, call: Call) -> str:
        """The likely tier without the embedding: the pinned one, else the classifier's lexical guess."""
        tier = call.request.route or "small"
        text = self._text(call)
        if text and self.classifies(call):
            tier = "large" if self.classifier.guess(normalise(text)) >= call.route.hard_threshold else "small"
        return tier

    @staticmethod
    def _text(call: Call) -> str | None:
        return call.query if call.query is not None else call.request.query()[0]
