"""Under ``CI=true`` a skipped test fails with a message (missing Triton, extra or feature); locally it skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
CASES = """
import pytest

pytest.importorskip("json")  # present: the module is collected


def test_needs_a_missing_package():
    pytest.importorskip("no_such_package_for_the_ci_rule")


@pytest.mark.skipif(True, reason="feature unavailable here")
def test_marked_skip():
    pass


@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    raise AssertionError


def test_runs():
    pass
"""
MODULE_SKIP = 'import pytest\n\npytest.importorskip("no_such_package_at_import")\n\n\ndef test_never():\n    pass\n'


def _pytest(tmp_path: Path, ci: str | None, cases: str = CASES) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_cases.py").write_text(cases)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_under_ci_every_skip_is_a_failure_naming_why(tmp_path):
    result = _pytest(tmp_path, "true")
    out = result.stdout
    assert result.returncode == 1, out
    assert "FAILED test_cases.py::test_needs_a_missing_package" in out
    assert "ERROR test_cases.py::test_marked_skip" in out  # a skip marker acts in setup: an error
    assert "CI=true: a test was skipped" in out and "no_such_package_for_the_ci_rule" in out
    assert "feature unavailable here" in out
    assert "1 passed" in out and "1 xfailed" in out  # xfail is not a skip; the others run as usual
    assert "skipped" not in out.splitlines()[-1]


def test_under_ci_a_module_skipped_at_import_is_an_error(tmp_path):
    result = _pytest(tmp_path, "true", MODULE_SKIP)
    assert result.returncode != 0, result.stdout
    assert "ERROR test_cases.py" in result.stdout and "no_such_package_at_import" in result.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_skip_stays_a_skip(tmp_path, ci):
    """Control: the same files without ``CI=true`` pass with their skips."""
    result = _pytest(tmp_path, ci)
    assert result.returncode == 0, result.stdout
    assert "2 skipped" in result.stdout.splitlines()[-1] and "1 passed" in result.stdout
    result = _pytest(tmp_path, ci, MODULE_SKIP)
    assert result.returncode == 5 and "1 skipped" in result.stdout, result.stdout  # 5: no test ran, none failed
