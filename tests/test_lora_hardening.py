"""Hostile LoRA adapters against a real `pagedserve serve --enable-lora` (issue #36, finding 9): every bad config
field, tensor and file is a 400 naming the problem (never a 500, a hang or a stalled server); pattern keys can
not freeze the server; one name loads once; names are plain tokens; and only a cluster's signed peers may load
or unload at run time (a server without a cluster secret keeps its start-up adapters and refuses the rest)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import httpx
import pytest
import torch

from pagedserve.server.peer_auth import SECRET_ENV, PeerKey
from tests.lora_support import (
    ALL,
    LOAD,
    UNLOAD,
    load_adapter,
    session_key,
    signed_post,
    unload_adapter,
    write_adapter,
)
from tests.server_support import ServerProcess

ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--embedding-model", "none",
        "--enable-lora", "--max-lora-rank", "16"]
KEY = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
BLOCK = {m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for m in ALL}
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
HEALTH_BOUND_S = 1.0  # what /health may take while a load runs (idle: ~2 ms; the freeze this guards against: 8 s)


@pytest.fixture(scope="module")
def dims():
    from pagedserve.model.loader import load_model

    return load_model(None).config


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(ARGS)
    yield srv.url
    srv.stop()


def key(layer: int, module: str, which: str) -> str:
    return KEY.format(layer, BLOCK[module], module, which)


def q_tensors(dims, rank: int = 4, layer: int = 0) -> dict[str, torch.Tensor]:
    """A and B of one q_proj, small and finite."""
    return {key(layer, "q_proj", "A"): torch.full((rank, dims.hidden_size), 0.01),
            key(layer, "q_proj", "B"): torch.full((dims.q_size, rank), 0.01)}


def full_tensors(dims, rank: int) -> dict[str, torch.Tensor]:
    """Every module of every layer at rank: the largest adapter of that rank (~20 MB at 16)."""
    shapes = {"q_proj": (dims.q_size, dims.hidden_size), "k_proj": (dims.kv_size, dims.hidden_size),
              "v_proj": (dims.kv_size, dims.hidden_size), "o_proj": (dims.hidden_size, dims.q_size),
              "gate_proj": (dims.intermediate_size, dims.hidden_size),
              "up_proj": (dims.intermediate_size, dims.hidden_size),
              "down_proj": (dims.hidden_size, dims.intermediate_size)}
    gen = torch.Generator().manual_seed(0)
    return {key(layer, m, w): torch.randn(*((rank, fan_in) if w == "A" else (out, rank)), generator=gen) * 0.01
            for layer in range(dims.num_hidden_layers) for m, (out, fan_in) in shapes.items() for w in "AB"}


def models(server: str) -> set[str]:
    return {card["id"] for card in httpx.get(f"{server}/v1/models", timeout=10).json()["data"]}


def refused(response: httpx.Response, status: int, param: str | None, message: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    return error


def assert_refused(server: str, folder: Path | str, message: str) -> None:
    refused(load_adapter(server, "hostile", folder), 400, "lora_path", message)
    assert "hostile" not in models(server)


def with_config(**change) -> dict:
    return {**CONFIG, **change}


CONFIGS = {  # adapter_config.json as sent by the attacker: (config, what the 400 says)
    "list": (b"[]", "must hold a JSON object, not list"),
    "null": (b"null", "must hold a JSON object, not NoneType"),
    "not json": (b"{\"r\": 4,", "not valid JSON"),
    "not utf-8": (b"{\"r\": \xff}", "not valid JSON"),
    "nested 100k deep": (b"[" * 100_000 + b"]" * 100_000, "over the 65536 allowed"),
    "nested 20k deep": (b"[" * 20_000 + b"]" * 20_000, "recursion limit"),
    "over 64 KiB": (with_config(padding="x" * 70_000), "over the 65536 allowed"),
    "lora_alpha null": (with_config(lora_alpha=None), "lora_alpha: Input should be a valid number"),
    "lora_alpha object": (with_config(lora_alpha={}), "lora_alpha: Input should be a valid number"),
    "lora_alpha string": (with_config(lora_alpha="16"), "lora_alpha: Input should be a valid number"),
    "lora_alpha true": (with_config(lora_alpha=True), "lora_alpha: Input should be a valid number"),
    "lora_alpha NaN": (json.dumps(with_config(lora_alpha=float("nan"))).encode(), "lora_alpha: Input should be a finite"),
    "lora_alpha Infinity": (json.dumps(with_config(lora_alpha=float("inf"))).encode(), "lora_alpha: Input should be"),
    "lora_alpha 1e300": (with_config(lora_alpha=1e300), "lora_alpha: Input should be less than or equal to 4096"),
    "lora_alpha 0": (with_config(lora_alpha=0), "lora_alpha: Input should be greater than 0"),
    "lora_alpha negative": (with_config(lora_alpha=-8), "lora_alpha: Input should be greater than 0"),
    "r 0": (with_config(r=0), "r: Input should be greater than 0"),
    "r float": (with_config(r=4.0), "r: Input should be a valid integer"),
    "r string": (with_config(r="4"), "r: Input should be a valid integer"),
    "r over max rank": (with_config(r=17), "r: rank 17 is over --max-lora-rank 16"),
    "r huge": (b'{"r": 1' + b"0" * 400 + b"}", "over --max-lora-rank 16"),
    "use_rslora string": (with_config(use_rslora="yes"), "use_rslora: Input should be a valid boolean"),
    "target_modules number": (with_config(target_modules=5), "target_modules"),
    "target_modules list of numbers": (with_config(target_modules=[1, 2]), "target_modules"),
    "alpha_pattern list": (with_config(alpha_pattern=["q_proj"]), "alpha_pattern: Input should be a valid dict"),
    "alpha_pattern value string": (with_config(alpha_pattern={"q_proj": "8"}), "alpha_pattern.q_proj: Input"),
    "alpha_pattern value NaN": (json.dumps(with_config(alpha_pattern={"q": float("nan")})).encode(), "finite"),
    "alpha_pattern bad regex": (with_config(alpha_pattern={"q_proj[": 8}), "alpha_pattern key 'q_proj['"),
    "alpha_pattern backreference": (with_config(alpha_pattern={r"(q)\1": 8}), "no backreferences or lookaround"),
    "alpha_pattern huge program": (with_config(alpha_pattern={".{0,999}" * 28: 8}), "pattern too large"),
    "alpha_pattern long key": (with_config(alpha_pattern={"q" * 257: 8}), "at most 256 characters"),
    "alpha_pattern 1025 keys": (with_config(alpha_pattern={f"k{i}": 8 for i in range(1025)}), "at most 1024 items"),
    "rank_pattern value 0": (with_config(rank_pattern={"q_proj": 0}), "rank_pattern.q_proj: Input should be greater"),
    "rank_pattern over max rank": (with_config(rank_pattern={"q_proj": 64}), "rank 64 is over --max-lora-rank"),
    "rank_pattern value float": (with_config(rank_pattern={"q_proj": 4.5}), "rank_pattern.q_proj"),
    "peft_type": (with_config(peft_type="ADALORA"), "peft_type: Input should be 'LORA'"),
    "DoRA": (with_config(use_dora=True), "use_dora: DoRA is not supported"),
    "fan_in_fan_out": (with_config(fan_in_fan_out=True), "fan_in_fan_out"),
    "bias all": (with_config(bias="all"), "bias: trained biases ('all') are not supported"),
    "bias number": (with_config(bias=1), "bias: Input should be"),
    "modules_to_save": (with_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "lora_bias": (with_config(lora_bias=True), "lora_bias"),
}


@pytest.mark.parametrize(("config", "message"), CONFIGS.values(), ids=CONFIGS.keys())
def test_hostile_configs_are_400s_naming_the_field(server, dims, tmp_path, config, message):
    assert_refused(server, write_adapter(tmp_path / "a", config, q_tensors(dims)), message)


def tensor_cases(dims) -> dict[str, tuple[dict, dict[str, torch.Tensor], str]]:
    """(config, tensors, what the 400 says) of each hostile tensor file."""
    h, q = dims.hidden_size, dims.q_size
    a, b = key(0, "q_proj", "A"), key(0, "q_proj", "B")
    ok = q_tensors(dims)
    return {
        "rank 0": (CONFIG, {a: torch.zeros(0, h), b: torch.zeros(q, 0)}, "gives it rank 4"),
        "0-dim": (CONFIG, {a: torch.tensor(1.0), b: torch.tensor(1.0)}, "lora_A has 0 dimensions, not 2"),
        "1-dim": (CONFIG, {**ok, b: torch.zeros(q)}, "lora_B has 1 dimensions, not 2"),
        "3-dim": (CONFIG, {**ok, a: torch.zeros(1, 4, h)}, "lora_A has 3 dimensions, not 2"),
        "int32": (CONFIG, {**ok, a: torch.zeros(4, h, dtype=torch.int32)}, "lora_A is torch.int32, not float16"),
        "bool": (CONFIG, {**ok, b: torch.zeros(q, 4, dtype=torch.bool)}, "lora_B is torch.bool"),
        "NaN": (CONFIG, {**ok, b: torch.full((q, 4), float("nan"))}, "holds non-finite weights"),
        "inf": (CONFIG, {**ok, a: torch.full((4, h), float("inf"))}, "holds non-finite weights"),
        "overflow once scaled": (with_config(r=1, lora_alpha=4096), {a: torch.ones(1, h), b: torch.full((q, 1), 1e36)},
                                 "overflow torch.float32 once scaled"),
        "other base model": (CONFIG, {**ok, a: torch.zeros(4, h + 1)}, "made for another base model"),
        "rank not the config's": (CONFIG, q_tensors(dims, rank=8), "gives it rank 4"),
        "A and B ranks differ": (CONFIG, {**ok, b: torch.zeros(q, 3)}, "gives it rank 4"),
        "rank_pattern's rank": (with_config(rank_pattern={r"layers\.0\.self_attn\.q_proj": 8}), ok, "gives it rank 8"),
        "unknown tensor": (CONFIG, {**ok, "lm_head.weight": torch.zeros(2, 2)}, "unsupported tensor 'lm_head.weight'"),
        "key of 300 chars": (CONFIG, {**ok, "x" * 290 + a[-10:]: torch.zeros(2, 2)}, "unsupported tensor"),
        "q_proj under mlp": (CONFIG, {**ok, a.replace("self_attn", "mlp"): torch.zeros(4, h)}, "does not have"),
        "layer 1000": (CONFIG, {**ok, a.replace("layers.0.", "layers.1000."): torch.zeros(4, h)}, "does not have"),
        "two lora_A": (CONFIG, {**ok, a.replace("lora_A.", "lora_A.other."): torch.zeros(4, h)}, "two lora_A"),
        "lora_B missing": (CONFIG, {a: ok[a]}, "lacks its lora_B"),
        "over the declared rank's size": (with_config(r=1), {"pad": torch.zeros(2**20)}, "allowed for the weights of a rank-1"),
    }


def test_hostile_tensors_are_400s_naming_the_problem(server, dims, tmp_path):
    for what, (config, tensors, message) in tensor_cases(dims).items():
        folder = write_adapter(tmp_path / what.replace(" ", "_"), config, tensors)
        assert_refused(server, folder, message)
    junk = write_adapter(tmp_path / "junk", CONFIG, q_tensors(dims))
    (junk / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    assert_refused(server, junk, "not a safetensors file")


def test_only_regular_files_in_the_folder_are_read(server, dims, tmp_path):
    """A FIFO answers at once (it blocked every later load), and so do a directory, symlinks out of the folder
    (to a device, a secret, /proc) and a path with a NUL; a symlink within the folder is followed."""
    outside = {"/dev/zero": "adapter_model.safetensors", "/etc/passwd": "adapter_config.json",
               "/proc/self/environ": "adapter_config.json"}
    for i, (target, name) in enumerate(outside.items()):
        folder = write_adapter(tmp_path / f"link{i}", CONFIG, q_tensors(dims))
        (folder / name).unlink()
        (folder / name).symlink_to(target)
        assert_refused(server, folder, f"{name} is a symbolic link to outside the adapter's folder")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        fifo = write_adapter(tmp_path / f"fifo-{name}", CONFIG, q_tensors(dims))
        (fifo / name).unlink()
        os.mkfifo(fifo / name)
        started = time.monotonic()
        refused(signed_post(server, LOAD, {"lora_name": "hostile", "lora_path": str(fifo)}, timeout=10),
                400, "lora_path", f"{name} is not a regular file")
        assert time.monotonic() - started < 5
    folder = write_adapter(tmp_path / "dir", CONFIG, q_tensors(dims))
    (folder / "adapter_config.json").unlink()
    (folder / "adapter_config.json").mkdir()
    assert_refused(server, folder, "adapter_config.json is not a regular file")
    assert_refused(server, "/proc/self", "cannot read /proc/")
    assert_refused(server, f"{folder}\x00/x", "embedded null byte")
    # Within the folder, a link is fine, and the FIFOs above left later loads unblocked.
    inside = write_adapter(tmp_path / "inside", CONFIG, q_tensors(dims))
    (inside / "adapter_config.json").rename(inside / "real.json")
    (inside / "adapter_config.json").symlink_to("real.json")
    assert load_adapter(server, "linked", inside).status_code == 200
    assert unload_adapter(server, "linked").status_code == 200


BAD_NAMES = ["", "a\nb", "x\n", "../x", "..", "a..b", "a/b", ".hidden", "-x", "a b", "ä", "x" * 65, "a\x00"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_names_are_plain_tokens(server, dims, tmp_path, name):
    folder = write_adapter(tmp_path / "a", CONFIG, q_tensors(dims))
    refused(load_adapter(server, name, folder), 400, "lora_name", "an adapter's name is 1 to 64 ASCII letters")
    refused(unload_adapter(server, name), 400, "lora_name", "an adapter's name is")
    assert name not in models(server)


def test_concurrent_loads_of_one_name_load_it_once(server, dims, tmp_path):
    folder = write_adapter(tmp_path / "big", with_config(r=16, target_modules=ALL), full_tensors(dims, 16))
    def load() -> tuple[httpx.Response, set[str]]:  # what /v1/models lists the moment the answer came
        response = load_adapter(server, "twice", folder)
        return response, models(server)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: load(), range(4)))
    assert sorted(r.status_code for r, _ in answers) == [200, 400, 400, 400], [r.text for r, _ in answers]
    for r, listed in answers:  # a refused load answers once the first settled: "already served" is then true
        assert "twice" in listed
        if r.status_code == 400:
            refused(r, 400, "lora_name", "'twice' is already served")
    assert unload_adapter(server, "twice").status_code == 200


class HealthProbe:
    """Asks /health back to back on its own thread, keeping each answer's latency."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.statuses = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                self.statuses.append(client.get(f"{self.url}/health").status_code)
                self.latencies.append(time.perf_counter() - start)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_pattern_keys_cannot_freeze_the_server(server, dims, tmp_path):
    """Keys on which Python's re backtracks for minutes per module name (`([\\w.]+)+X`): with RE2 the
    largest adapter with 1024 such keys in each pattern loads in about a second, /health
    answering throughout."""
    evil = [r"([\w.]+)+X", r"(.*)*X", r"(.|.)*X", r"(.*.*)*X", r"(?:.*){12}X"]
    keys = [f"{evil[i % len(evil)]}{i}" for i in range(1024)]
    config = with_config(r=16, target_modules=ALL, alpha_pattern=dict.fromkeys(keys, 16),
                         rank_pattern=dict.fromkeys(keys, 16))
    folder = write_adapter(tmp_path / "evil", config, full_tensors(dims, 16))
    with HealthProbe(server) as probe:
        start = time.perf_counter()
        answer = load_adapter(server, "evil", folder)
        load_s = time.perf_counter() - start
    assert answer.status_code == 200, answer.text
    assert load_s < 30, load_s  # ~1 s on an idle machine; stdlib re: minutes for each key and module
    assert set(probe.statuses) == {200} and max(probe.latencies) < HEALTH_BOUND_S, max(probe.latencies)
    assert unload_adapter(server, "evil").status_code == 200


def test_loads_and_unloads_need_a_signed_peer(server, dims, tmp_path):
    folder = str(write_adapter(tmp_path / "a", CONFIG, q_tensors(dims)))
    payload = {"lora_name": "guarded", "lora_path": folder}
    body = json.dumps(payload).encode()
    stale = session_key().sign("POST", LOAD, body, now=time.time() - 120)
    other_body = session_key().sign("POST", LOAD, json.dumps({**payload, "lora_name": "other"}).encode())
    attempts = {"unsigned": {}, "another key": PeerKey.generate().sign("POST", LOAD, body), "stale": stale,
                "another body's signature": other_body, "garbage": {"x-pagedserve-peer": "1:2"}}
    for what, headers in attempts.items():
        r = httpx.post(server + LOAD, content=body, headers={"content-type": "application/json", **headers})
        assert refused(r, 403, None, "only its signed peers may call it")["code"] == "peer_auth_required", what
    # Unsigned, a hostile body is not even looked at (no probing the validation without the secret).
    r = httpx.post(server + LOAD, json={"lora_name": "../x", "lora_path": "/dev/zero"})
    refused(r, 403, None, "run-time adapter loading is internal")
    assert "guarded" not in models(server)
    assert load_adapter(server, "guarded", folder).status_code == 200
    refused(httpx.post(server + UNLOAD, json={"lora_name": "guarded"}), 403, None, "only its signed peers")
    assert "guarded" in models(server)
    assert unload_adapter(server, "guarded").status_code == 200


def test_without_a_cluster_secret_only_start_up_adapters_load(dims, tmp_path, monkeypatch):
    folder = write_adapter(tmp_path / "a", CONFIG, q_tensors(dims))
    key = session_key()  # a peer's key, which this server does not have
    monkeypatch.delenv(SECRET_ENV)  # for the server started here only: it inherits this environment
    srv = ServerProcess([*ARGS, "--lora-modules", f"boot={folder}"])
    try:
        assert "boot" in models(srv.url)
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "boot", "prompt": "Hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "boot", r.text
        error = refused(load_adapter(srv.url, "late", folder, key), 403, None, "this server has no cluster secret")
        assert error["code"] == "peer_auth_required"
        refused(signed_post(srv.url, UNLOAD, {"lora_name": "boot"}, key), 403, None, "has no cluster secret")
        assert models(srv.url) == {"SmolLM2-135M-Instruct", "boot"}
    finally:
        srv.stop()


STARTUP = {  # --lora-modules entry: what the server says as it stops
    "bad name": ("../x={folder}", "'../x=%s': an adapter's name is"),
    "bad adapter": ("nan={folder}", "--lora-modules: adapter 'nan': adapter_config.json: lora_alpha: Input should"),
}


@pytest.mark.parametrize(("module", "message"), STARTUP.values(), ids=STARTUP.keys())
def test_a_bad_start_up_adapter_stops_the_server_with_the_reason(dims, tmp_path, module, message):
    folder = write_adapter(tmp_path / "a", json.dumps(with_config(lora_alpha=float("nan"))).encode(), q_tensors(dims))
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", "0", *ARGS, "--lora-modules",
           module.format(folder=folder)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert message.replace("%s", str(folder)) in done.stderr, done.stderr[-2000:]


def test_a_hostile_load_leaves_the_server_serving(server, dims, tmp_path):
    """After everything above: a good adapter still loads and serves, and no error was a 500."""
    folder = write_adapter(tmp_path / "good", CONFIG, q_tensors(dims))
    assert load_adapter(server, "good", folder).status_code == 200
    r = httpx.post(f"{server}/v1/completions", json={"model": "good", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert 'status="500"' not in httpx.get(f"{server}/metrics", timeout=10).text  # no request ever was one
    assert unload_adapter(server, "good").status_code == 200
