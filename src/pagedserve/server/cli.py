"""CLI of the server tier: `pagedserve serve` (heavy imports inside handlers)."""
from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    """Adds this tier's subcommands."""
    from pagedserve.config import SERVE_PREFILL_BESIDE_DECODES, add_engine_args

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                                   "embeddings, tokenize, health, Prometheus metrics).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (printed)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the model's own name, e.g. SmolLM2-135M-Instruct)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on API routes (default: $PAGEDSERVE_API_KEY, else open)")
    p.add_argument("--cluster-secret-file", default=None,
                   help="file holding the cluster secret (hex; `pagedserve cluster secret` writes one, `cluster up` "
                        "passes its own): internal routes (disaggregated requests, KV leases, run-time adapter "
                        "loading) answer only requests signed with it (default: $PAGEDSERVE_CLUSTER_SECRET, else none "
                        "and those routes are closed)")
    p.add_argument("--embedding-model", default="default",
                   help="sentence-embedding folder for /v1/embeddings; 'default' = packaged all-MiniLM-L6-v2, "
                        "'none' turns embeddings off")
    p.add_argument("--max-request-size", default="8MiB", help="largest request body accepted (413 beyond)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="drain grace period: on SIGTERM stop admitting (503, /health 'draining') and give "
                        "admitted requests this many seconds to finish before exiting")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                   help="how the model writes tool calls: hermes (<tool_call> tags; ChatML models such as SmolLM2, "
                        "Qwen2.5), llama3_json (Llama 3.1+); auto picks llama3_json for a Llama 3 chat template")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve from the start, as name=path or JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; requests pick one with '
                        "model: NAME (needs --enable-lora)")
    p.add_argument("--disable-access-log", action="store_true", help="don't log one line per HTTP request")
    add_admission_args(p)
    add_disaggregation_args(p)
    add_engine_args(p)
    p.set_defaults(func=_serve, max_prefill_tokens_beside_decodes=SERVE_PREFILL_BESIDE_DECODES)


def add_disaggregation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregated prefill/decode", "the worker's role when a router splits "
                                  "requests between prefill and decode workers (docs/cluster.md)")
    g.add_argument("--kv-role", choices=["prefill", "decode", "both"], default=None,
                   help="prefill: computes prompts for decode workers and leases their KV blocks; decode: pulls "
                        "them and generates; both: either, and plain requests as always. Needs the cluster secret "
                        "(--cluster-secret-file): the router signs these requests on the /internal routes. "
                        "Default: none (a plain server; KV-transfer parameters are refused)")
    g.add_argument("--kv-load-failure", choices=["recompute", "fail"], default="recompute",
                   help="a decode worker whose pull of a prompt's blocks fails or times out recomputes the "
                        "prompt (default) or fails the request with a 502")
    g.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="seconds a prefill worker keeps a prompt's blocks pinned for the decode worker's pull")
    g.add_argument("--kv-lease-max-fraction", type=float, default=0.5,
                   help="most of the KV pool that leases may pin at once; past it a prompt's handle covers fewer "
                        "blocks and the decode worker computes the rest")
    g.add_argument("--kv-transport", choices=["auto", "tcp", "shm", "ray"], default="auto",
                   help="how a decode worker pulls blocks: shared memory from a prefill worker on this host, the "
                        "Ray object store from one in the same Ray cluster (--ray-address) and TCP (HTTP) "
                        "otherwise (auto, default), or always one of them")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (its GCS address) so that KV blocks can move through its object "
                        "store; `cluster up --backend ray` sets it on disaggregated replicas")
    g.add_argument("--kv-pull-timeout-s", type=float, default=10.0,
                   help="a decode worker's deadline for one pull (then --kv-load-failure applies)")


def add_admission_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.server.admission import AdmissionConfig

    d = AdmissionConfig()
    g = parser.add_argument_group("admission control", "token-aware admission, priorities and load shedding")
    g.add_argument("--admission-control", choices=["on", "off"], default="on",
                   help="off: admit everything into one unbounded FCFS queue, ignoring priorities")
    g.add_argument("--max-queued-tokens", type=int, default=None,
                   help="hard bound on the queue (admitted, not started) in cost tokens, prompt + max_tokens "
                        "per sample (default: the KV pool's size in tokens)")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="hard bound on the queue in requests")
    g.add_argument("--ttft-slo", type=float, default=d.ttft_slo,
                   help="time-to-first-token target in seconds; the queue bound adapts to meet it")
    g.add_argument("--degrade", default="sheddable:max_tokens=64,n=1",
                   help="what each class gives up under pressure, e.g. "
                        "'sheddable:max_tokens=64,n=1;standard:max_tokens=512' ('' for nothing)")
    g.add_argument("--degrade-at", type=float, default=d.degrade_at,
                   help="queue fill (fraction of the bound) from which degradation applies")
    g.add_argument("--shed-after", default="sheddable=1,standard=2",
                   help="shed a class's admitted requests still not started after this many TTFT targets "
                        "(429 with Retry-After); '' never sheds")


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.server.api_server import serve

    return serve(args)
