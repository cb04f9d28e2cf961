"""`pagedserve serve`: load the engine and the embedder, bind the socket, run uvicorn."""
from __future__ import annotations

import argparse
import logging
import socket
import time
from types import FrameType

import uvicorn

from pagedserve.config import EngineConfig, parse_size
from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.server.admission import AdmissionConfig, AdmissionController, parse_degrade, parse_shed_after
from pagedserve.server.kv_transfer import Disaggregation
from pagedserve.server.lora_routes import parse_lora_modules, register_startup_adapters
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.openai_api import create_app
from pagedserve.server.peer_auth import load_key
from pagedserve.server.serving import ServerState
from pagedserve.server.tool_parsers import choose_parser

logger = logging.getLogger(__name__)


def build_state(args: argparse.Namespace) -> ServerState:
    try:
        peer_key = load_key(args.cluster_secret_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--cluster-secret-file: {exc}") from None
    if args.kv_role is not None and peer_key is None:
        raise SystemExit("--kv-role needs the cluster secret (--cluster-secret-file or $PAGEDSERVE_CLUSTER_SECRET): "
                         "only the cluster's own router and workers may send KV-transfer requests")
    if not 0 <= args.kv_lease_max_fraction <= 1:
        raise SystemExit("--kv-lease-max-fraction is a fraction of the KV pool, between 0 and 1")
    if args.kv_transport == "ray" and not args.ray_address:
        raise SystemExit("--kv-transport ray needs --ray-address (the Ray cluster whose object store moves the "
                         "blocks)")
    engine = AsyncLLM.from_config(EngineConfig.from_args(args))
    embedder = None
    if args.embedding_model != "none":
        from pagedserve.embedding import Embedder

        embedder = Embedder.load(None if args.embedding_model == "default" else args.embedding_model)
    name = args.served_model_name or engine.model_name
    admission = AdmissionController(admission_config(args, engine),
                                    backlogged=lambda: engine.stats.num_waiting > 0,
                                    waiting=lambda: engine.stats.num_waiting)
    try:
        parser = choose_parser(args.tool_call_parser, engine.tokenizer.chat_template)
    except ValueError as exc:
        raise SystemExit(f"--tool-call-parser: {exc}") from None
    state = ServerState(engine=engine, model_name=name, metrics=ServerMetrics(name), embedder=embedder,
                        admission=admission, tool_parser=parser, peer_key=peer_key,
                        disagg=Disaggregation(args.kv_role, args.kv_load_failure, args.kv_pull_timeout_s,
                                              args.kv_transport))
    engine.engine.kv_transfer.lease_s = args.kv_lease_s
    engine.engine.kv_transfer.max_pinned_fraction = args.kv_lease_max_fraction
    if args.ray_address:
        from pagedserve.server import kv_ray

        try:
            state.disagg.ray_cluster = kv_ray.join(args.ray_address)
        except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; any of them stops the start
            raise SystemExit(f"--ray-address {args.ray_address}: cannot join the Ray cluster: {exc}") from None
    try:
        register_startup_adapters(state, parse_lora_modules(args.lora_modules or []))
    except ValueError as exc:
        raise SystemExit(f"--lora-modules: {exc}") from None
    return state


def admission_config(args: argparse.Namespace, engine: AsyncLLM) -> AdmissionConfig:
    kv = engine.engine.kv
    try:
        degrade, shed_after = parse_degrade(args.degrade), parse_shed_after(args.shed_after)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    bound = args.max_queued_tokens or kv.num_blocks * kv.block_size
    if bound < engine.max_model_len:
        logger.warning("--max-queued-tokens %d is below max_model_len %d: a request without max_tokens may need "
                       "more than that and is refused", bound, engine.max_model_len)
    return AdmissionConfig(enabled=args.admission_control == "on", max_queued_tokens=bound,
                           max_queued_requests=args.max_queued_requests, seats=engine.max_num_seqs, ttft_slo=args.ttft_slo,
                           degrade_at=args.degrade_at, degrade=degrade, shed_after=shed_after)


class DrainingServer(uvicorn.Server):
    """The first SIGTERM (or Ctrl-C) drains: admission answers 503, /health says 'draining', and
    admitted requests get the grace period to finish; then uvicorn's own shutdown. A second signal
    shuts down at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state, self.grace_s = state, grace_s
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is None:  # a signal handler: set flags only, log from the loop
            self.state.admission.draining = True
            self.drain_deadline = time.monotonic() + self.grace_s
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            in_flight = self.state.admission.in_flight
            if counter % 10 == 0:
                logger.info("draining: %d admitted requests in flight", in_flight)
            if in_flight == 0 or time.monotonic() >= self.drain_deadline:
                logger.info("drained (%d requests left unfinished); shutting down", in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they are TCP, and with
    # Nagle on, a response's body waits ~40 ms behind its headers for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
                            timeout_graceful_shutdown=5)
    DrainingServer(config, state, args.shutdown_timeout).run(sockets=[sock])
    return 0
