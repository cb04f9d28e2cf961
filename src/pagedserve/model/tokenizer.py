"""Tokenizer (HF `tokenizers`) and chat template, built from GGUF metadata or a tokenizer.json."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
CONTROL, USER_DEFINED = 3, 4


class Tokenizer:
    def __init__(self, backend: HFTokenizer, eos_token_ids: list[int], bos_token_id: int | None,
                 chat_template: str | None, add_bos: bool = False) -> None:
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else the server writes them in Hermes style)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (a base model): give it one with --chat-template FILE "
                             "(LLM(chat_template=...)), or use completions")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        special = self.backend.get_added_tokens_decoder()
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=special[self.bos_token_id].content if self.bos_token_id in special else "",
            eos_token=special[self.eos_token_id].content if self.eos_token_id in special else "",
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta)
        elif kind == "llama" and arch == "gemma3":
            backend = _gemma_bpe(tokens)
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} for {arch!r}; supported: byte-level BPE "
                             "('gpt2'), and SentencePiece BPE ('llama') for gemma3")
        types = meta.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == CONTROL])
        user = [i for i, t in enumerate(types) if t == USER_DEFINED]
        if kind == "llama":  # whitespace runs respelled in the vocabulary are the BPE's to match, not added text
            user = [i for i in user if backend.token_to_id(tokens[i]) == i]
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        eos_ids = [i for i in (eos, eot) if i is not None]
        return cls(backend, list(dict.fromkeys(eos_ids)), meta.get("tokenizer.ggml.bos_token_id"),
                   meta.get("tokenizer.chat_template"), bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: list[int], bos_token_id: int | None) -> Tokenizer:
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos_ids = list(eos_token_ids)
        if not eos_ids and isinstance(cfg.get("eos_token"), str):
            eos_ids = [backend.token_to_id(cfg["eos_token"])]
        return cls(backend, eos_ids, bos_token_id, template, bool(cfg.get("add_bos_token", False)))


def _byte_level_bpe(tokens: list[str], meta: dict) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]) if meta.get("tokenizer.ggml.pre") == "smollm" else pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _gemma_bpe(tokens: list[str]) -> HFTokenizer:
    """Gemma's SentencePiece vocabulary as a BPE with byte fallback, spaces written as U+2581 (as transformers
    converts it, so both tokenize alike). The GGUF lists no merges: a token's splits into two vocabulary tokens
    are its merges, ranked by the token's place in the vocabulary (Gemma's scores do not follow merge order),
    longer left parts first. Whitespace tokens with spaces are stored as such and looked up as U+2581 runs."""
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}  # a repeated spelling keeps its last id, as a dict does
    merges = []
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        merges += [(token[:j], token[j:]) for j in range(len(token) - 1, 0, -1)
                   if token[:j] in vocab and token[j:] in vocab]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                                     byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
