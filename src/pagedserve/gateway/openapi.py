"""The gateway's OpenAPI document: the routes read their bodies themselves (to bound and stream them), so
FastAPI cannot see the bodies' models; they are declared here, with the error shape every route may answer
and the bearer auth it takes, so that clients and fuzzers see what is really accepted."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def install_openapi(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]], streams: set[str]) -> None:
    """`bodies`: (path, method) -> the model of its JSON body; `streams`: paths that may answer an SSE stream."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, bodies, streams)
        return app.openapi_schema
    app.openapi = openapi


def _document(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]], streams: set[str]) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["Error"] = ERROR
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            op.pop("responses", None)
            op["responses"] = {"200": {"description": "OK", "content": {"application/json": {"schema": {}}}},
                               "default": {"description": "an error in OpenAI's shape",
                                           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}
            if path in streams:
                op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
            if path != "/health":
                op["security"] = [{"bearer": []}]
            model = bodies.get((path, method))
            if model is not None:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc
