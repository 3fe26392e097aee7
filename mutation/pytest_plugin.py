"""pytest plugin of the mutation runner (mutation/run.py). The runner copies it into its shadow tree as
``_remat_mutation_plugin.py`` and loads it with ``-p``; it is not a plugin of the normal test suite.

Two jobs, each switched on by an environment variable the runner sets:

- ``REMAT_MUTATION_CHECK``: ``module=sha256,...``. After collection, every listed module must be
  importable from the shadow tree (``REMAT_MUTATION_SHADOW``) and its source file must have the
  given hash, so the code under test is the mutated copy and not the editable install's original.
  A module that fails to import is left to the tests (a mutant that breaks the import is killed by
  them); a module imported from elsewhere, or with other contents, stops the session with exit code
  97, which the runner treats as a broken setup, never as a killed mutant.
- ``REMAT_MUTATION_COVERAGE``: a JSON path. Line coverage of the files in
  ``REMAT_MUTATION_COVER_FILES`` (``os.pathsep``-separated) is recorded with one coverage context per
  test node id, and written with every test's outcome and duration: the runner's baseline, from
  which it picks the tests that execute each mutated line.
"""

import hashlib
import importlib
import json
import os

import pytest

SETUP_ERROR = 97


def _check_imports():
    spec = os.environ.get("REMAT_MUTATION_CHECK")
    if not spec:
        return
    shadow = os.path.realpath(os.environ["REMAT_MUTATION_SHADOW"])
    for entry in spec.split(","):
        name, _, digest = entry.partition("=")
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken mutant; the tests report it
            continue
        path = os.path.realpath(module.__file__)
        if not path.startswith(shadow + os.sep):
            pytest.exit(f"mutation runner: {name} was imported from {path}, not from the shadow tree {shadow}",
                        returncode=SETUP_ERROR)
        with open(path, "rb") as handle:
            actual = hashlib.sha256(handle.read()).hexdigest()
        if digest and actual != digest:
            pytest.exit(f"mutation runner: {path} does not hold the expected mutant", returncode=SETUP_ERROR)


class _Coverage:
    def __init__(self, out_path, files):
        import coverage

        self.out_path = out_path
        self.files = files
        self.cov = coverage.Coverage(data_file=None, include=files, branch=False, config_file=False)
        self.cov.start()
        self.tests = {}

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.cov.switch_context(item.nodeid)
        yield
        self.cov.switch_context("")

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0})
        entry["duration"] += report.duration
        if report.failed:
            entry["outcome"] = "failed"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        elif report.when == "call" and hasattr(report, "wasxfail"):
            entry["outcome"] = "xpassed"

    def pytest_sessionfinish(self, session):
        self.cov.stop()
        data = self.cov.get_data()
        lines = {}
        for path in data.measured_files():
            by_line = data.contexts_by_lineno(path)
            lines[os.path.realpath(path)] = {str(n): sorted(c) for n, c in by_line.items()}
        with open(self.out_path, "w") as out:
            json.dump({"tests": self.tests, "lines": lines}, out)


def pytest_configure(config):
    out_path = os.environ.get("REMAT_MUTATION_COVERAGE")
    if out_path:
        files = [f for f in os.environ["REMAT_MUTATION_COVER_FILES"].split(os.pathsep) if f]
        config.pluginmanager.register(_Coverage(out_path, files), "remat_mutation_coverage")


def pytest_collection_finish(session):
    _check_imports()
