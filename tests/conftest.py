"""Shared fixtures: the reference model from transformers (fp32, the same GGUF) and prompts."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve.server.peer_auth import SECRET_ENV, PeerKey

# The test session is one cluster: every server and router it starts (subprocesses inherit the environment)
# shares this secret, as `cluster up` hands its own to its replicas and router. tests/peer_support.py signs.
os.environ[SECRET_ENV] = PeerKey.generate().hex()

# Eight prompts of quite different lengths; the chat ones share the template's system prompt.
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
]
LONG_TEXT = (
    "The history of computing is a story of ideas that took decades to mature. Early mechanical calculators "
    "could add and subtract, and later designs promised general computation long before electronics made it "
    "practical. In the twentieth century, vacuum tubes gave way to transistors, transistors to integrated "
    "circuits, and each step made machines smaller, cheaper and faster. Software grew alongside: from hand-"
    "wired programs to assemblers, compilers, operating systems and networks that connect billions of devices. "
)


@pytest.fixture(scope="session")
def reference_prompts() -> list[list[int]]:
    from pagedserve.model.loader import load_model

    tok = load_model(None).tokenizer
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    plain = [tok.encode(LONG_TEXT), tok.encode(LONG_TEXT * 3), tok.encode("Once upon a time")]
    return chats + plain


@pytest.fixture
def quant_kernel(monkeypatch):
    """force(name): PAGEDSERVE_QUANT_KERNEL for the rest of the test, here and in the processes it spawns (None:
    back to the default). kernel_path caches its answer: cleared at each change and after the test."""
    from pagedserve.model.quant_linear import kernel_path

    def force(name: str | None) -> None:
        if name is None:
            monkeypatch.delenv("PAGEDSERVE_QUANT_KERNEL", raising=False)
        else:
            monkeypatch.setenv("PAGEDSERVE_QUANT_KERNEL", name)
        kernel_path.cache_clear()

    yield force
    force(None)


@pytest.fixture(scope="session")
def hf_model():
    from pagedserve.bench.hf_peer import load

    return load("float32")


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' own greedy decoding, EOS banned (min_new_tokens) so lengths are fixed."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def windows() -> list[list[int]]:
    """Two 400-token stretches of the fixed corpus (798 scored positions) for the quality tests."""
    from pagedserve.bench.workloads import corpus_tokens
    from pagedserve.model.loader import load_model

    tokens = corpus_tokens(load_model(None).tokenizer)
    return [tokens[start:start + 400] for start in (3000, 20000)]
