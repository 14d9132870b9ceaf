"""POST /v1/rerank: the rerank API that Cohere, Jina, vLLM and Infinity
share, on a rerank model (`kind = "rerank"`), so their clients work as they
are.

Request: `model`, `query` (a string), `documents` (strings, or objects
`{"text": ...}` as Cohere v1 and Jina take them), `top_n` (default: every
document), `return_documents` (default false, as Cohere v1 and Infinity),
and `priority` (Triton's levels, as on the other endpoints). Answer:
`{"id", "object": "rerank", "model", "created", "results": [{"index",
"relevance_score", "document": {"text"}}], "usage"}`, highest score first.
`relevance_score` is the model's own score, the one KServe's `scores`
output carries.

It is one KServe infer call with `sort` (and `top_n`) set: the same
checks, and the same dynamic batcher as gRPC callers of the model. Fields
this server does not implement (`rank_fields`, `max_chunks_per_doc`,
`max_tokens_per_doc`, `raw_scores`, ...) are refused, as on the other /v1
endpoints.
"""

from __future__ import annotations

import time

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld.backends.model_config import (
    RERANK_DOCUMENTS, RERANK_INDICES, RERANK_QUERY, RERANK_SCORES, ModelKind,
)
from modeld.server.dataplane import DataPlane
from modeld.server.http.common import json_type_name, unless_client_leaves
from modeld.server.http.openai_fields import (
    IGNORED, FieldError, check_fields, get_bool, get_int, model_name, priority, takes_json_body,
)
from modeld.server.request_context import current_request_id
from modeld.server.requests import InferRequest

_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "priority"} | IGNORED


def routes(plane: DataPlane) -> list[Route]:
    return RerankApi(plane).routes()


class RerankApi:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def routes(self) -> list[Route]:
        return [Route("/v1/rerank", self.rerank, methods=["POST"])]

    @takes_json_body
    async def rerank(self, request: Request, body: dict) -> Response:
        model = model_name(body)
        check_fields(body, _FIELDS, "/v1/rerank")
        call = _RerankRequest(body)
        if (await self.plane.model(model)).kind is not ModelKind.RERANK:
            raise FieldError("model", f"model {model!r} is not a rerank model (kind = \"rerank\" in its "
                                      "model.toml); GET /v1/models lists the models")
        result = await unless_client_leaves(request, self.plane.infer(call.infer_request(model)))
        return JSONResponse(call.answer(model, result.outputs))


class _RerankRequest:
    def __init__(self, body: dict) -> None:
        self.query = body.get("query")
        if not isinstance(self.query, str) or not self.query:
            raise FieldError("query", "query must be a non-empty string")
        self.documents = _documents(body)
        self.top_n = get_int(body, "top_n")
        if self.top_n is not None and self.top_n < 1:
            raise FieldError("top_n", f"top_n must be >= 1, got {self.top_n}")
        self.return_documents = get_bool(body, "return_documents")
        self.priority = priority(body)

    def infer_request(self, model: str) -> InferRequest:
        documents = np.empty(len(self.documents), dtype=object)
        documents[:] = [d.encode() for d in self.documents]
        parameters = {"sort": True} | ({"top_n": self.top_n} if self.top_n is not None else {})
        return InferRequest(model, {RERANK_QUERY: np.array([self.query.encode()], dtype=object),
                                    RERANK_DOCUMENTS: documents},
                            parameters=parameters, priority=self.priority)

    def answer(self, model: str, outputs: dict[str, np.ndarray]) -> dict:
        results = []
        for index, score in zip(outputs[RERANK_INDICES].tolist(), outputs[RERANK_SCORES].tolist()):
            result = {"index": index, "relevance_score": score}
            if self.return_documents:
                result["document"] = {"text": self.documents[index]}
            results.append(result)
        request_id = current_request_id()
        # the tokenizer runs inside the backend, which reports no token
        # counts; 0 says "not counted" rather than a guess
        return {"id": f"rerank-{request_id}", "object": "rerank", "model": model, "created": int(time.time()),
                "results": results, "usage": {"prompt_tokens": 0, "total_tokens": 0}}


def _documents(body: dict) -> list[str]:
    value = body.get("documents")
    if not isinstance(value, list) or not value:
        raise FieldError("documents", "documents must be a non-empty array of strings (or of {\"text\": ...} objects)")
    texts = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and set(item) == {"text"} and isinstance(item["text"], str):
            item = item["text"]
        if not isinstance(item, str):
            raise FieldError(f"documents[{i}]", f"documents[{i}] must be a string or {{\"text\": <string>}}, "
                                                f"got {json_type_name(item)}")
        texts.append(item)
    return texts
