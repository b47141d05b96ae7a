"""What a newcomer meets first: an install without setuptools warnings about the package list, a README whose
links all lead to files in the repository, and a repository that speaks of itself only (no paths outside it, no
work journal: sessions, device calls, issue numbers, dates of work)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Patterns a tracked text file may not contain, each with what it stands for.
FORBIDDEN = {
    "a path outside the repository": re.compile(r"gpu-runs|\.\./shared|/work/|\.library/"),
    "a work session": re.compile(r"\bsessions? \d", re.IGNORECASE),
    "a device call": re.compile(r"\b(?:device )?calls? \d", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? ?[#-]? ?\d", re.IGNORECASE),
    "a date of work": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}
MARKDOWN_ONLY = {"a machine's temporary path": re.compile(r"/tmp/")}
# Where a pattern is allowed: the benchmarks give the date of each measurement.
ALLOWED = {("docs/BENCHMARKS.md", "a date of work")}


def tracked_text_files() -> dict[str, str]:
    """Every tracked text file but this one (whose examples would match)."""
    listed = subprocess.run(["git", "ls-files", "-z"], capture_output=True, text=True, cwd=ROOT)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    texts = {}
    for name in filter(None, listed.stdout.split("\0")):
        path = ROOT / name
        if path == Path(__file__).resolve() or not path.is_file():  # this file, or one deleted in the working tree
            continue
        try:
            texts[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # Parquet samples and other binary files
            continue
    return texts


def hits_in(name: str, text: str) -> list[tuple[str, str, int, str]]:
    patterns = FORBIDDEN | (MARKDOWN_ONLY if name.endswith(".md") else {})
    return [(name, what, number, match.group(0))
            for number, line in enumerate(text.splitlines(), 1)
            for what, pattern in patterns.items() if (name, what) not in ALLOWED
            for match in pattern.finditer(line)]


def test_the_patterns_catch_what_they_stand_for():
    journal = ("see ../shared/DESIGN.md and docs/gpu-runs/x.json (session 2, calls 1-7, issue 19, issue #4, "
               "2026-11-26)\nraw files in /tmp/run")
    found = {what for _, what, _, _ in hits_in("docs/X.md", journal)}
    assert found == set(FORBIDDEN) | set(MARKDOWN_ONLY)
    clean = ("@pytest.fixture(scope='session')\ndef call(fn): return fn()  # called once; an issue with ties\n"
             "2 sessions of 30 minutes; 64 calls per graph; version 2026.1")
    assert hits_in("tests/x.py", clean) == []


def test_the_repository_speaks_of_itself_only():
    hits = [hit for name, text in tracked_text_files().items() for hit in hits_in(name, text)]
    assert not hits, "\n".join(f"{name}:{line}: {what}: {matched!r}" for name, what, line, matched in hits)


def test_build_warns_of_no_package_missing_from_the_package_list(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation",
                             "--target", str(tmp_path / "site"), str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    log = result.stdout + result.stderr
    assert "running build_py" in log  # the verbose build log is there to be read
    assert "is absent from the `packages` configuration" not in log


def test_readme_links_only_files_in_the_repository():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)", readme) + re.findall(r"`([\w./-]+\.md)`", readme)
    assert targets, "the README links nothing: the pattern is wrong"
    outside = [t for t in targets if "://" not in t and not (ROOT / t).resolve().is_relative_to(ROOT)]
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not outside and not missing, (outside, missing)
