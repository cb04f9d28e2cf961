"""Documents (markdown, plain text, html) parsed and cut into heading-aware chunks for the hybrid index.

Every chunk is an exact slice of its document's text, so offsets can point a reader back at the source.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import PurePosixPath

SUFFIXES: dict[str, str] = {
    ".md": "markdown", ".markdown": "markdown",
    ".txt": "text", ".text": "text", ".rst": "text",
    ".html": "html", ".htm": "html",
}
_BOM = b"\xef\xbb\xbf"
_MAX_CONTROL_SHARE = 0.30

_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*))?$")
_SETEXT = re.compile(r" {0,3}(=+|-+)$")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
# The whitespace between two sentences: after ". ", "? ", "! ", or around a line break.
_SENTENCE_GAP = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")
_SPACE = re.compile(r"\s+")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # control characters other than whitespace


class DocumentError(ValueError):
    """A document that cannot be indexed; the message names it and says why."""


@dataclass(slots=True, frozen=True)
class Document:
    name: str
    kind: str  # "markdown" | "text" | "html"
    title: str
    text: str  # what chunk offsets point into; for html, the extracted markdown-like text
    content_hash: str  # sha256 hex of the raw bytes


@dataclass(slots=True, frozen=True)
class Chunk:
    doc: str
    heading: str  # heading path joined with " > "; the document title when there is none
    start: int
    end: int
    text: str  # == document.text[start:end]
    content_hash: str  # sha256 hex of f"{doc}\n{heading}\n{text}": unchanged while this chunk's content is


def parse_document(name: str, data: bytes, kind: str | None = None) -> Document:
    """Checks, decodes and (for html) extracts one document file; raises DocumentError when unusable."""
    kind = _kind(name, kind)
    text = _decode(name, data)
    if kind == "html":
        text, html_title = _html_to_markdown(name, text)
    else:
        html_title = ""
    headings = (b.title for b in _scan(text, kind != "text") if b.level)
    title = next(headings, "") or html_title or PurePosixPath(name).stem
    return Document(name, kind, title, text, hashlib.sha256(data).hexdigest())


def chunk_document(doc: Document, count_tokens: Callable[[str], int], max_tokens: int = 200,
                   overlap_tokens: int = 40) -> list[Chunk]:
    """Cuts a document into chunks of at most max_tokens, following its sections, in document order."""
    if max_tokens < 1 or not 0 <= overlap_tokens < max_tokens:
        raise ValueError(f"need max_tokens >= 1 and 0 <= overlap_tokens < max_tokens, got "
                         f"{max_tokens} and {overlap_tokens}")
    chunks = []
    for section in _sections(doc):
        units = _units(doc.text, section, count_tokens, max_tokens, overlap_tokens)
        for start, end in _pack(doc.text, units, count_tokens, max_tokens, overlap_tokens):
            text = doc.text[start:end]
            digest = hashlib.sha256(f"{doc.name}\n{section.heading}\n{text}".encode()).hexdigest()
            chunks.append(Chunk(doc.name, section.heading, start, end, text, digest))
    return chunks


# --- decoding -------------------------------------------------------------------------------------------


def _kind(name: str, kind: str | None) -> str:
    kinds = sorted(set(SUFFIXES.values()))
    if kind is not None:
        if kind not in kinds:
            raise DocumentError(f"document {name!r}: unknown kind {kind!r}; use one of {', '.join(kinds)}")
        return kind
    suffix = PurePosixPath(name).suffix.lower()
    if suffix not in SUFFIXES:
        raise DocumentError(f"document {name!r}: unsupported file type {suffix or '(no suffix)'}; "
                            f"supported: {', '.join(sorted(SUFFIXES))}")
    return SUFFIXES[suffix]


def _decode(name: str, data: bytes) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DocumentError(f"document {name!r} looks like UTF-16; re-encode it as UTF-8")
    if b"\x00" in data:
        raise DocumentError(f"document {name!r} looks binary (it contains NUL bytes); "
                            "only UTF-8 text, markdown and html are supported")
    skipped = len(_BOM) if data.startswith(_BOM) else 0
    try:
        text = data[skipped:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = skipped + e.start
        raise DocumentError(f"document {name!r} is not valid UTF-8 (byte 0x{data[offset]:02x} at byte offset "
                            f"{offset}); re-encode it as UTF-8") from None
    if not text:
        raise DocumentError(f"document {name!r} is empty")
    if not text.strip():
        raise DocumentError(f"document {name!r} contains only whitespace")
    controls = len(_CONTROL.findall(text))
    if controls > _MAX_CONTROL_SHARE * len(text):
        raise DocumentError(f"document {name!r} looks binary ({controls / len(text):.0%} of its characters "
                            "are control characters); only text, markdown and html are supported")
    return text


# --- html -----------------------------------------------------------------------------------------------

_SKIPPED_TAGS = {"script", "style", "head", "nav", "noscript", "template"}
_BLOCK_TAGS = {
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "div", "dl", "dt",
    "fieldset", "figcaption", "figure", "footer", "form", "header", "hr", "html", "legend", "li", "main",
    "ol", "p", "section", "summary", "table", "td", "th", "tr", "ul",
}
_HEADING_TAGS = {f"h{level}": level for level in range(1, 7)}


class _HtmlText(HTMLParser):
    """Collects the readable blocks of an html page as markdown-like text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)  # entities arrive unescaped in handle_data
        self.blocks: list[str] = []
        self.title = ""
        self._buffer: list[str] = []
        self._skipping: dict[str, int] = {}
        self._heading = 0
        self._pre = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        elif tag == "body":
            self._skipping.pop("head", None)  # </head> is optional
        if tag in _SKIPPED_TAGS:
            self._skipping[tag] = self._skipping.get(tag, 0) + 1
        elif tag == "br":
            self._buffer.append("\n")
        elif tag in _HEADING_TAGS or tag in _BLOCK_TAGS or tag == "pre":
            self._flush()
            self._heading = _HEADING_TAGS.get(tag, self._heading)
            self._pre += 1 if tag == "pre" else 0

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag in _SKIPPED_TAGS:
            self._skipping[tag] = max(0, self._skipping.get(tag, 0) - 1)
        elif tag in _HEADING_TAGS or tag in _BLOCK_TAGS or tag == "pre":
            self._flush()
            self._heading = 0 if tag in _HEADING_TAGS else self._heading
            self._pre = max(0, self._pre - 1) if tag == "pre" else self._pre

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not any(self._skipping.values()):
            self._buffer.append(data if self._pre else _SPACE.sub(" ", data))

    def close(self) -> None:
        super().close()
        self._flush()

    def _flush(self) -> None:
        raw, self._buffer = "".join(self._buffer), []
        if self._pre:
            code = raw.removeprefix("\n").rstrip()
            fence = "`" * max([3] + [len(run) + 1 for run in re.findall(r"`+", code)])
            if code.strip():
                self.blocks.append(f"{fence}\n{code}\n{fence}")
            return
        lines = [" ".join(line.split()) for line in raw.split("\n")]
        lines = [line for line in lines if line]
        if lines and self._heading:
            self.blocks.append("#" * self._heading + " " + " ".join(lines))
        elif lines:
            self.blocks.append("\n".join(_escape(line) for line in lines))


def _escape(line: str) -> str:
    """Keeps a line of html text from reading as markdown structure (a heading, an underline, a fence)."""
    return "\\" + line if _ATX.match(line) or _SETEXT.match(line) or _FENCE.match(line) else line


def _html_to_markdown(name: str, html: str) -> tuple[str, str]:
    parser = _HtmlText()
    parser.feed(html)
    parser.close()
    if not parser.blocks:
        raise DocumentError(f"document {name!r} has no readable text (html with only markup, scripts "
                            "or styles)")
    return "\n\n".join(parser.blocks), " ".join(parser.title.split())


# --- structure ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Block:
    level: int  # 1-6 for a heading, 0 for a paragraph
    title: str
    start: int
    end: int


@dataclass(slots=True)
class _Section:
    heading: str
    level: int  # 0 for text before the first heading
    start: int | None  # where its first chunk starts: its heading line, an empty parent's, or None
    paragraphs: list[tuple[int, int]] = field(default_factory=list)


def _scan(text: str, markdown: bool) -> list[_Block]:
    """Headings and paragraphs, as stripped spans; markdown structure is read only when markdown is set."""
    blocks: list[_Block] = []
    lines: list[tuple[int, str]] = []  # the open paragraph's lines, with their offsets
    fence: str | None = None

    def close() -> None:
        if lines:
            (first, head), (last, tail) = lines[0], lines[-1]
            start = first + len(head) - len(head.lstrip())
            blocks.append(_Block(0, "", start, last + len(tail.rstrip())))
            lines.clear()

    offset = 0
    for line in text.split("\n"):
        at, offset = offset, offset + len(line) + 1
        bare = line.strip()
        if fence is not None:  # inside a code block nothing is structure, not even a blank line
            lines.append((at, line))
            fence = None if bare.startswith(fence) and bare == bare[0] * len(bare) else fence
        elif not bare:
            close()
        elif markdown and (m := _FENCE.match(line)):
            close()
            lines.append((at, line))
            fence = m[1]
        elif markdown and (m := _ATX.match(line.rstrip())) and (title := _atx_title(m[2])):
            close()
            blocks.append(_Block(len(m[1]), title, at + len(line) - len(line.lstrip()), at + len(line.rstrip())))
        elif markdown and (m := _SETEXT.match(line.rstrip())) and len(lines) == 1:
            first, head = lines.pop()
            level = 1 if m[1][0] == "=" else 2
            blocks.append(_Block(level, head.strip(), first + len(head) - len(head.lstrip()),
                                 at + len(line.rstrip())))
        else:
            lines.append((at, line))
    close()
    return blocks


def _atx_title(rest: str | None) -> str:
    return re.sub(r"(?:^|[ \t]+)#+$", "", rest or "").strip()


def _sections(doc: Document) -> list[_Section]:
    """Groups paragraphs under their heading paths.

    A heading with no text of its own before a deeper heading (an empty parent, as in "# Leave" then
    "## Germany") is kept: its line joins the first chunk of the section beneath it, so that chunk still reads
    in context. An empty heading followed by a sibling or higher heading, or at the end, has nothing to give
    a reader and is skipped (it would be a chunk of only a heading line).
    """
    path: list[tuple[int, str]] = []
    sections = [_Section(doc.title, 0, None)]
    for block in _scan(doc.text, doc.kind != "text"):
        current = sections[-1]
        if not block.level:
            current.paragraphs.append((block.start, block.end))
            continue
        while path and path[-1][0] >= block.level:
            path.pop()
        path.append((block.level, block.title))
        empty_parent = not current.paragraphs and 0 < current.level < block.level
        start = current.start if empty_parent else block.start
        sections.append(_Section(" > ".join(title for _, title in path), block.level, start))
    return [s for s in sections if s.paragraphs]


# --- packing --------------------------------------------------------------------------------------------

Span = tuple[int, int]


def _units(text: str, section: _Section, count: Callable[[str], int], max_tokens: int,
           overlap_tokens: int) -> list[Span]:
    """The section's paragraphs (its first one with the heading lines), oversized ones cut at sentences,
    and sentences still too long cut at whitespace into pieces that leave room for the next one's overlap."""
    units: list[Span] = []
    for k, (start, end) in enumerate(section.paragraphs):
        lead = section.start if k == 0 and section.start is not None else start
        if count(text[lead:end]) <= max_tokens:
            units.append((lead, end))
            continue
        # Heading lines stay glued to the first sentence: cut only inside the paragraph itself.
        gaps = list(_SENTENCE_GAP.finditer(text, start, end))
        sentences = zip([lead] + [g.end() for g in gaps], [g.start() for g in gaps] + [end])
        for s, e in sentences:
            if count(text[s:e]) <= max_tokens:
                units.append((s, e))
            else:
                words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text[s:e])]
                units += _pack(text, [(s + a, s + b) for a, b in words], count, max_tokens - overlap_tokens, 0)
    return units


def _pack(text: str, units: list[Span], count: Callable[[str], int], max_tokens: int,
          overlap_tokens: int) -> list[Span]:
    """Greedily joins consecutive units into spans of at most max_tokens; each span after the first starts
    with the tail of the previous one (overlap_tokens worth at most)."""

    def reach(start: int, i: int) -> int:  # how many units from units[i] on fit in a span from start
        return _last_true(lambda n: count(text[start:units[i + n - 1][1]]) <= max_tokens, len(units) - i)

    spans: list[Span] = []
    i = 0
    while i < len(units):
        start = units[i][0]
        if spans and overlap_tokens:
            start = _overlap_start(text, spans[-1], units[i], count, max_tokens, overlap_tokens)
        n = max(reach(start, i), 1)  # a single unbreakable word may exceed max_tokens
        spans.append((start, units[i + n - 1][1]))
        i += n
    return spans


def _overlap_start(text: str, previous: Span, unit: Span, count: Callable[[str], int], max_tokens: int,
                   overlap_tokens: int) -> int:
    """The earliest start inside the previous span whose tail fits overlap_tokens and, with the next unit,
    max_tokens: whole sentences if they give at least half the overlap, else whole words; else no overlap."""
    begin, end = previous

    def earliest(starts: list[int]) -> int | None:  # starts nearest the end first
        def fits(k: int) -> bool:
            start = starts[k - 1]
            return count(text[start:end]) <= overlap_tokens and count(text[start:unit[1]]) <= max_tokens

        n = _last_true(fits, len(starts))
        return starts[n - 1] if n else None

    best = unit[0]
    for gap in (_SENTENCE_GAP, _SPACE):
        start = earliest([m.end() for m in gap.finditer(text, begin, end)][::-1])
        if start is not None:
            best = start
            if 2 * count(text[best:end]) >= overlap_tokens:
                break
    return best


def _last_true(pred: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with pred(n), for pred true up to some n and false after (pred(0) assumed).

    Gallops then bisects, so the cost follows the answer rather than hi: few token counts per chunk."""
    good, bad, step = 0, hi + 1, 1
    while good + step < bad:
        if pred(good + step):
            good, step = good + step, step * 2
        else:
            bad = good + step
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if pred(mid) else (good, mid)
    return good
