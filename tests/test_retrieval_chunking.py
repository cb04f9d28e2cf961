"""Documents into chunks: heading paths, exact slices, token limits, overlap, html extraction, errors."""
from itertools import pairwise

import pytest

from pagedserve.gateway.retrieval.chunking import (
    Chunk,
    Document,
    DocumentError,
    chunk_document,
    parse_document,
)


def words(text: str) -> int:
    return len(text.split())


def chunks_of(name: str, text: str | bytes, max_tokens: int = 200, overlap_tokens: int = 40) -> list[Chunk]:
    data = text.encode() if isinstance(text, str) else text
    doc = parse_document(name, data)
    chunks = chunk_document(doc, words, max_tokens, overlap_tokens)
    check_slices(doc, chunks)
    return chunks


def check_slices(doc: Document, chunks: list[Chunk]) -> None:
    for chunk in chunks:
        assert doc.text[chunk.start:chunk.end] == chunk.text and chunk.doc == doc.name
        assert chunk.text and chunk.text == chunk.text.strip()
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)


def sentences(prefix: str, n: int) -> str:
    return " ".join(f"{prefix} sentence number {i} ends here." for i in range(n))


def test_markdown_heading_paths():
    md = """Intro before any heading.

# Leave

General rules.

## Germany

Fourteen weeks.

### Parental leave ###

Up to three years.

## France
Sixteen weeks.

# Travel

Book early.

Expenses
========

Keep receipts.

Meals
-----

```python
# a comment, not a heading
x = 1

# still code
```

~~~
## also code
~~~
"""
    chunks = chunks_of("policies/leave.md", md)
    assert [(c.heading, c.text.splitlines()[-1]) for c in chunks] == [
        ("Leave", "Intro before any heading."),
        ("Leave", "General rules."),
        ("Leave > Germany", "Fourteen weeks."),
        ("Leave > Germany > Parental leave", "Up to three years."),
        ("Leave > France", "Sixteen weeks."),
        ("Travel", "Book early."),
        ("Expenses", "Keep receipts."),
        ("Expenses > Meals", "~~~"),
    ]
    assert chunks[1].text == "# Leave\n\nGeneral rules."  # a section's first chunk holds its heading line
    assert chunks[6].text == "Expenses\n========\n\nKeep receipts."
    assert "# a comment, not a heading" in chunks[7].text and "## also code" in chunks[7].text


def test_titles():
    assert parse_document("a/leave.md", b"Some text\n\n## First heading\n\nbody").title == "First heading"
    assert parse_document("a/leave.md", b"no heading at all").title == "leave"
    assert parse_document("notes.txt", b"# not a heading in plain text").title == "notes"
    html = b"<title>Page title</title><p>text</p>"
    assert parse_document("page.html", html).title == "Page title"
    assert parse_document("page.html", html + b"<h2>Heading</h2>").title == "Heading"


def test_plain_text_has_no_headings():
    chunks = chunks_of("notes.txt", "# not a heading\nsame paragraph\n\nsecond\nparagraph\n", 6, 0)
    assert [(c.heading, c.text) for c in chunks] == [("notes", "# not a heading\nsame paragraph"),
                                                     ("notes", "second\nparagraph")]


def test_empty_parent_heading_joins_its_child_and_empty_siblings_are_skipped():
    md = "# Leave\n\n## Germany\n\n### Parental\n\nThree years.\n\n## Empty\n\n## France\n\nSixteen weeks.\n\n## End\n"
    chunks = chunks_of("leave.md", md)
    assert [(c.heading, c.text) for c in chunks] == [
        ("Leave > Germany > Parental", "# Leave\n\n## Germany\n\n### Parental\n\nThree years."),
        ("Leave > France", "## France\n\nSixteen weeks."),
    ]


def test_crlf_and_bom():
    doc = parse_document("a.md", b"\xef\xbb\xbf# Title\r\n\r\nFirst para.\r\n\r\n## Sub\r\nSecond.\r\n")
    assert doc.text.startswith("# Title") and doc.title == "Title"
    chunks = chunk_document(doc, words)
    check_slices(doc, chunks)
    assert [(c.heading, c.text) for c in chunks] == [("Title", "# Title\r\n\r\nFirst para."),
                                                     ("Title > Sub", "## Sub\r\nSecond.")]


def test_paragraphs_pack_up_to_max_tokens_within_a_section():
    paragraphs = [f"para {i} has five words" for i in range(10)]
    chunks = chunks_of("a.md", "# H\n\n" + "\n\n".join(paragraphs) + "\n\n# Next\n\nshort", 22, 0)
    assert [c.text.count("para") for c in chunks] == [4, 4, 2, 0]  # 2 + 4 * 5 words, then 4 * 5, then 2 * 5
    assert all(words(c.text) <= 22 for c in chunks)
    assert chunks[-1].text == "# Next\n\nshort"


def test_long_paragraph_is_split_at_sentences_then_whitespace():
    sentence = " ".join(f"w{i}" for i in range(50))  # one 50-word sentence without punctuation
    chunks = chunks_of("a.md", f"# H\n\n{sentences('S', 4)} {sentence}. {sentences('T', 3)}", 12, 0)
    assert [c.text for c in chunks] == [
        "# H\n\nS sentence number 0 ends here.",  # 6-word sentences; the heading line stays with the first
        "S sentence number 1 ends here. S sentence number 2 ends here.",
        "S sentence number 3 ends here.",
        *(" ".join(f"w{i}" for i in range(k, k + 12)) for k in range(0, 48, 12)),
        "w48 w49. T sentence number 0 ends here.",
        "T sentence number 1 ends here. T sentence number 2 ends here.",
    ]


def test_unbreakable_word_is_a_chunk_of_its_own():
    chunks = chunks_of("a.txt", "short words here " + "x" * 50 + " more", 1, 0)
    assert [c.text for c in chunks] == ["short", "words", "here", "x" * 50, "more"]


def test_overlap_within_a_section_not_across():
    text = f"# A\n\n{sentences('A', 30)}\n\n# B\n\n{sentences('B', 30)}"
    chunks = chunks_of("a.md", text, 24, 8)
    by_section = {h: [c for c in chunks if c.heading == h] for h in ("A", "B")}
    for section in by_section.values():
        assert len(section) > 3
        for prev, nxt in pairwise(section):
            shared = prev.text[nxt.start - prev.start:]
            assert nxt.start < prev.end and nxt.text.startswith(shared)
            assert shared.startswith(prev.heading) and shared.endswith("here.")  # a whole sentence
            assert 0 < words(shared) <= 8
    last_a, first_b = by_section["A"][-1], by_section["B"][0]
    assert first_b.start >= last_a.end and first_b.text.startswith("# B")


def test_overlap_falls_back_to_words_when_a_sentence_is_too_long():
    text = " ".join(f"w{i}" for i in range(100)) + "."
    chunks = chunks_of("a.txt", text, 30, 10)
    for prev, nxt in pairwise(chunks):
        assert 0 < words(prev.text[nxt.start - prev.start:]) <= 10
        assert words(nxt.text) <= 30


def test_html_extraction():
    html = b"""<!doctype html><html><head><title>Ignored &amp; title</title><style>p {color: red}</style>
<script>var secret = "<p>not text</p>";</script></head>
<body><nav><a href="/">Home</a> | <a href="/x">Menu</a></nav>
<h1>Caf&eacute; &amp; Bar</h1>
<p>Open   from <b>9</b>&nbsp;to 5 &lt;daily&gt;.<br>Closed on Sundays.</p>
<noscript>Enable JS</noscript>
<h2>Menu</h2><ul><li>Coffee &#8212; 2&euro;</li><li># not a heading</li></ul>
<table><tr><th>Item</th><td>Tea</td></tr></table>
<blockquote>Quoted</blockquote><dl><dt>Term</dt><dd>Definition</dd></dl>
<pre>def f():

    return 1</pre></body></html>"""
    doc = parse_document("site/cafe.html", html)
    assert doc.kind == "html" and doc.title == "Café & Bar"
    assert doc.text == (
        "# Café & Bar\n\nOpen from 9 to 5 <daily>.\nClosed on Sundays.\n\n## Menu\n\nCoffee — 2€\n\n"
        "\\# not a heading\n\nItem\n\nTea\n\nQuoted\n\nTerm\n\nDefinition\n\n```\ndef f():\n\n    return 1\n```"
    )
    for dropped in ("secret", "color", "Home", "Enable JS", "Ignored"):
        assert dropped not in doc.text
    chunks = chunk_document(doc, words)
    check_slices(doc, chunks)
    assert [c.heading for c in chunks] == ["Café & Bar", "Café & Bar > Menu"]


@pytest.mark.parametrize("name, data, message", [
    ("a.md", b"", "'a.md' is empty"),
    ("a.md", b"\xef\xbb\xbf", "'a.md' is empty"),
    ("a.md", b" \n\t\r\n ", "'a.md' contains only whitespace"),
    ("a.txt", b"text\x00more", "'a.txt' looks binary (it contains NUL bytes)"),
    ("a.txt", bytes(range(1, 9)) * 4 + b"some text", "'a.txt' looks binary (78% of its characters"),
    ("a.txt", "text".encode("utf-16"), "'a.txt' looks like UTF-16; re-encode it as UTF-8"),
    ("a.md", b"caf\xe9 au lait", "'a.md' is not valid UTF-8 (byte 0xe9 at byte offset 3); re-encode"),
    ("a.md", b"\xef\xbb\xbfcaf\xe9", "(byte 0xe9 at byte offset 6)"),
    ("report.pdf", b"%PDF", "'report.pdf': unsupported file type .pdf; supported: .htm, .html, .markdown"),
    ("README", b"text", "'README': unsupported file type (no suffix)"),
    ("a.html", b"<html><head><title>T</title></head><script>x()</script><p> </p></html>",
     "'a.html' has no readable text"),
])
def test_document_errors(name: str, data: bytes, message: str):
    with pytest.raises(DocumentError) as info:
        parse_document(name, data)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_kind_argument_overrides_the_suffix():
    assert parse_document("upload.bin", b"# Hi\n\ntext", kind="markdown").kind == "markdown"
    with pytest.raises(DocumentError, match="unknown kind 'pdf'; use one of html, markdown, text"):
        parse_document("a.md", b"x", kind="pdf")


def test_chunk_document_rejects_bad_limits():
    doc = parse_document("a.md", b"text")
    with pytest.raises(ValueError, match="overlap_tokens < max_tokens"):
        chunk_document(doc, words, 10, 10)


def test_content_hash_follows_chunk_content_only():
    sections = {name: [sentences(name, 4) for _ in range(3)] for name in ("A", "B", "C")}

    def render(b_edit: str = "") -> str:
        parts = []
        for name, paragraphs in sections.items():
            paragraphs = [p + (b_edit if name == "B" and i == 1 else "") for i, p in enumerate(paragraphs)]
            parts.append(f"## {name}\n\n" + "\n\n".join(paragraphs))
        return "# Doc\n\n" + "\n\n".join(parts)

    before = chunks_of("doc.md", render(), 30, 8)
    after = chunks_of("doc.md", render(" An edited extra sentence."), 30, 8)
    assert len(before) > 6 and parse_document("doc.md", render().encode()).content_hash != \
        parse_document("doc.md", render(" x.").encode()).content_hash

    def hashes(chunks: list[Chunk], section: str) -> list[str]:
        return [c.content_hash for c in chunks if c.heading == f"Doc > {section}"]

    assert hashes(before, "A") == hashes(after, "A") and len(hashes(before, "A")) > 1
    assert hashes(before, "C") == hashes(after, "C") and len(hashes(before, "C")) > 1
    assert [c.start for c in before if c.heading == "Doc > C"] != [c.start for c in after if c.heading == "Doc > C"]
    changed = set(hashes(after, "B")) - set(hashes(before, "B"))
    assert changed and all("edited" in c.text for c in after if c.content_hash in changed)
    assert chunks_of("other.md", render(), 30, 8)[0].content_hash != before[0].content_hash  # the doc id counts


def test_deterministic():
    text = f"# A\n\n{sentences('A', 40)}\n\n## B\n\n{sentences('B', 5)}"
    assert chunks_of("a.md", text, 20, 6) == chunks_of("a.md", text, 20, 6)


def test_token_counts_stay_few():
    calls = []

    def counting(text: str) -> int:
        calls.append(len(text))
        return words(text)

    paragraphs = "\n\n".join(sentences(f"P{i}", 8) for i in range(50))
    doc = parse_document("a.md", f"# A\n\n{paragraphs}".encode())
    chunks = chunk_document(doc, counting, 200, 40)
    assert len(chunks) > 10 and len(calls) < 400  # fewer calls than sentences,
    assert sum(calls) < 15 * len(doc.text)  # and on texts of about a chunk


def test_real_tokenizer_limit():
    from tokenizers import Tokenizer

    from pagedserve.embedding.embedder import default_model_dir

    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.no_truncation()

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    prose = ("Employees in Germany are entitled to parental leave of up to three years per child; "
             "the first year may be split into at most three blocks (see § 16 BEEG). ")
    md = "# Leave\n\n## Germany\n\n" + "\n\n".join(prose * (i % 7 + 1) for i in range(20)) + \
        "\n\n## Übersicht\n\n" + "Wörter-und-Bindestriche " * 300
    doc = parse_document("leave.md", md.encode())
    chunks = chunk_document(doc, count, 200, 40)
    check_slices(doc, chunks)
    assert len(chunks) > 10 and all(count(c.text) <= 200 for c in chunks)
    assert {c.heading for c in chunks} == {"Leave > Germany", "Leave > Übersicht"}


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # hypothesis comes with the test extras; without it these property tests are skipped
    given = None

if given is not None:
    lower_words = st.lists(st.text("abcdefg", min_size=1, max_size=5), min_size=1, max_size=12)
    sentence = lower_words.map(lambda ws: " ".join(ws)).flatmap(
        lambda s: st.sampled_from([". ", "? ", "! ", "\n", " "]).map(lambda end: s + end))
    paragraph = st.lists(sentence, min_size=1, max_size=8).map(lambda ss: "".join(ss).strip())
    heading = st.tuples(st.integers(1, 6), st.text("XYZ ", min_size=1, max_size=8).map(str.strip)).filter(
        lambda h: h[1]).map(lambda h: f"{'#' * h[0]} {h[1]}")
    block = st.one_of(paragraph, paragraph, heading)
    separator = st.sampled_from(["\n\n", "\n\n\n", "\n \n", "\r\n\r\n"])

    @st.composite
    def markdown(draw) -> str:
        blocks = draw(st.lists(block, min_size=1, max_size=12))
        lead, tail = draw(st.sampled_from(["", "\n", "  "])), draw(st.sampled_from(["", "\n", " \n"]))
        return lead + "".join(b + draw(separator) for b in blocks[:-1]) + blocks[-1] + tail

    @settings(max_examples=150, deadline=None)
    @given(markdown(), st.sampled_from(["a.md", "a.txt"]), st.integers(3, 40), st.integers(0, 10))
    def test_random_documents_keep_the_invariants(text: str, name: str, max_tokens: int, overlap: int):
        doc = parse_document(name, text.encode())
        overlap = min(overlap, max_tokens - 1)
        chunks = chunk_document(doc, words, max_tokens, overlap)
        check_slices(doc, chunks)
        assert all(words(c.text) <= max_tokens for c in chunks)  # every word has at most 5 letters
        covered = set().union(*(range(c.start, c.end) for c in chunks))
        assert all(i in covered for i, ch in enumerate(doc.text) if ch in "abcdefg")  # no paragraph text lost
        heading_words = sum(words(line) for line in doc.text.splitlines() if line.lstrip().startswith("#"))
        if name == "a.md" and heading_words < max_tokens - overlap:  # else headings alone may fill a chunk
            assert all(any(ch in "abcdefg" for ch in c.text) for c in chunks)  # no chunk of only headings

    html_text = st.lists(st.sampled_from(list("ab <>&;#\n") + ["&amp;", "&lt;", "é", "&#233;"]), max_size=30).map("".join)
    html_block = st.tuples(st.sampled_from(["p", "h1", "h3", "li", "td", "pre", "div", "span", "script"]),
                           html_text)

    @settings(max_examples=100, deadline=None)
    @given(st.lists(html_block, min_size=1, max_size=8), st.integers(2, 20))
    def test_random_html_keeps_the_invariants(blocks: list[tuple[str, str]], max_tokens: int):
        html = "".join(f"<{tag}>{text}</{tag}>" for tag, text in blocks)
        try:
            doc = parse_document("a.html", html.encode())
        except DocumentError as e:
            assert "no readable text" in str(e) or "only whitespace" in str(e)
            return
        chunks = chunk_document(doc, words, max_tokens, max_tokens // 3)
        check_slices(doc, chunks)
        assert all(words(c.text) <= max_tokens for c in chunks)
