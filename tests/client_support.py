"""Pieces of the client compatibility suite (tests/test_client_compat.py): the tiers a client talks to (a real
`pagedserve serve`, a router in front of it, a gateway with it as its provider), the tokenizer folder the clients
that tokenize locally read, transformers' reference scores and greedy outputs, and the Node `openai` SDK."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.gateway_support import cli, gateway
from tests.router_support import RouterProcess

MODEL = "SmolLM2-135M-Instruct"
LM_EVAL_TASKS = Path(__file__).parent / "data" / "lm_eval"
# One small fp32 server for every client (fp32: the scores are compared with transformers' fp32 forward).
SERVER_ARGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "2048",
               "--embedding-model", "none"]
NODE_OPENAI = "7.60.0"  # the Node SDK's version, pinned


@dataclass(frozen=True)
class Tier:
    """Where a client sends its requests: `url` is the tier's root (no /v1)."""
    name: str
    url: str
    api_key: str = "unused"

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.v1, api_key=self.api_key, max_retries=0, timeout=300, **kwargs)


@contextlib.contextmanager
def router_tier(server_url: str, tmp: Path) -> Iterator[Tier]:
    """`pagedserve router` with the one replica (the cluster config of tests/test_router_cluster.py)."""
    config = {"policy": "least_load", "health_interval_s": 0.5, "replicas": [{"url": server_url, "name": "r0"}]}
    with RouterProcess(tmp, **config) as router:
        router.wait_healthy(["r0"])
        yield Tier("router", router.url)


@contextlib.contextmanager
def gateway_tier(server_url: str, tmp: Path) -> Iterator[Tier]:
    """`pagedserve gateway` whose one route, named as the model, calls the server. The semantic cache is off: an
    evaluation's near-identical prompts must each reach the model. Generous deadlines: the cores are shared."""
    config = {
        "cache": {"enabled": False},
        "retry": {"attempts_per_provider": 1, "request_deadline_s": 300},
        "providers": {"local": {"base_url": server_url + "/v1", "timeout_s": 300,
                                "models": {"smol": {"name": MODEL, "input": 0.1, "output": 0.4}}}},
        "routes": {MODEL: {"small": ["local/smol"]}},
    }
    process, url = gateway("compat-gw", config, tmp, admin_key="compat-admin")
    with process:
        key = json.loads(cli("gateway", "keys", "create", "--config", str(tmp / "compat-gw.yaml"),
                             "--user", "compat", "--models", MODEL))
        yield Tier("gateway", url, key["key"])


def save_tokenizer(folder: Path) -> Path:
    """The packaged GGUF's tokenizer as a Hugging Face folder (for lm-eval's and guidellm's local tokenizers)."""
    from transformers import AutoTokenizer

    from pagedserve.bench.servers import default_gguf

    gguf = default_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """transformers' forward passes on one thread: on cores shared with a server, two OpenMP threads spin against
    each other (a 15-token forward takes ~1 s instead of ~0.1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def continuation_logprobs(model, context: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether greedy decoding would write it) for each continuation, from one
    transformers forward pass over the batch (right-padded: a causal model's positions never see the padding after
    them)."""
    rows = [context + c for c in continuations]
    width = max(map(len, rows))
    with torch.inference_mode(), one_thread():
        logits = model(torch.tensor([row + [0] * (width - len(row)) for row in rows])).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
    scores = []
    for b, c in enumerate(continuations):
        positions = [len(context) + i - 1 for i in range(len(c))]
        scores.append((sum(logprobs[b, p, t].item() for p, t in zip(positions, c, strict=True)),
                       all(logprobs[b, p].argmax().item() == t for p, t in zip(positions, c, strict=True))))
    return scores


def greedy_text(model, tokenizer, ids: list[int], max_tokens: int, stop: str) -> str:
    """transformers' greedy answer (ending at the model's EOS), decoded and cut before the first `stop`."""
    with torch.inference_mode(), one_thread():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    return text.split(stop)[0]


@dataclass
class ReferenceScores:
    """What lm-eval should report for the suite's tasks, computed from transformers on the same weights."""
    choice_logprobs: list[list[float]]  # per question, per choice
    choice_greedy: list[list[bool]]  # whether greedy decoding writes the choice after the question
    answers: list[int]
    loglikelihoods: list[float]  # per paragraph
    words: int
    bytes: int

    @property
    def predictions(self) -> list[int]:
        return [max(range(len(lps)), key=lps.__getitem__) for lps in self.choice_logprobs]

    @property
    def acc(self) -> float:
        return sum(p == a for p, a in zip(self.predictions, self.answers, strict=True)) / len(self.answers)

    @property
    def word_perplexity(self) -> float:
        return math.exp(-sum(self.loglikelihoods) / self.words)

    @property
    def byte_perplexity(self) -> float:
        return math.exp(-sum(self.loglikelihoods) / self.bytes)

    @property
    def bits_per_byte(self) -> float:
        return -sum(self.loglikelihoods) / self.bytes / math.log(2)


def reference_scores(model, tokenizer) -> ReferenceScores:
    """Scores as lm-eval defines them: a choice is the continuation " " + choice after "Question: ...\\nAnswer:",
    its tokens being those of the whole text past the context's own (lm-eval's pair encoding); a paragraph is
    scored whole after the tokenizer's BOS, its words split at whitespace (lm-eval's loglikelihood_rolling)."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    choice_logprobs, choice_greedy, answers = [], [], []
    for doc in read_jsonl("compat_mc.jsonl"):
        context = f"Question: {doc['question']}\nAnswer:"
        context_ids = encode(context)
        wholes = [encode(f"{context} {choice}") for choice in doc["choices"]]
        assert all(whole[:len(context_ids)] == context_ids for whole in wholes)
        scores = continuation_logprobs(model, context_ids, [w[len(context_ids):] for w in wholes])
        choice_logprobs.append([logprob for logprob, _ in scores])
        choice_greedy.append([greedy for _, greedy in scores])
        answers.append(doc["answer"])
    loglikelihoods, words, size = [], 0, 0
    for doc in read_jsonl("compat_ppl.jsonl"):
        ((loglikelihood, _),) = continuation_logprobs(model, [tokenizer.bos_token_id], [encode(doc["text"])])
        loglikelihoods.append(loglikelihood)
        words += len(re.split(r"\s+", doc["text"]))
        size += len(doc["text"].encode())
    return ReferenceScores(choice_logprobs, choice_greedy, answers, loglikelihoods, words, size)


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (LM_EVAL_TASKS / name).read_text().splitlines() if line.strip()]


def install_node_openai(folder: Path) -> Path | None:
    """`npm install openai@NODE_OPENAI` into folder; None when node or npm is not on this machine."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return None
    (folder / "package.json").write_text(json.dumps({"name": "pagedserve-compat", "private": True}))
    done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", f"openai@{NODE_OPENAI}"],
                          cwd=folder, check=False, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"npm install openai@{NODE_OPENAI} failed (the npm registry must be reachable):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return folder


def run_node(folder: Path, script: str, tier: Tier) -> dict:
    """Runs a Node script (ES module) beside the installed SDK; it prints one JSON object."""
    path = folder / "compat.mjs"
    path.write_text(script)
    env = {**os.environ, "BASE_URL": tier.v1, "API_KEY": tier.api_key, "MODEL": MODEL}
    out = subprocess.run(["node", str(path)], check=False, cwd=folder, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, f"node failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])
