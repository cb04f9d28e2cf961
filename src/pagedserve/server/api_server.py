"""`pagedserve serve`: load the engine and the embedder, bind the socket, run uvicorn."""
from __future__ import annotations

import argparse
import logging
import socket

import uvicorn

from pagedserve.config import EngineConfig, parse_size
from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.openai_api import create_app
from pagedserve.server.serving import ServerState

logger = logging.getLogger(__name__)


def build_state(args: argparse.Namespace) -> ServerState:
    engine = AsyncLLM.from_config(EngineConfig.from_args(args))
    embedder = None
    if args.embedding_model != "none":
        from pagedserve.embedding import Embedder

        embedder = Embedder.load(None if args.embedding_model == "default" else args.embedding_model)
    name = args.served_model_name or engine.model_name
    return ServerState(engine=engine, model_name=name, metrics=ServerMetrics(name), embedder=embedder)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def banner(url: str, model: str, api_key: str | None) -> str:
    auth = f" \\\n  -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (
        f"pagedserve is serving {model} at {url}\n"
        f"  OpenAI base_url: {url}/v1   docs: {url}/docs   metrics: {url}/metrics\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
        f"\"max_tokens\": 32}}'"
    )


def serve(args: argparse.Namespace) -> int:
    state = build_state(args)
    app = create_app(state, api_key=args.api_key, max_body_bytes=parse_size(args.max_request_size))
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(banner(url, state.model_name, args.api_key), flush=True)
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=not args.disable_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
