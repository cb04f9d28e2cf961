"""Router configuration: the replicas (with region and residency tags), the RTT matrix, the policy and
its knobs. Comes from a YAML file (`--config cluster.yaml`), `--replica` flags, or both."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from pagedserve.cluster.regions import parse_name
from pagedserve.lora_request import check_lora_name


@dataclass(slots=True)
class ReplicaSpec:
    url: str
    name: str = ""
    region: str = "local"
    tags: tuple[str, ...] = ()
    kv_role: str = "both"  # prefill | decode | both: its part in disaggregated serving

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        """'URL[,name=N][,region=R][,tags=eu:gdpr][,role=prefill|decode|both]' -> spec."""
        url, *options = text.split(",")
        spec = cls(url=url.rstrip("/"))
        for option in options:
            key, _, value = option.partition("=")
            if key == "name":
                spec.name = value
            elif key == "region":
                spec.region = value
            elif key == "tags":
                spec.tags = tuple(t for t in value.split(":") if t)
            elif key == "role":
                spec.kv_role = value
            else:
                raise ValueError(f"unknown replica option {key!r} in {text!r} (use name=, region=, tags=, role=)")
        return spec


@dataclass(slots=True)
class ClusterConfig:
    replicas: list[ReplicaSpec] = field(default_factory=list)
    policy: str = "prefix_affinity"
    region: str = "local"  # the router's own region: the client region when a request names none
    rtt_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # client region -> replica region
    default_rtt_ms: float = 100.0  # between two different regions missing from rtt_ms
    region_slack_ms: float = 25.0  # replicas this close to the nearest one count as equally near
    spill_inflight: int = 16  # when every near replica has this many requests in flight, use farther ones
    cache_threshold: float = 0.5
    balance_abs: int = 8
    balance_rel: float = 1.5
    max_index_size: int = 400_000  # per replica, in prefix-index units (characters or token ids)
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_threshold: int = 2  # failed probes before ejection
    healthy_threshold: int = 1  # good probes before re-admission
    passive_failures: int = 3  # consecutive request timeouts / 5xx before ejection
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0  # whole non-streamed answer
    stream_idle_timeout_s: float = 120.0  # gap between two chunks of a stream
    max_attempts: int = 3
    # LoRA adapters the router may load on a replica when none holds one (name -> PEFT folder, the same path on
    # every replica, as vLLM's --lora-modules); and the in-flight requests on every holder that make it load the
    # adapter on one more replica.
    lora_modules: dict[str, str] = field(default_factory=dict)
    lora_spill_inflight: int = 8
    # Disaggregated: prompts shorter than this (estimated tokens) skip the prefill pool and are computed whole on
    # a decode replica, where their prefill costs less than a queue at the prefill pool and a transfer.
    disagg_min_prompt_tokens: int = 256
    max_body_bytes: int = 8 * 2**20  # 413 beyond, however the body is sent (a replica's own default)
    session_header: str = "x-session-id"
    residency_header: str = "x-residency"
    client_region_header: str = "x-client-region"
    # The web console at /ui (cluster/ui/) opens only with an admin key: given here, or named by admin_key_env.
    admin_key: str | None = None
    admin_key_env: str | None = None
    docs_dir: str | None = None  # where `pagedserve bench` writes its PNGs: the console shows the latest

    def console_key(self) -> str | None:
        return self.admin_key or (os.environ.get(self.admin_key_env) if self.admin_key_env else None)

    @classmethod
    def from_yaml(cls, path: Path) -> ClusterConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        replicas = [ReplicaSpec.parse(r) if isinstance(r, str) else
                    ReplicaSpec(url=r["url"].rstrip("/"), name=r.get("name", ""),
                                region=r.get("region", "local"), tags=_tags(r.get("tags", ())),
                                kv_role=r.get("kv_role", "both"))
                    for r in data.pop("replicas", [])]
        if data.get("docs_dir"):  # relative to the file, as the gateway's data_dir
            data["docs_dir"] = str(Path(path).parent / data["docs_dir"])
        return cls(replicas=replicas, **data)

    def finalize(self) -> ClusterConfig:
        """Names unnamed replicas and checks what a typo could break."""
        if not self.replicas:
            raise ValueError("no replicas: give --replica URL (repeatable) or a --config file with replicas")
        for i, spec in enumerate(self.replicas):
            spec.name = spec.name or f"replica-{i}"
            try:  # a tag no client header could name would be a replica no constraint selects
                spec.tags = tuple(parse_name(t) for t in spec.tags)
            except ValueError as exc:
                raise ValueError(f"replica {spec.name}: residency tag {exc}") from None
            if spec.kv_role not in ("prefill", "decode", "both"):
                raise ValueError(f"replica {spec.name}: kv_role must be prefill, decode or both, not {spec.kv_role!r}")
        roles = {s.kv_role for s in self.replicas}
        if "prefill" in roles and not roles & {"decode", "both"}:
            raise ValueError("prefill replicas need at least one decode (or both) replica to hand their requests to")
        names = [s.name for s in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique: {names}")
        if not isinstance(self.lora_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.lora_modules.items()):
            raise ValueError("lora_modules must map adapter names to paths")
        for name in self.lora_modules:
            try:
                check_lora_name(name)
            except ValueError as exc:
                raise ValueError(f"lora_modules {name!r}: {exc}") from None
        return self


def _tags(value) -> tuple[str, ...]:
    """`tags: eu` is one tag, not the tags 'e' and 'u'."""
    return (value,) if isinstance(value, str) else tuple(value)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = ClusterConfig()
    parser.add_argument("--policy", default=None,
                        choices=["round_robin", "least_load", "prefix_affinity", "session_affinity"],
                        help=f"how to pick a replica (default {d.policy})")
    parser.add_argument("--router-region", dest="region", default=None,
                        help="the router's region, used for requests without an x-client-region header")
    parser.add_argument("--cache-threshold", type=float, default=None,
                        help=f"prefix_affinity: smallest matched fraction of the prompt (default {d.cache_threshold})")
    parser.add_argument("--balance-abs", type=int, default=None,
                        help=f"prefix_affinity: in-flight gap that switches to least load (default {d.balance_abs})")
    parser.add_argument("--balance-rel", type=float, default=None,
                        help=f"prefix_affinity: and load ratio that does (default {d.balance_rel})")
    parser.add_argument("--health-interval", dest="health_interval_s", type=float, default=None,
                        help=f"seconds between active /health probes (default {d.health_interval_s})")
    parser.add_argument("--max-attempts", type=int, default=None,
                        help=f"replicas tried per request before giving up (default {d.max_attempts})")
    parser.add_argument("--lora-module", action="append", default=None, metavar="NAME=PATH",
                        help="a LoRA adapter the router loads on a replica (POST /v1/load_lora_adapter) when no "
                             "healthy replica holds it, or when all holders are busy (repeatable; replicas need "
                             "--enable-lora and the same path)")
    parser.add_argument("--admin-key-env", default=None, metavar="NAME",
                        help="environment variable holding the admin key that opens the web console at /ui "
                             "(without one the console is off)")
    parser.add_argument("--docs-dir", default=None, help="folder of `pagedserve bench` PNGs the console shows")


def config_from_args(args: argparse.Namespace, replicas: list[ReplicaSpec] | None = None) -> ClusterConfig:
    """--config file, then --replica flags (added to the file's), then single flags over both."""
    config = ClusterConfig.from_yaml(args.cluster_config) if getattr(args, "cluster_config", None) \
        else ClusterConfig()
    config.replicas += [ReplicaSpec.parse(r) for r in getattr(args, "replica", None) or []]
    config.replicas += replicas or []
    for name in ("policy", "region", "cache_threshold", "balance_abs", "balance_rel", "health_interval_s",
                 "max_attempts", "admin_key_env", "docs_dir"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(config, name, value)
    for item in getattr(args, "lora_module", None) or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-module {item!r}: expected NAME=PATH")
        config.lora_modules[name] = path
    return config.finalize()
