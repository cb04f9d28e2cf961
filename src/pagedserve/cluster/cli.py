"""CLI of the cluster tier: `pagedserve router` and `pagedserve cluster up`."""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    """Adds this tier's subcommands."""
    from pagedserve.cluster.cluster_config import add_router_args
    from pagedserve.config import add_engine_args

    router = sub.add_parser(
        "router", help="OpenAI-compatible router in front of pagedserve replicas",
        description="Proxies the OpenAI API to N `pagedserve serve` replicas, choosing one per request by "
                    "policy, region and data residency (header x-residency: eu keeps a request on replicas "
                    "tagged eu), with health probes and failover. Its own /health, /v1/models, /metrics.")
    router.add_argument("--replica", action="append", metavar="URL[,name=N][,region=R][,tags=T1:T2][,role=R]",
                        help="a replica (repeatable), e.g. http://10.0.0.5:8000,region=eu-west,tags=eu; "
                             "role=prefill|decode|both for disaggregated prefill/decode (default both)")
    router.add_argument("--config", dest="cluster_config", type=Path, default=None,
                        help="cluster YAML: replicas (url, name, region, tags), rtt_ms matrix, policy, "
                             "health and timeout settings (see ClusterConfig)")
    router.add_argument("--host", default="127.0.0.1", help="address to listen on")
    router.add_argument("--port", type=int, default=8080, help="port to listen on")
    router.add_argument("--cluster-secret-file", default=None,
                        help="file holding the cluster secret the replicas were started with (hex): the router signs "
                             "its calls to their internal routes (disaggregated halves, adapter loads) with it "
                             "(default: $PAGEDSERVE_CLUSTER_SECRET)")
    add_router_args(router)
    router.set_defaults(func=run_router)

    cluster = sub.add_parser("cluster", help="start replicas and a router together")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    up = cluster_sub.add_parser(
        "up", help="start N replicas and the router in front of them; Ctrl-C or SIGTERM stops all",
        description="Starts N `pagedserve serve` replicas (local processes, or Ray actors with --backend ray) "
                    "and runs the router on --host/--port until interrupted. Engine flags go to every replica.")
    up.add_argument("--replicas", type=int, default=2, help="number of replicas (each prefills and decodes)")
    up.add_argument("--prefill", type=int, default=0,
                    help="disaggregated: this many prefill replicas (--kv-role prefill) in place of --replicas, "
                         "with --decode decode replicas; the router moves each prompt's KV blocks between them")
    up.add_argument("--decode", type=int, default=0, help="disaggregated: decode replicas (--kv-role decode)")
    up.add_argument("--backend", choices=["local", "ray"], default="local",
                    help="local processes, or actors on a Ray cluster")
    up.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start one locally)")
    up.add_argument("--replica-cpus", type=float, default=None,
                    help="Ray CPUs reserved per replica (default: cores / (replicas + 1), fractions allowed)")
    up.add_argument("--host", default="127.0.0.1", help="router address")
    up.add_argument("--port", type=int, default=8080, help="router port")
    up.add_argument("--log-dir", type=Path, default=None, help="replica logs (default: a temp folder)")
    up.add_argument("--cluster-secret-file", default=None,
                    help="the cluster secret to give the router and replicas (default: a new one, which only this "
                         "command's processes hold)")
    up.add_argument("--serve-args", default="",
                    help="more `pagedserve serve` flags for every replica, as one string, "
                         "e.g. \"--embedding-model none --api-key KEY\"")
    add_router_args(up)
    add_engine_args(up)
    up.set_defaults(func=run_cluster_up)

    secret = cluster_sub.add_parser(
        "secret", help="write a new cluster secret to a file (for replicas and routers started by hand)",
        description="Writes a new random cluster secret (hex) to FILE, readable by its owner only. Give the same "
                    "file to `serve --cluster-secret-file` on every replica and to `router --cluster-secret-file`; "
                    "`cluster up` makes its own.")
    secret.add_argument("file", type=Path)
    secret.set_defaults(func=write_secret)


def write_secret(args: argparse.Namespace) -> int:
    from pagedserve.server.peer_auth import PeerKey

    fd = os.open(args.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(PeerKey.generate().hex() + "\n")
    print(f"cluster secret written to {args.file}")
    return 0



def serve_router(config, host: str, port: int, peer_key=None) -> None:
    import uvicorn

    from pagedserve.cluster.app import create_app

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request is too many
    log.info("router on http://%s:%d (policy %s, %d replicas)", host, port, config.policy, len(config.replicas))
    uvicorn.run(create_app(config, peer_key), host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)


def run_router(args: argparse.Namespace) -> int:
    from pagedserve.cluster.app import check_peer_key
    from pagedserve.cluster.cluster_config import config_from_args
    from pagedserve.server.peer_auth import load_key

    try:
        config = config_from_args(args)
        peer_key = load_key(args.cluster_secret_file)
        check_peer_key(config, peer_key)
    except (ValueError, OSError) as exc:
        print(f"pagedserve router: {exc}", file=sys.stderr)
        return 2
    serve_router(config, args.host, args.port, peer_key)
    return 0


def run_cluster_up(args: argparse.Namespace) -> int:
    from pagedserve.cluster.cluster_config import ReplicaSpec, config_from_args
    from pagedserve.cluster.launcher import LocalCluster, engine_flags, threads_per_replica
    from pagedserve.config import EngineConfig
    from pagedserve.server.peer_auth import PeerKey, load_key

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs even while replicas start
    engine = EngineConfig.from_args(args)
    if (args.prefill > 0) != (args.decode > 0):
        raise SystemExit("cluster up: --prefill and --decode go together (at least one of each)")
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode or ["both"] * args.replicas
    if engine.num_threads is None:
        engine.num_threads = threads_per_replica(len(roles))
    serve_args = engine_flags(engine) + shlex.split(args.serve_args)
    # This cluster's own (its router and replicas, nobody else) unless given: to add replicas by hand later.
    peer_key = load_key(args.cluster_secret_file) if args.cluster_secret_file else PeerKey.generate()
    if args.backend == "ray":
        from pagedserve.cluster.ray_launcher import RayCluster
        cluster = RayCluster(len(roles), serve_args, address=args.ray_address, replica_cpus=args.replica_cpus,
                             roles=roles, peer_key=peer_key)
    else:
        cluster = LocalCluster(len(roles), serve_args, log_dir=args.log_dir, roles=roles, peer_key=peer_key)
    with cluster:
        specs = [ReplicaSpec(url=url, name=f"{role}-{i}" if role != "both" else f"replica-{i}", kv_role=role)
                 for i, (url, role) in enumerate(zip(cluster.urls(), roles))]
        serve_router(config_from_args(args, specs), args.host, args.port, peer_key)
    return 0
