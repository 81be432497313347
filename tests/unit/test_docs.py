"""The documentation points at things that exist.

Every results file the docs name (also brace and glob forms), every `python -m` module and every
relative markdown link must resolve in the working tree; results files must not be ignored by git
(a figure is only reproducible from a file that is committed).
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "nexmark" / "README.md",
    ROOT / "examples" / "README.md",
]

# A results path: bench/results/ then name characters, braces, globs; "{a,\nb}" never spans lines.
RESULTS_PATH = re.compile(r"bench/results/[A-Za-z0-9_.,*?\[\]{}<>\-/]*")
# A bare results file name in an inline code span: `name.json`, `name{,_run2}.json`, `name_*.json`.
CODE_SPAN = re.compile(r"`([^`\n]+)`")
BARE_NAME = re.compile(r"^[A-Za-z0-9_.,*?\[\]{}\-]+\.(?:json|png|md)$")
# File names in code spans that are not results files (formats the text describes).
NOT_RESULTS = {"_MANIFEST.json", "README.md", "OPTIONS", "raystream.json"}
PYTHON_M = re.compile(r"python -m ([A-Za-z_][A-Za-z0-9_.]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def expand_braces(pattern: str) -> list[str]:
    """Bash-style brace expansion: `a{b,c}d`, nested, and ranges `{1..5}`."""
    depth, start = 0, None
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                body = pattern[start + 1 : i]
                head, tail = pattern[:start], pattern[i + 1 :]
                span = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
                if span:
                    lo, hi = int(span.group(1)), int(span.group(2))
                    step = 1 if hi >= lo else -1
                    options = [str(n) for n in range(lo, hi + step, step)]
                else:
                    options = split_top_level(body)
                    if len(options) < 2:  # "{x}" is literal in bash
                        return [
                            head + "{" + o + "}" + t for o in options for t in expand_braces(tail)
                        ]
                return [e for o in options for e in expand_braces(head + o + tail)]
    return [pattern]


def split_top_level(body: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in body:
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def resolve(pattern: str) -> list[Path]:
    """The files a documented results path names; [] if it names none. `<query>` stands for any."""
    pattern = re.sub(r"<[A-Za-z_]+>", "*", pattern.rstrip(".,"))
    found: list[Path] = []
    for one in expand_braces(pattern):
        one = one.rstrip(".,")
        if any(c in one for c in "*?["):
            matches = [Path(p) for p in glob.glob(str(ROOT / one))]
            if not matches:
                return []  # every alternative of a brace form must name something
            found += matches
            continue
        path = ROOT / one
        if path.exists():
            found.append(path)
        elif not path.suffix:  # an --out prefix: the tool writes <prefix>.json (and .png)
            found += [Path(p) for p in glob.glob(str(path) + ".*")]
        else:
            return []  # one named file is missing: the whole mention fails
    return found


def doc_text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def results_mentions(doc: Path) -> list[str]:
    text = doc_text(doc)
    mentions = [m.group(0) for m in RESULTS_PATH.finditer(text)]
    for span in CODE_SPAN.finditer(text):
        for word in re.split(r"[\s;()]+", span.group(1)):
            if "/" in word or word in NOT_RESULTS or not BARE_NAME.match(word):
                continue
            stem = word.rsplit(".", 1)[0]
            if "." in stem or word.startswith("_"):
                continue  # `rs.sources.json(...)` is a call; `_run2.json` a suffix of the name before it
            mentions.append("bench/results/" + word)
    return mentions


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_mentioned_exists(doc):
    missing = [
        m for m in results_mentions(doc) if m.rstrip("/") != "bench/results" and not resolve(m)
    ]
    assert not missing, (
        f"{doc.name} names results files that are not in the tree: {sorted(set(missing))}"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_results_file_mentioned_is_ignored_by_git(doc):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = sorted(
        {str(p.relative_to(ROOT)) for m in results_mentions(doc) for p in resolve(m) if p.is_file()}
    )
    if not files:
        return
    out = subprocess.run(
        ["git", "check-ignore", "--stdin"],
        cwd=ROOT,
        input="\n".join(files),
        capture_output=True,
        text=True,
    )
    assert out.returncode in (0, 1), out.stderr
    ignored = out.stdout.split()
    assert not ignored, (
        f"{doc.name} names results files that git ignores (so a clone lacks them): {ignored}"
    )


def module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_m_module_exists(doc):
    names = {m.group(1).rstrip(".") for m in PYTHON_M.finditer(doc_text(doc))}
    missing = sorted(n for n in names if not module_exists(n))
    assert not missing, (
        f"{doc.name} runs `python -m` on modules that are not in the repository: {missing}"
    )


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in doc_text(doc).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = github_anchor(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    bad = []
    for m in LINK.finditer(doc_text(doc)):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading with that anchor in {dest.name})")
    assert not bad, f"{doc.name} has links that do not resolve: {bad}"


def test_brace_expansion():
    assert expand_braces("a{,_run2,_run3}.json") == ["a.json", "a_run2.json", "a_run3.json"]
    assert expand_braces("r{1..3}") == ["r1", "r2", "r3"]
    assert expand_braces("x_{base_,}run{1..2}.j") == [
        "x_base_run1.j",
        "x_base_run2.j",
        "x_run1.j",
        "x_run2.j",
    ]
    assert expand_braces("compare.{md,json,png}") == ["compare.md", "compare.json", "compare.png"]


def test_a_missing_results_file_is_found():
    assert resolve("bench/results/compare.{md,json}")
    assert resolve("bench/results/nexmark_<query>{,_run2}.json")
    assert not resolve("bench/results/compare.{md,no_such_suffix}")
    assert not resolve("bench/results/no_such_file_*.json")


def test_github_anchor():
    assert github_anchor("Spark -> actors ingest") == "spark---actors-ingest"
    assert (
        github_anchor("Built-in windows, aggregations and joins (`raystream.operators`)")
        == "built-in-windows-aggregations-and-joins-raystreamoperators"
    )
