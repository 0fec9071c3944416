"""The `versioned` selection (tests/runtime/versioned.py), which CI runs on the older
megatron-core release, stays in step with runtime/versions.py and with the suite:
- every row of versions.py's table of differences has an entry, and every entry is a row;
- every function versions.py defines is named in a row (a new difference gets a row, then tests);
- every listed test exists (its file, and the test function when one is named);
- the Makefile and .ci/run select it with `-m versioned`, and CI still runs the full suite once.
"""

import ast
import inspect
import os
import re
import subprocess
import sys

from megatron_lora.runtime import versions
from tests.runtime.versioned import VERSIONED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows():
    """{key: row} for the table's data rows; key: the first `name` of the "handled by" cell."""
    rows = {}
    for line in versions.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("difference", "---"):
            continue
        names = re.findall(r"`([^`]+)`", cells[3])
        rows[names[0] if names else cells[3]] = line
    return rows


def test_every_difference_has_tests_and_every_entry_is_a_difference():
    rows = _rows()
    assert len(rows) >= 9, rows  # the parse found the table
    assert set(rows) == set(VERSIONED), (
        f"rows without an entry: {sorted(set(rows) - set(VERSIONED))}; entries without a row: "
        f"{sorted(set(VERSIONED) - set(rows))}")
    assert all(VERSIONED.values())


def test_every_function_of_versions_is_in_the_table():
    table = "\n".join(_rows().values())
    functions = [name for name, f in inspect.getmembers(versions, inspect.isfunction)
                 if f.__module__ == versions.__name__ and not name.startswith("_")]
    assert functions
    # spec_replace serves spec_module / spec_submodules' row (the same two spec forms)
    missing = [n for n in functions if f"`{n}`" not in table and n != "spec_replace"]
    assert not missing, f"versions.py functions in no row of its table: {missing}"


def test_every_listed_test_exists():
    problems = []
    for key, tests in VERSIONED.items():
        for test in tests:
            path, _, name = test.partition("::")
            full = os.path.join(ROOT, path)
            if not os.path.isfile(full):
                problems.append(f"{key}: {path} does not exist")
                continue
            if name:
                defined = {n.name for n in ast.walk(ast.parse(open(full).read()))
                           if isinstance(n, ast.FunctionDef)}
                if name not in defined:
                    problems.append(f"{key}: {path} has no {name}")
    assert not problems, problems


def test_the_marker_selects_exactly_the_listed_tests():
    """Collection (no test runs) with -m versioned gives the listed tests of two entries."""
    files = ["tests/runtime/test_safe_load.py", "tests/models/test_qk_norm.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m",
                           "versioned", *files], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert any(i.startswith("tests/runtime/test_safe_load.py::") for i in ids), ids
    qk = {i for i in ids if i.startswith("tests/models/test_qk_norm.py::")}
    assert qk == {"tests/models/test_qk_norm.py::"
                  "test_the_spec_builds_the_full_width_norms_only_when_asked"}, ids


def test_ci_runs_the_versioned_selection_and_the_full_suite():
    make = subprocess.run(["make", "-n", "test", "TESTS=versioned"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert re.search(r"-m pytest tests -m versioned\s*$", make.stdout, re.M), make.stdout
    full = subprocess.run(["make", "-n", "test", "MCORE=0.19.2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert re.search(r"^\.venv-mcore0\.19\.2/bin/python -m pytest tests\s*$", full.stdout,
                     re.M), full.stdout
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert '"TESTS=versioned" "MCORE=0.19.2"' in ci and 'make test "$run"' in ci
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "make test TESTS=versioned" in readme and "make test MCORE=0.19.2" in readme
