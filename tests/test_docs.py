"""The documentation runs as written: every Python block of README.md and docs/**/*.md, and the
site builds with ``mkdocs build --strict``.

Conventions for writers (what this module checks):

- A fenced block whose info string is ``python`` (or ``py``) is code that runs. A page's blocks
  run in order in one namespace, so a later block may use what an earlier one defined; each page
  starts from a fresh one. Keep them tiny (hidden 32-64, 2 layers, vocabularies of 64-128, a few
  dozen tokens): this whole module should take well under two minutes on two cores.
- Anything that is not meant to run (output, shell commands, file trees, signatures) takes
  another fence language: ``text``, ``console``, ``bash``.
- A block that needs a CUDA GPU has the HTML comment ``<!-- docs-test: gpu -->`` on the line
  right before its fence. It must not define anything a later block uses. Without a GPU those
  blocks are skipped (the page's ``gpu`` test item, skipped with its reason by tests/conftest.py);
  with one, that item runs the page again with its GPU blocks included.
- The blocks run with ``TRITON_INTERPRET=1`` (set by ``make test``; set here too when missing)
  and the page's own temporary directory as the working directory (for output_dir and the like).

README.md runs as one fresh script (``python readme.py``: the quickstart must run when copied into
a file); the docs pages run in one worker process that imports torch and transformers once and
forks a child per page (a fresh namespace and fresh module state for every page).
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_MARKER = "<!-- docs-test: gpu -->"
RUN_LANGUAGES = ("python", "py")
# Seconds: a page's blocks in the worker; the README script as a whole.
PAGE_TIMEOUT_S = 300
README_TIMEOUT_S = 300
README_MAX_LINES = 260

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def doc_pages():
    """README.md and every Markdown page under docs/, as paths relative to the repository."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [str(p.relative_to(ROOT)) for p in pages]


def code_blocks(text):
    """The fenced blocks of a Markdown text: dicts with ``language``, ``line`` (1-based line of the
    opening fence), ``source`` (dedented) and ``gpu`` (the marker comment precedes it)."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        language = opening["info"].strip().split(" ")[0].split("{")[0]
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,{indent + 3}}}{fence[0]}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise ValueError(f"unclosed code fence at line {i + 1}")
        previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        source = textwrap.dedent("\n".join(line[indent:] if line[:indent].strip() == "" else line
                                           for line in lines[i + 1:end]))
        blocks.append({"language": language, "line": i + 1, "source": source + "\n",
                       "gpu": previous == GPU_MARKER})
        i = end + 1
    return blocks


def runnable_blocks(page, with_gpu):
    """The blocks of ``page`` that run: Python ones, GPU ones only ``with_gpu``."""
    blocks = code_blocks((ROOT / page).read_text())
    return [b for b in blocks if b["language"] in RUN_LANGUAGES and (with_gpu or not b["gpu"])]


def _environment():
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("REMAT_BACKEND", None)  # the documented defaults
    return env


# The worker: imports the heavy modules once, then forks a child per page that runs the page's
# blocks in a fresh namespace (in the page's directory) and reports through a file.
_WORKER = r'''
import json, os, sys, time, traceback
import torch, transformers, remat  # noqa: F401  (imported once, before the forks)

spec = json.load(open(sys.argv[1]))
results = {}
for page, item in spec.items():
    os.makedirs(item["cwd"], exist_ok=True)
    report = os.path.join(item["cwd"], ".docs-test-result.json")
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        outcome = {"ok": True, "error": ""}
        try:
            os.chdir(item["cwd"])
            namespace = {"__name__": "__main__"}
            for block in item["blocks"]:
                exec(compile(block["source"], f"{page}:{block['line']}", "exec"), namespace)
        except BaseException:
            outcome = {"ok": False, "error": traceback.format_exc()}
        with open(report, "w") as f:
            json.dump(outcome, f)
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)
    deadline = start + item["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.05)
    if status is None:
        outcome = {"ok": False, "error": f"timed out after {item['timeout']} s"}
    elif os.path.exists(report):
        outcome = json.load(open(report))
    else:
        outcome = {"ok": False, "error": f"the page's process died (wait status {status})"}
    outcome["seconds"] = round(time.monotonic() - start, 1)
    results[page] = outcome
json.dump(results, open(sys.argv[2], "w"))
'''


def run_pages(pages, with_gpu, workdir):
    """Runs each page's blocks (in the worker above); {page: {"ok", "error", "seconds"}}."""
    spec = {page: {"blocks": runnable_blocks(page, with_gpu), "cwd": str(workdir / page.replace("/", "_")),
                   "timeout": PAGE_TIMEOUT_S} for page in pages}
    (workdir / "worker.py").write_text(_WORKER)
    (workdir / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, str(workdir / "worker.py"), str(workdir / "spec.json"),
                           str(workdir / "results.json")], cwd=workdir, env=_environment(), capture_output=True,
                          text=True, timeout=PAGE_TIMEOUT_S * len(pages) + 120)
    assert done.returncode == 0, f"the docs worker failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads((workdir / "results.json").read_text())


DOCS_PAGES = [p for p in doc_pages() if p != "README.md" and runnable_blocks(p, with_gpu=False)]
GPU_PAGES = [p for p in doc_pages() if any(b["gpu"] for b in runnable_blocks(p, with_gpu=True))]


@pytest.fixture(scope="module")
def docs_results(tmp_path_factory):
    return run_pages(DOCS_PAGES, False, tmp_path_factory.mktemp("docs"))


def test_code_blocks_parse():
    """The fence parser on a sample: languages, the GPU marker, indented fences, ```` fences."""
    sample = ("text\n\n```python\nx = 1\n```\n\n<!-- docs-test: gpu -->\n```python\ny = x.cuda()\n```\n\n"
              "- item\n\n    ```text\n    output\n    ```\n\n````py\nz = '```'\n````\n")
    blocks = code_blocks(sample)
    assert [(b["language"], b["gpu"], b["source"]) for b in blocks] == [
        ("python", False, "x = 1\n"), ("python", True, "y = x.cuda()\n"), ("text", False, "output\n"),
        ("py", False, "z = '```'\n")]
    with pytest.raises(ValueError, match="unclosed"):
        code_blocks("```python\nx = 1\n")


def test_every_python_block_is_collected():
    """Every page with Python blocks is run by a test below: nothing is silently left out."""
    for page in doc_pages():
        if any(b["language"] in RUN_LANGUAGES and not b["gpu"] for b in code_blocks((ROOT / page).read_text())):
            assert page == "README.md" or page in DOCS_PAGES, page


def test_readme_runs_as_one_fresh_script(tmp_path):
    """README.md's Python blocks, concatenated in order into one file and run with a fresh
    interpreter: the quickstart runs as written."""
    blocks = runnable_blocks("README.md", with_gpu=bool(torch.cuda.is_available()))
    assert blocks, "README.md has no Python block"
    script = tmp_path / "readme.py"
    script.write_text("\n".join(f"# README.md:{b['line']}\n{b['source']}" for b in blocks))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_environment(), capture_output=True,
                          text=True, timeout=README_TIMEOUT_S)
    assert done.returncode == 0, f"README.md's blocks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_readme_is_short_and_links_resolve():
    """The README stays a front page (the rest lives under docs/) and its links to docs/ exist."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\((docs/[^)#\s]+)", text)
    assert links, "README.md links into docs/"
    for link in links:
        assert (ROOT / link).is_file(), link


@pytest.mark.parametrize("page", DOCS_PAGES)
def test_docs_page_runs(page, docs_results):
    result = docs_results[page]
    assert result["ok"], f"{page} ({result['seconds']} s):\n{result['error']}"


@pytest.mark.gpu
@pytest.mark.parametrize("page", GPU_PAGES or [pytest.param(None, marks=pytest.mark.skip(reason="no GPU blocks"))])
def test_docs_page_runs_with_gpu_blocks(page, tmp_path):
    if page == "README.md":
        pytest.skip("README.md's GPU blocks run in test_readme_runs_as_one_fresh_script")
    result = run_pages([page], True, tmp_path)[page]
    assert result["ok"], f"{page} ({result['seconds']} s):\n{result['error']}"


def test_mkdocs_build_strict(tmp_path):
    """The site builds with every warning an error (broken links and anchors, pages missing from
    the nav, docstrings mkdocstrings cannot render). `make test` builds the site itself just before
    the suite and sets REMAT_DOCS_BUILT=1, which skips this one."""
    if os.environ.get("REMAT_DOCS_BUILT") == "1":
        pytest.skip("make test built the site with mkdocs build --strict before the suite")
    mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed in this environment (requirements-dev.txt pins it)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([mkdocs, "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
