"""The documentation is checked like code: every repository path the guides name exists, every
section they cite by file and title exists, every Python block compiles (and runs, where it can
run alone), and every command of their bash blocks names scripts that exist.

The guides: README.md, bench/README.md, bench/cluster/README.md, docs/*.md and examples/*.md
(the same list as tests/bench/test_help.py, which parses the arguments of every documented
command of a bench/ or examples/ script).

**Results.** bench/RESULTS.md (today's answers) and bench/results/README.md (the index of the
dated pages) are checked as the guides are for paths, anchors, sections and the scripts of their
commands; their commands' arguments are those of their commit and not parsed. The dated pages
under bench/results/ keep the paths of their commit: only their links and anchors are checked.
Code (qcomm/, bench/, examples/, tests/) that names a page of results, with the start of a
section's title in quotes after it or an anchor, names a page, section and anchor that exist.

**Paths.** A path is a word of an inline code span, a link target, or a word of the text that
starts with a top-level entry of the repository (``docs/``, ``qcomm/``, ...) or of the guide's
folder, when it contains a ``/`` or ends in one of EXTENSIONS. It must exist relative to the
repository root or to the guide's folder (a link: to the guide's folder, as a browser reads
it) and not be git-ignored. Passed over: URLs, absolute paths (``/tmp/...``), ``~``, globs,
placeholders (``<workload>``, ``$OUT``, ``{tag}``), words with ``=``, command-line flags, the
outputs of the documented commands (OUTPUTS, OUTPUT_DIRS) and PLACEHOLDERS. A code span inside
a link to a URL names a file of another project. A link's ``#anchor`` must be a heading of the
target, and ``path.md, "Title"`` must name the start of a heading of that file.

**Python blocks.** Every fenced ``python`` block compiles. An unmarked block also runs, as
written, in a fresh interpreter (repository on PYTHONPATH, a temporary working directory,
RUN_TIMEOUT_S); README.md's snippets are such blocks. A marker on the line before the fence
says otherwise, with the reason:

    <!-- not run: needs several processes -->     compiled, not run
    <!-- not code: the output of the command above -->   neither (not Python on its own)

Use them for what cannot run alone in a second: a fragment of a multi-process job, a GPU. The
program of a ``python -c "..."`` in a bash block counts as a Python block (a ``not run`` marker
before the bash block applies to it).

**Bash blocks.** Every script a command line names (a word ending in .py or .sh, or a path
under a top-level folder of the repository) exists; ``git show REV:path`` names ``path``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bench.test_help import DOCS as HELP_DOCS
from tests.bench.test_help import DOCUMENTED

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "bench/README.md", REPO / "bench/cluster/README.md",
               *REPO.glob("docs/*.md"), *REPO.glob("examples/*.md")])
# Today's answers and the index of the dated pages; the dated pages themselves.
SUMMARIES = [REPO / "bench/RESULTS.md", REPO / "bench/results/README.md"]
DATED = sorted((REPO / "bench/results").glob("*.md"))
DATED = [p for p in DATED if p not in SUMMARIES]
# Where code may name a page of results (this file's own examples are broken on purpose).
CODE = sorted(p for top in ("qcomm", "bench", "examples", "tests")
              for p in (REPO / top).rglob("*")
              if p.suffix in (".py", ".sh") and p != Path(__file__).resolve())
RUN_TIMEOUT_S = 120
EXTENSIONS = (".py", ".md", ".sh", ".json", ".png", ".toml", ".txt", ".c", ".yml", ".yaml",
              ".cfg", ".ini", ".csv", ".npz")
# Files the documented commands write: named as outputs, not files of the repository.
OUTPUTS = {
    "summary.json": "bench/cluster/compare.py's summary, in its output folder",
    "rank00000.json": "the record beside a checkpoint file (docs/guide.md, Checkpoints)",
    "rankNNNNN.json": "the same, of any rank (docs/reliability.md)",
}
OUTPUT_DIRS = ("bench/out/", "ckpt/", ".venv/")
# Names that stand for the reader's own files.
PLACEHOLDERS = {"train.py": "the reader's training script (the torchrun lines of README.md "
                             "and docs/guide.md)"}
MARKER = re.compile(r"^\s*<!--\s*not (run|code)\b:?\s*(.*?)\s*-->\s*$")


# ---------------------------------------------------------------------------------------------
# reading a guide


@dataclass
class Fence:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str  # dedented by the fence's own indent
    marker: str | None  # "run" / "code" of a `<!-- not ... -->` on the line before, or None
    reason: str


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else p.as_posix()


def fences(doc: Path) -> list[Fence]:
    lines = doc.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        opening = lines[i].lstrip()
        if not opening.startswith("```"):
            i += 1
            continue
        indent = len(lines[i]) - len(opening)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = "\n".join(line[indent:] if line[:indent].strip() == "" else line
                         for line in lines[i + 1:j]) + "\n"
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        m = MARKER.match(before)
        out.append(Fence(doc, i + 1, opening[3:].strip(), body, m and m.group(1),
                         m.group(2) if m else ""))
        i = j + 1
    return out


def prose(doc: Path) -> str:
    """The guide with every fenced block blanked (line numbers kept)."""
    lines = doc.read_text().split("\n")
    for f in fences(doc):
        n = f.body.count("\n") + 1
        for k in range(f.line - 1, min(f.line - 1 + n + 1, len(lines))):
            lines[k] = ""
    return "\n".join(lines)


CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"\[([^\[\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _tops(doc: Path) -> set[str]:
    return {p.name for p in REPO.iterdir()} | {p.name for p in doc.parent.iterdir()}


def candidate(word: str, doc: Path) -> str | None:
    """``word`` as a repository path the guide names, or None when it is not one."""
    word = word.strip("()[],;:'\"").rstrip(".")
    word = word.split("::")[0]  # a pytest node id
    word = re.sub(r":\d+$", "", word)  # path:line
    if "://" in word or word.startswith(("-", "/", "~", "$", "mailto:")):
        return None
    if ":" in word:  # git show REV:path
        word = word.rsplit(":", 1)[1]
    if not word or any(c in word for c in "*<>{}$=%") or not re.fullmatch(r"[\w.\-/+@]+", word):
        return None
    if (word in OUTPUTS or word in PLACEHOLDERS or word.startswith(OUTPUT_DIRS)
            or word + "/" in OUTPUT_DIRS):
        return None
    if "/" not in word:
        return word if word.endswith(EXTENSIONS) else None
    if word.endswith(EXTENSIONS) or word.endswith("/") or word.split("/")[0] in _tops(doc):
        return word
    return None  # 1/N, H/F, store_addr/port: not paths


@dataclass(frozen=True)
class Ref:
    doc: Path
    line: int
    path: str
    how: str  # "code", "link", "text"


def references(doc: Path) -> list[Ref]:
    text = prose(doc)
    refs: list[Ref] = []
    external = []  # spans inside links to URLs: files of other projects
    for m in LINK.finditer(text):
        target = m.group(2)
        if "://" in target or target.startswith("mailto:"):
            external.append((m.start(1), m.end(1)))
            continue
        path = target.split("#")[0]
        if path:
            refs.append(Ref(doc, _line(text, m.start()), path, "link"))
    for m in CODE_SPAN.finditer(text):
        if any(a <= m.start() < b for a, b in external):
            continue
        for word in m.group(2).split():
            path = candidate(word, doc)
            if path:
                refs.append(Ref(doc, _line(text, m.start()), path, "code"))
    bare = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)
    bare = LINK.sub(lambda m: " " * len(m.group(0)), bare)
    tops = _tops(doc)
    for m in re.finditer(r"(?<![\w/.`-])([\w.-]+/[\w./-]*[\w/])", bare):
        if m.group(1).split("/")[0] in tops:
            path = candidate(m.group(1), doc)
            if path:
                refs.append(Ref(doc, _line(bare, m.start()), path, "text"))
    return refs


def resolve(ref: Ref) -> Path | None:
    bases = [ref.doc.parent] if ref.how == "link" else [REPO, ref.doc.parent]
    for base in bases:
        p = (base / ref.path).resolve()
        if p.exists() and p.is_relative_to(REPO):
            return p
    return None


def _ignored(paths: list[Path]) -> set[Path]:
    """The ``paths`` that git ignores (none when git cannot tell)."""
    if not paths:
        return set()
    try:
        proc = subprocess.run(["git", "check-ignore", "--stdin"], cwd=REPO, text=True,
                              input="\n".join(_rel(p) for p in paths), capture_output=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if proc.returncode not in (0, 1):  # 128: not a checkout
        return set()
    return {REPO / line for line in proc.stdout.splitlines() if line}


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(doc: Path) -> list[str]:
    text = prose(doc)
    return [re.sub(r"\s+", " ", m.group(1).replace("`", "")).strip()
            for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE)]


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(doc):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# Python blocks, and the programs of `python -c`


@dataclass
class Program:
    doc: Path
    line: int
    source: str
    kind: str  # "run", "compile", "exempt"
    reason: str

    @property
    def id(self) -> str:
        return f"{_rel(self.doc)}:{self.line}"


def _python_c(block: str) -> list[str]:
    """The programs of the ``python -c PROGRAM`` commands of a bash block."""
    try:
        words = shlex.split(block.replace("\\\n", ""), comments=True)
    except ValueError:
        return []
    return [words[i + 1] for i in range(1, len(words) - 1)
            if words[i] == "-c" and Path(words[i - 1]).name.startswith("python")]


def programs() -> list[Program]:
    out = []
    for doc in DOCS:
        for f in fences(doc):
            if f.lang == "python":
                sources = [f.body]
            elif f.lang in ("bash", "sh", "shell", "console"):
                sources = _python_c(f.body)
            else:
                continue
            for src in sources:
                if f.marker == "code" and f.lang == "python":
                    kind = "exempt"
                elif f.marker in ("run", "code"):
                    kind = "compile"
                else:
                    kind = "run"
                out.append(Program(doc, f.line, src, kind, f.reason))
    return out


PROGRAMS = programs()


# ---------------------------------------------------------------------------------------------
# the tests


def test_the_guides_are_those_test_help_reads() -> None:
    assert DOCS == HELP_DOCS


def test_the_extraction_finds_what_it_should() -> None:
    # Guards the parsing: a change of the guides' markup must not empty a check silently.
    refs = [r for d in DOCS for r in references(d)]
    found = {(_rel(r.doc), r.path, r.how) for r in refs}
    assert ("README.md", "docs/design.md", "link") in found
    assert ("README.md", "bench/cluster/netns.sh", "code") in found
    assert ("bench/README.md", "kernels.py", "code") in found
    assert ("docs/engine.md", "docs/reliability.md", "text") in found
    assert len(refs) > 150
    assert "run-on-several-machines" in anchors(REPO / "README.md")
    assert "at-the-end-of-a-run" in anchors(REPO / "bench/RESULTS.md")
    # a comment wrapped between a page and its section's title
    assert any(page == "bench/results/2026-12-01-peers-tuned.md" and title == "Peers tuned"
               for _, page, _, title in code_result_refs(REPO / "bench/cluster/decisive.py"))
    assert sum(p.kind == "run" for p in PROGRAMS) >= 1
    # the front page's three ways in (the codec, the optimizers, the DDP hook) run as written
    assert sum(p.kind == "run" for p in PROGRAMS if p.doc == REPO / "README.md") >= 3


@pytest.mark.parametrize("doc", DOCS + SUMMARIES, ids=_rel)
def test_named_paths_exist(doc: Path) -> None:
    refs = references(doc)
    missing = [r for r in refs if resolve(r) is None]
    found = {r: p for r in refs if (p := resolve(r)) is not None}
    ignored = _ignored(sorted(set(found.values())))
    outputs = [r for r, p in found.items() if p in ignored]
    assert not missing, "paths that do not exist:\n" + "\n".join(
        f"  {_rel(doc)}:{r.line}: {r.path} ({r.how})" for r in missing)
    assert not outputs, "paths git ignores (outputs, not repository files):\n" + "\n".join(
        f"  {_rel(doc)}:{r.line}: {r.path}" for r in outputs)


def _link_target(doc: Path, path: str) -> Path:
    """The Markdown file a link of ``doc`` opens: a folder's README.md, as GitHub shows it."""
    target = (doc.parent / path) if path else doc
    if target.is_dir() and (target / "README.md").is_file():
        return target / "README.md"
    return target


def bad_anchors(doc: Path, sections: bool = True) -> list[str]:
    """The links of ``doc`` whose ``#anchor`` is no heading of their page, and (``sections``)
    its ``path.md, "Title"`` that begin no heading of that file."""
    text = prose(doc)
    bad = []
    for m in LINK.finditer(text):
        path, _, anchor = m.group(2).partition("#")
        if not anchor or "://" in path:
            continue
        target = _link_target(doc, path)
        if target.suffix == ".md" and target.is_file() and anchor not in anchors(target):
            bad.append(f"{_rel(doc)}:{_line(text, m.start())}: #{anchor} is no heading of "
                       f"{_rel(target)}")
    if not sections:
        return bad
    spans_open = CODE_SPAN.sub(lambda m: m.group(2), text)
    for m in re.finditer(r"([\w./-]+\.md),\s+\"([^\"]+)\"", spans_open):
        ref = Ref(doc, 0, m.group(1), "code")
        target = resolve(ref)
        title = re.sub(r"\s+", " ", m.group(2)).strip()
        if target is None:
            continue  # test_named_paths_exist says so
        if not any(h.startswith(title) for h in headings(target)):
            bad.append(f'{_rel(doc)}:{_line(spans_open, m.start())}: "{title}" begins no '
                       f"heading of {_rel(target)}")
    return bad


@pytest.mark.parametrize("doc", DOCS + SUMMARIES, ids=_rel)
def test_named_anchors_and_sections_exist(doc: Path) -> None:
    bad = bad_anchors(doc)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DATED, ids=_rel)
def test_dated_pages_links_resolve(doc: Path) -> None:
    """A dated page keeps the paths of its commit in its text, but its links are followed."""
    refs = [r for r in references(doc) if r.how == "link"]
    missing = [f"{_rel(doc)}:{r.line}: {r.path}" for r in refs if resolve(r) is None]
    bad = missing + bad_anchors(doc, sections=False)
    assert not bad, "\n".join(bad)


def test_every_dated_page_is_indexed() -> None:
    index = prose(REPO / "bench/results/README.md")
    linked = {(REPO / "bench/results" / m.group(2).partition("#")[0]).resolve()
              for m in LINK.finditer(index)}
    assert DATED and not [_rel(p) for p in DATED if p.resolve() not in linked]


RESULT_REF = re.compile(r"((?:bench/)?(?:RESULTS\.md|results/[\w./-]+\.md))"
                        r"(?:#([\w-]+)|,\s*(?:#\s*)?\"([^\"]+)\")?")


def code_result_refs(path: Path) -> list[tuple[int, str, str | None, str | None]]:
    """(line, page, anchor, title) of each page of results ``path`` names; comment markers
    between a page and its quoted title (a comment wrapped over lines) are passed over."""
    text = path.read_text(errors="replace")
    out = []
    for m in RESULT_REF.finditer(text):
        page = m.group(1)
        page = page if page.startswith("bench/") else "bench/" + page
        title = re.sub(r"\s*\n\s*#?\s*", " ", m.group(3)).strip() if m.group(3) else None
        out.append((_line(text, m.start()), page, m.group(2), title))
    return out


def test_code_names_pages_of_results_that_exist() -> None:
    bad = []
    for path in CODE:
        for line, page, anchor, title in code_result_refs(path):
            target = REPO / page
            where = f"{_rel(path)}:{line}: {page}"
            if not target.is_file():
                bad.append(f"{where}: no such page")
            elif anchor and anchor not in anchors(target):
                bad.append(f"{where}#{anchor}: no such heading")
            elif title and not any(h.startswith(title) for h in headings(target)):
                bad.append(f'{where}, "{title}": begins no heading')
    assert not bad, "\n".join(bad)


SECTION_REF = re.compile(r"([\w./-]+\.md),\s*(?:#\s*)?\"([^\"]+)\"")


def test_code_names_sections_that_exist() -> None:
    """``path.md, "Title"`` in code (a docstring's or a comment's pointer to a guide's section,
    a comment wrapped between the two) names the start of a heading of that file."""
    bad, seen = [], 0
    for path in CODE:
        text = path.read_text(errors="replace")
        for m in SECTION_REF.finditer(text):
            page = m.group(1)
            target = next((c for c in (REPO / page, path.parent / page) if c.is_file()), None)
            title = re.sub(r"\s*\n\s*#?\s*", " ", m.group(2)).replace("`", "").strip()
            where = f'{_rel(path)}:{_line(text, m.start())}: {page}, "{title}"'
            seen += 1
            if target is None:
                bad.append(f"{where}: no such file")
            elif not any(h.startswith(title) for h in headings(target)):
                bad.append(f"{where}: begins no heading")
    assert seen >= 10, "the pattern finds no pointers any more"
    assert not bad, "\n".join(bad)


def test_markers_give_a_reason_and_precede_a_block() -> None:
    bad = []
    for doc in DOCS:
        lines = doc.read_text().split("\n")
        marked = {f.line for f in fences(doc) if f.marker}
        for i, line in enumerate(lines, 1):
            m = MARKER.match(line)
            if not m:
                continue
            nxt = next((k for k in range(i + 1, len(lines) + 1) if lines[k - 1].strip()), None)
            if not m.group(2):
                bad.append(f"{_rel(doc)}:{i}: a marker without its reason")
            if nxt not in marked:
                bad.append(f"{_rel(doc)}:{i}: a marker not followed by a fenced block")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("prog", PROGRAMS, ids=[p.id for p in PROGRAMS])
def test_python_block(prog: Program, tmp_path: Path) -> None:
    if prog.kind == "exempt":
        pytest.skip(f"not code: {prog.reason}")
    compile(prog.source, prog.id, "exec")
    if prog.kind == "compile":
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    proc = subprocess.run([sys.executable, "-c", prog.source], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{prog.id}: the block fails as written (mark it `<!-- not run: why -->` if it cannot "
        f"run alone):\n{proc.stderr[-3000:]}")


def _bash_lines(doc: Path):
    for f in fences(doc):
        if f.lang not in ("bash", "sh", "shell"):
            continue
        for k, line in enumerate(f.body.replace("\\\n", "").splitlines()):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # the inside of a quoted python -c program
            yield f.line + 1 + k, words


@pytest.mark.parametrize("doc", DOCS + SUMMARIES, ids=_rel)
def test_bash_commands_name_existing_scripts(doc: Path) -> None:
    bad = []
    tops = {p.name for p in REPO.iterdir()}
    for line, words in _bash_lines(doc):
        for w in words:
            path = candidate(w, doc)
            if path is None:
                continue
            script = path.endswith((".py", ".sh"))
            if not script and path.split("/")[0] not in tops:
                continue  # an output the command writes (gamma.json, ckpt/TAG, ...)
            if not ((REPO / path).exists() or (doc.parent / path).exists()):
                bad.append(f"{_rel(doc)}:~{line}: {path}")
    assert not bad, "commands naming files that do not exist:\n" + "\n".join(bad)


def test_bash_script_arguments_are_parsed_by_test_help() -> None:
    """Every command of a bench/ or examples/ script is among those test_help.py parses."""
    parsed = {(d, s) for d, s, _ in DOCUMENTED}
    shown = set()
    for doc in DOCS:
        for _, words in _bash_lines(doc):
            shown |= {(_rel(doc), w) for w in words
                      if re.fullmatch(r"(bench|examples)/[\w/]+\.py", w)}
    assert shown and shown <= parsed, sorted(shown - parsed)


def test_the_checks_catch_a_broken_guide(tmp_path: Path) -> None:
    """The extraction on a guide written to fail: what is broken is found, the rest passed over."""
    doc = tmp_path / "guide.md"
    doc.write_text("\n".join([
        "See `qcomm/nowhere.py` and [the design](../nowhere.md), `docs/design.md`,",
        "`1/N`, `H/F`, `--out bench/out/x.json`, `<workload>/x.py`, `$OUT/log.txt`,",
        "`summary.json`, `/tmp/old.py`, `~/.cache/x.py`, `tests/*.py`,",
        "[torch's `test/test_optim.py`](https://example.org/test_optim.py), qcomm/gone/ in text,",
        "`git show REV:qcomm/kernels/gone.py`, `tests/test_docs.py::test_x`, `README.md:12`.",
        "",
        "<!-- not run: needs two processes -->",
        "```python",
        "import torch.distributed",
        "```",
        "",
        "<!-- not code -->",
        "```python",
        "x = = 1",
        "```",
    ]))
    refs = references(doc)
    assert sorted((r.path, r.how) for r in refs) == sorted([
        ("qcomm/nowhere.py", "code"), ("../nowhere.md", "link"), ("docs/design.md", "code"),
        ("qcomm/gone/", "text"), ("qcomm/kernels/gone.py", "code"),
        ("tests/test_docs.py", "code"), ("README.md", "code")])
    assert sorted(r.path for r in refs if resolve(r) is None) == [
        "../nowhere.md", "qcomm/gone/", "qcomm/kernels/gone.py", "qcomm/nowhere.py"]
    marked = [(f.marker, f.reason) for f in fences(doc)]
    assert marked == [("run", "needs two processes"), ("code", "")]


def test_the_anchor_checks_catch_a_broken_link(tmp_path: Path) -> None:
    """Links into pages and folders: a heading that is not there is found, one that is passes."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results/README.md").write_text("# The index\n")
    (tmp_path / "results/2026-01-01-x.md").write_text("# A run (2026-01-01)\n\n## Its cell\n")
    doc = tmp_path / "guide.md"
    doc.write_text("[ok](results/2026-01-01-x.md#its-cell), [ok](results/#the-index),\n"
                   "[bad](results/2026-01-01-x.md#gone), [bad](results/#nowhere).\n")
    bad = bad_anchors(doc)
    assert len(bad) == 2 and "#gone" in bad[0] and "#nowhere" in bad[1], bad
    code = tmp_path / "x.py"
    code.write_text('# bench/results/2026-12-01-peers-tuned.md, "Nothing"; bench/RESULTS.md#gone\n')
    refs = code_result_refs(code)
    assert [(page, anchor, title) for _, page, anchor, title in refs] == [
        ("bench/results/2026-12-01-peers-tuned.md", None, "Nothing"),
        ("bench/RESULTS.md", "gone", None)]
