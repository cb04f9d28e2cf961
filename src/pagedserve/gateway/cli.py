"""CLI of the gateway tier: `pagedserve gateway` (serve, keys, traces, sources, index, usage).

Admin subcommands work on the gateway's store directly (the SQLite file or the shared Redis named in
the config), so they work whether or not a gateway is running.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Adds this tier's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                        help="gateway YAML (providers, routes, budgets, cache; default: gateway.yaml)")
    common.add_argument("--store", default=argparse.SUPPRESS,
                        help="override the config's store: 'sqlite', 'sqlite:///path' or 'redis://host:port/db'")

    g = sub.add_parser("gateway", parents=[common], help="OpenAI-compatible gateway: keys, limits, budgets, "
                       "semantic cache, difficulty routing, fallbacks, traces",
                       description="Serve the gateway (no subcommand) or administer its keys, sources and traces.")
    g.add_argument("--host", default=None, help="address to bind (default: the config's listen.host)")
    g.add_argument("--port", type=int, default=None, help="port to bind (default: the config's listen.port)")
    g.add_argument("--otlp-endpoint", default=None, help="export spans to this OTLP/HTTP traces URL")
    g.set_defaults(func=_serve)
    gsub = g.add_subparsers(dest="gateway_command", metavar="SUBCOMMAND")

    keys = gsub.add_parser("keys", help="create, revoke or list API keys").add_subparsers(dest="keys", required=True)
    create = keys.add_parser("create", parents=[common], help="mint a key (the secret is printed once)")
    create.add_argument("--user", required=True, help="the user the key belongs to (per-user budgets)")
    create.add_argument("--team", default=None, help="team: the semantic cache's tenant scope (default: none, "
                        "so the key's cached answers are shared with its own user only)")
    create.add_argument("--models", default="", help="comma-separated routes the key may use (default: all)")
    create.add_argument("--residency", default=None, help="data residency tag passed to the router, e.g. eu")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute, >= 1 (default: key_defaults)")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute (prompt bound + max completion), "
                        ">= 1 (default: key_defaults)")
    create.add_argument("--daily-budget", type=float, default=None, help="daily budget of this key in USD")
    create.set_defaults(func=_keys_create)
    revoke = keys.add_parser("revoke", parents=[common], help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_keys_revoke)
    keys.add_parser("list", parents=[common], help="list keys (never their secrets)").set_defaults(func=_keys_list)

    traces = gsub.add_parser("traces", parents=[common], help="show recent request traces")
    traces.add_argument("--limit", type=int, default=20)
    traces.add_argument("--key-id", default=None)
    traces.add_argument("--user", default=None)
    traces.add_argument("--json", action="store_true", help="one JSON object per line")
    traces.set_defaults(func=_traces)

    sources = gsub.add_parser("sources", help="knowledge-source versions").add_subparsers(dest="sources", required=True)
    bump = sources.add_parser("bump", parents=[common], help="new version of a source: cached answers "
                              "that depended on it become stale")
    bump.add_argument("name")
    bump.add_argument("--version", default=None, help="explicit version (default: previous + 1)")
    bump.set_defaults(func=_sources_bump)
    sources.add_parser("list", parents=[common], help="list sources and versions").set_defaults(func=_sources_list)

    index = gsub.add_parser("index", help="the retrieval index of knowledge sources (docs/gateway.md)",
                            description="Documents per knowledge source, searched by a route's `retrieval`. "
                            "Versions follow the content: only changed documents are re-embedded, and the "
                            "source's version moves only when something changed.").add_subparsers(
                                dest="index", required=True)
    add = index.add_parser("add", parents=[common], help="index files and folders (.md .txt .rst .html); "
                           "re-adding a folder updates changed files and removes deleted ones")
    add.add_argument("source", help="knowledge source name, e.g. hr-policy")
    add.add_argument("paths", nargs="+", type=Path, help="files or folders")
    add.set_defaults(func=_index_add)
    remove = index.add_parser("remove", parents=[common], help="remove documents, or the whole source")
    remove.add_argument("source")
    remove.add_argument("documents", nargs="*", help="document names as `index list SOURCE` shows (default: all)")
    remove.set_defaults(func=_index_remove)
    listing = index.add_parser("list", parents=[common], help="sources, or one source's documents")
    listing.add_argument("source", nargs="?", default=None)
    listing.set_defaults(func=_index_list)
    search = index.add_parser("search", parents=[common], help="the best chunks of a source for a query")
    search.add_argument("source")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=3, help="chunks to show (default 3)")
    search.add_argument("--mode", choices=["hybrid", "lexical", "dense"], default="hybrid",
                        help="hybrid (default: BM25 and dense fused by reciprocal rank) or one side alone")
    search.set_defaults(func=_index_search)

    usage = gsub.add_parser("usage", parents=[common], help="spend per key and user per day")
    usage.add_argument("--day", default=None, help="YYYY-MM-DD in the config's time zone (default: all days)")
    usage.set_defaults(func=_usage)

    gsub.add_parser("train-classifier", help="train the difficulty classifier now (build time) into "
                    "$PAGEDSERVE_CACHE and print its cross-validated accuracy").set_defaults(func=_train)


def _config(args: argparse.Namespace):
    from pagedserve.gateway.gateway_config import GatewayConfig

    path = getattr(args, "config", None) or Path("gateway.yaml")
    try:
        config = GatewayConfig.load(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SystemExit(f"gateway config {path}: {e}") from None
    if getattr(args, "store", None):
        config.store = args.store
    return config


def _with_store(args: argparse.Namespace, action) -> int:
    import asyncio

    from pagedserve.gateway.store import open_store

    config = _config(args)

    async def run() -> int:
        store = open_store(config.store, config.sqlite_path)
        try:
            return await action(store, config)
        finally:
            await store.close()
    return asyncio.run(run())


def _print(data) -> None:
    print(json.dumps(data, indent=2, default=str))


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedserve.gateway.app import create_app

    config = _config(args)
    config.host = args.host or config.host
    config.port = args.port if args.port is not None else config.port
    config.otlp_endpoint = args.otlp_endpoint or config.otlp_endpoint
    if config.admin_key is None:
        print("note: no admin_key configured; admin endpoints are disabled (the CLI still works)", file=sys.stderr)
    app = create_app(config)
    print(f"gateway listening on http://{config.host}:{config.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
    return 0


def _keys_create(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from pagedserve.gateway.admin_models import KeyCreate
    from pagedserve.gateway.auth import mint_key
    from pagedserve.gateway.protocol import validation_error

    try:  # the same checks as POST /admin/keys
        fields = KeyCreate.model_validate({
            "user": args.user, "team": args.team, "models": [m for m in args.models.split(",") if m],
            "residency": args.residency, "rpm": args.rpm, "tpm": args.tpm, "daily_budget_usd": args.daily_budget,
        }).model_dump()
    except ValidationError as e:
        raise SystemExit(f"gateway keys create: {validation_error(e).message}") from None
    token, key = mint_key(fields.pop("user"), **fields)

    async def action(store, _) -> int:
        await store.put_key(key)
        _print({"key": token, **key.public()})
        return 0
    return _with_store(args, action)


def _keys_revoke(args: argparse.Namespace) -> int:
    async def action(store, _) -> int:
        if not await store.revoke_key(args.key_id):
            print(f"no key with id {args.key_id!r}", file=sys.stderr)
            return 1
        print(f"revoked {args.key_id}")
        return 0
    return _with_store(args, action)


def _keys_list(args: argparse.Namespace) -> int:
    async def action(store, _) -> int:
        _print([k.public() for k in await store.list_keys()])
        return 0
    return _with_store(args, action)


def _sources_bump(args: argparse.Namespace) -> int:
    async def action(store, _) -> int:
        print(f"{args.name} -> version {await store.bump_source(args.name, args.version)}")
        return 0
    return _with_store(args, action)


def _sources_list(args: argparse.Namespace) -> int:
    async def action(store, _) -> int:
        _print(await store.list_sources())
        return 0
    return _with_store(args, action)


def _with_library(args: argparse.Namespace, action) -> int:
    from pagedserve.embedding import Embedder
    from pagedserve.gateway.leases import LeaseBusy
    from pagedserve.gateway.retrieval.indexer import IndexInputError
    from pagedserve.gateway.retrieval.library import Library

    embedder = Embedder.load().fast()

    async def run(store, _) -> int:
        try:
            return await action(Library(store, embedder))
        except (IndexInputError, LookupError, LeaseBusy) as e:
            print(f"gateway index: {e.args[0] if isinstance(e, LookupError) else e}", file=sys.stderr)
            return 1
    return _with_store(args, run)


def _index_add(args: argparse.Namespace) -> int:
    from pagedserve.gateway.retrieval.indexer import IndexInputError
    from pagedserve.gateway.retrieval.reading import read_paths

    try:  # before the encoder loads: a bad path is reported at once
        reading = read_paths(args.paths)
    except IndexInputError as e:
        print(f"gateway index: {e}", file=sys.stderr)
        return 1
    for skipped in reading.skipped:
        print(f"gateway index: skipped {skipped}", file=sys.stderr)

    async def action(library) -> int:
        _print((await library.add(args.source, reading.files, reading.prefixes)).public())
        return 0
    return _with_library(args, action)


def _index_remove(args: argparse.Namespace) -> int:
    async def action(library) -> int:
        _print((await library.remove(args.source, args.documents or None)).public())
        return 0
    return _with_library(args, action)


def _index_list(args: argparse.Namespace) -> int:
    async def action(library) -> int:
        _print(await library.documents(args.source) if args.source else await library.sources())
        return 0
    return _with_library(args, action)


def _index_search(args: argparse.Namespace) -> int:
    async def action(library) -> int:
        version, hits = await library.search(args.source, args.query, args.k, args.mode)
        print(f"{args.source} v{version}, {args.mode}:")
        for n, h in enumerate(hits, 1):
            print(f"[{n}] {h.chunk.doc} > {h.chunk.heading}  (score {h.score:.4f}, cosine {h.cosine:.3f}, "
                  f"bm25 {h.bm25:.2f})\n    {h.chunk.text[:300].replace(chr(10), ' ')}")
        return 0
    return _with_library(args, action)


def _usage(args: argparse.Namespace) -> int:
    from pagedserve.gateway.budget import BudgetKeeper

    async def action(store, config) -> int:
        _print(await BudgetKeeper(store, config.tz, config.budgets).usage(args.day))
        return 0
    return _with_store(args, action)


def _traces(args: argparse.Namespace) -> int:
    from datetime import datetime

    from pagedserve.gateway.tracing import TraceSink

    sink = TraceSink(_config(args).data_dir / "traces.db")
    rows = sink.recent(args.limit, args.key_id, args.user)
    sink.close()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'time':19} {'user':10} {'route':14} {'tier':5} {'score':>5} {'cache':6} {'sim':>5} {'provider':18} "
          f"{'tries':>5} {'in':>5} {'out':>5} {'cost $':>10} {'ms':>8} status")
    for r in rows:
        when = datetime.fromtimestamp(r["started_at"]).strftime("%Y-%m-%d %H:%M:%S")
        score = "" if r["classifier_score"] is None else f"{r['classifier_score']:.2f}"
        sim = "" if r["cache_similarity"] is None else f"{r['cache_similarity']:.2f}"
        provider = f"{r['provider']}/{r['upstream_model']}"[:18] if r["provider"] else "-"
        print(f"{when:19} {str(r['user'])[:10]:10} {str(r['route'])[:14]:14} {r['tier'] or '-'!s:5} {score:>5} "
              f"{r['cache'] or '-':6} {sim:>5} {provider:18} {len(r['attempts']):>5} {r['prompt_tokens']:>5} "
              f"{r['completion_tokens']:>5} {r['cost_usd']:>10.6f} {r['latency_ms']:>8.1f} {r['status']}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import numpy as np

    from pagedserve.embedding import Embedder
    from pagedserve.gateway import classify

    embedder = Embedder.load()
    examples = classify.load_examples()
    accuracy, guessed = classify.cross_validate(embedder, examples)
    print(f"5-fold accuracy on {len(examples)} labelled requests: {accuracy:.3f} "
          f"(the lexical guess the speculative call goes to: {guessed:.3f})")
    model = classify.train(embedder, examples)
    path = classify.weights_path(classify.default_cache_dir(), embedder.model_name)
    model.save(path)
    print(f"weights -> {path} ({np.asarray(model.weights).size} features)")
    return 0

