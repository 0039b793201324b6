"""The README's test command is exactly what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"\.venv/bin/(python -m pytest[^\n#`]*?)\s+# the tests", readme)
    assert match, "README must state the test command"
    assert match.group(1).strip() in ci
