"""The docs are guides that point at files that exist.

Two checks, with rules kept simple on purpose so that a reader can predict them.

1. Every repository path named by a guide (README.md, docs/*.md, docs/measurements/**/*.md,
   experiments/labs/*.md) or by a module docstring exists. A "path" is
   - the target of a Markdown link `[text](target)` that is not a URL or an anchor, resolved
     from the guide's folder (as a browser would), or
   - in a guide, the text of an inline code span (`...`), and in a docstring any word,
     that contains a '/' and either ends in one of SUFFIXES or ends in '/' (a folder).
   A span or word is resolved from the repository root, then from the file's own folder and
   each folder above it (so a docstring of a module in strategies/ may leave out the
   strategies/ prefix).
   Not paths: URLs, absolute paths, words with a placeholder or glob (`<`, `*`, `{`, `$`,
   `...`, an upper-case folder such as `OUT/` or `RUN_DIR/`, or `NAME`), what a run writes (GENERATED:
   results/, cal/, .venv*, .whl/, runs/, tmp folders), which a fresh checkout does not hold,
   and the few files of other projects that docstrings cite (EXTERNAL).
   A link's `#anchor` into a Markdown file must name one of its headings, turned into an
   anchor as GitHub does (lower case, punctuation dropped, spaces to '-', '-1' on repeats).
2. A guide (README.md and docs/*.md; docs/measurements/ holds the records and is exempt) says
   how things are today: no line carries a date (YYYY-MM-DD), a load average, a commit of
   this repository, or the words of a lab notebook (NOTEBOOK_WORDS); README.md is at most
   250 lines and every other guide at most MAX_LINES.
"""
import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".py", ".md", ".toml", ".json", ".jsonl", ".sh")
GENERATED = ("results/", "cal/", ".venv", ".whl/", "runs/", "tmp/")
PLACEHOLDER = re.compile(r"[<>*{}$…]|\.\.\.|(^|/)[A-Z][A-Z_]+(/|$)|\bNAME\b")
# Files of other projects, named where a docstring says whose idea it follows.
EXTERNAL = {
    "doc/PERFORMANCE.md",       # nccl-tests' page on bus bandwidth
    "torch/optim/sgd.py",       # PyTorch's SGD
    "config/validation.py",     # torchtitan's validation module
}
MAX_LINES = 300
NOTEBOOK_WORDS = ("tried and not kept", "earlier run", "earlier version", "this stop",
                  "earlier the same day", "before the change", "for the record")
DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")
# "load 2.6", "load average 0.4", "load ≈ 9", "(load 0.1-0.9)": the machine's load at a moment
LOAD = re.compile(r"\bload(?: average)?\s*(?:of\s*)?[≈~=]?\s*\d", re.IGNORECASE)
# a word of 7-40 hex digits is a commit only if git says so: "1058832" is a count
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")
WORD = re.compile(r"[\w./-]+")


def guides():
    """README.md, docs/*.md and the labs' pages: the Markdown a user reads."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "measurements").rglob("*.md")),
             *sorted((ROOT / "experiments" / "labs").glob("*.md"))]
    return [f for f in files if f.exists()]


def modules():
    """Every tracked .py file of the repository (not the venv)."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        return sorted(p for p in ROOT.rglob("*.py") if ".venv" not in p.parts)
    return [ROOT / line for line in out.stdout.split()]


def looks_like_path(text):
    text = text.strip().rstrip(".,;:)")
    if "/" not in text or " " in text or "://" in text or text.startswith(("/", "~", "-")):
        return None
    if PLACEHOLDER.search(text) or any(g in text for g in GENERATED) or text in EXTERNAL:
        return None
    path = text.split("#")[0].split(":")[0]
    if path.endswith(SUFFIXES) or path.endswith("/"):
        return path
    return None


def resolves(path, where):
    """True if path exists from the root, or from `where` or one of the folders above it."""
    if (ROOT / path).exists():
        return True
    for folder in [where, *where.parents]:
        if (folder / path).exists():
            return True
        if folder == ROOT:
            break
    return False


def named_paths(md):
    """(line number, path, exists?) for each path a guide names."""
    here = md.parent
    for n, line in enumerate(md.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            path = target.split("#")[0]
            if path:
                yield n, path, (here / path).exists()
        for span in CODE.findall(line):
            path = looks_like_path(span)
            if path:
                yield n, path, resolves(path, here)


def docstring_paths(py):
    try:
        doc = ast.get_docstring(ast.parse(py.read_text()))
    except SyntaxError:
        return
    for word in WORD.findall(doc or ""):
        path = looks_like_path(word)
        if path:
            yield path, resolves(path, py.parent)


def test_every_path_a_guide_names_exists():
    missing = [f"{md.relative_to(ROOT)}:{n}: {path}"
               for md in guides() for n, path, ok in named_paths(md) if not ok]
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def anchors(md):
    """The anchors GitHub gives the headings of md."""
    seen, out = {}, set()
    fenced = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_anchor_a_guide_links_exists():
    wrong = []
    for md in guides():
        for n, line in enumerate(md.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if "://" in target or "#" not in target:
                    continue
                path, anchor = target.split("#", 1)
                dest = (md.parent / path) if path else md
                if dest.suffix == ".md" and dest.exists() and anchor not in anchors(dest):
                    wrong.append(f"{md.relative_to(ROOT)}:{n}: {target}")
    assert not wrong, "links to headings that are not there:\n" + "\n".join(wrong)


def test_every_path_a_docstring_names_exists():
    missing = [f"{py.relative_to(ROOT)}: {path}"
               for py in modules() for path, ok in docstring_paths(py) if not ok]
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def commits(words):
    """The words that name a commit of this repository (git's own answer)."""
    if not words or not (ROOT / ".git").exists():
        return set()
    query = "".join(f"{w}^{{commit}}\n" for w in sorted(words))
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input=query,
                         capture_output=True, text=True)
    found = set()
    for word, answer in zip(sorted(words), out.stdout.splitlines()):
        if not answer.endswith("missing") and " commit " in answer:
            found.add(word)
    return found


def user_guides():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("md", user_guides(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_guide_says_how_things_are_today(md):
    lines = md.read_text().splitlines()
    limit = 250 if md.name == "README.md" else MAX_LINES
    assert len(lines) <= limit, f"{md.name}: {len(lines)} lines, more than {limit}"
    problems = []
    hexes = {}
    for n, line in enumerate(lines, 1):
        low = line.lower()
        if DATE.search(line):
            problems.append(f"{n}: a date")
        if LOAD.search(line):
            problems.append(f"{n}: a load average")
        problems += [f"{n}: {w!r}" for w in NOTEBOOK_WORDS if w in low]
        for word in HEX.findall(line):
            hexes.setdefault(word, n)
    problems += [f"{n}: commit {w}" for w, n in hexes.items() if w in commits(set(hexes))]
    assert not problems, f"{md.relative_to(ROOT)} reads as a notebook:\n" + "\n".join(problems)
