"""What a newcomer meets first: an install without setuptools warnings about the package list, and a README whose
links all lead to files in the repository (issue 19, case 15)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
