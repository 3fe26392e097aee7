"""Mutation testing of one block at a time: ``make mutate BLOCK=norm`` (or ``python mutation/run.py
--block norm``).

Why not mutmut: mutmut 3.8.1 (pinned in requirements-dev.txt) cannot be pointed at this layout
cleanly. It names modules after their paths (``python/remat/ops/norm.py`` becomes
``python.remat.ops.norm``, ``kernels/norm.py`` becomes ``kernels.norm``; only a ``src.`` prefix is
stripped), puts ``mutants/``, ``mutants/src`` and ``mutants/source`` on sys.path, and leaves the
editable install's finder in place, so the tests would import the unmutated ``remat`` from
python/remat (and its check ``_check_test_to_mutant_associations`` would stop the run: the recorded
``remat.ops.norm`` keys match no ``python.remat.ops.norm`` mutant). And it never mutates decorated
functions (mutmut/mutation/file_mutation.py), so every ``@triton.jit`` kernel, the code this
testing matters most for, would get no mutants at all. (Read from mutmut 3.8.1's source.)

What this runner does instead, for the block's source files (BLOCKS below):

1. Copies ``python/remat`` to ``<shadow>/remat`` and ``kernels/`` to ``<shadow>/remat/kernels`` (the
   mapping setup.py's package_dir makes), with the built extension, and snapshots ``tests/`` and
   pyproject.toml beside them. Every pytest run has the shadow first on sys.path (it is the working
   directory of ``python -m pytest``), ahead of the editable finder, and PYTHONDONTWRITEBYTECODE=1
   with no ``__pycache__`` in the shadow, so a mutant is compiled from its text. The shared
   working tree is never written: other people edit python/remat and kernels/ while this runs.
2. Collects the block's tests and runs them once under coverage with one context per test (the
   baseline; it must pass, and failing or skipped tests are left out and listed).
3. Generates mutants from the AST of each source file (operators, comparisons, boolean operators,
   ``not`` and unary minus, number and boolean constants, ``min``/``max`` and ``tl.minimum``/
   ``tl.maximum``, and deleting a call statement such as a ``tl.store``), as edits of the exact
   source text, so a Triton kernel, whose source the interpreter re-reads from the file, runs
   mutated too. Strings, docstrings, annotations, decorators and lines marked
   ``# pragma: no mutate`` are not mutated.
4. Checks the setup first: for each source file a canary (a ``raise`` appended to the module) must
   be killed, and in every run the plugin (mutation/pytest_plugin.py) verifies that each block
   module was imported from the shadow tree with the expected file hash.
5. For each mutant, in a seeded random order (all of them, or a sample with ``--max-mutants``) until
   the wall-time budget (``--budget-s``, default 25 minutes, baseline included) is spent, writes it
   into the shadow copy, runs ``pytest -x`` on the tests whose coverage context executed the mutated
   statement (fastest first; for a module-level or function-header mutant, the tests that execute
   any line of that module or function), with a timeout, and restores the file (verified by hash).
   killed: a test failed or errored (a crash or an import error counts); survived: all selected
   tests passed; timeout; no-tests: no selected test executes the line; not-run: past the budget.

Results go to ``mutation/.cache/<block>-results.json`` and a markdown summary to ``--report``
(default ``mutation/.cache/<block>-report.md``); survivors are printed with their diffs.
"""

import argparse
import ast
import difflib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "mutation", ".cache")
PLUGIN = "_remat_mutation_plugin"
SETUP_ERROR = 97

# Per block: the source files mutated, the test files run (with an optional -k expression), and
# functions left out (with why, for the report).
BLOCKS = {
    "norm": {
        "sources": ["python/remat/ops/norm.py", "python/remat/autograd/norm.py", "python/remat/functional/norm.py",
                    "kernels/norm.py"],
        "tests": [("tests/test_norm.py", None), ("tests/test_rounding.py", "norm"), ("tests/test_ops.py", None),
                  ("tests/test_properties.py", "norm"), ("tests/test_mutation_killers.py", "norm")],
        "skip_functions": {"aot_specs": "ahead-of-time compile specs, exercised by tests/test_triton_aot.py "
                                        "(a GPU-target compile, not a numerical check)"},
    },
    "mlp": {
        "sources": ["python/remat/ops/mlp.py", "python/remat/autograd/mlp.py", "python/remat/functional/mlp.py",
                    "kernels/mlp.py", "kernels/matmul.py"],
        "tests": [("tests/test_mlp.py", None), ("tests/test_rounding.py", "activation"), ("tests/test_ops.py", None),
                  ("tests/test_triton_matmul.py", None), ("tests/test_properties.py", "mlp"),
                  ("tests/test_mutation_killers.py", "mlp")],
        "skip_functions": {"aot_specs": "ahead-of-time compile specs, exercised by tests/test_triton_aot.py"},
    },
    # kernels/attention/ is being restructured; only the Python layers are mutated for now.
    "attention": {
        "sources": ["python/remat/ops/attention.py", "python/remat/autograd/attention.py",
                    "python/remat/functional/attention.py", "python/remat/ops/attention_core.py"],
        "tests": [("tests/test_attention.py", None), ("tests/test_rounding.py", "attention"),
                  ("tests/test_properties.py", "attention"), ("tests/test_mutation_killers.py", "attention")],
        "skip_functions": {},
    },
    # The PyTorch attention cores (remat's default attention on CPU and CUDA: the aten core in
    # ops/attention.py, the cudnn core) and the one-pass rope rotation they share. Their CUDA paths
    # are tested on the CPU through PyTorch's meta kernels on fake CUDA tensors (dispatch spies).
    "attention_cores": {
        "sources": ["python/remat/ops/attention.py", "python/remat/ops/attention_cudnn.py", "python/remat/ops/rope.py",
                    "python/remat/ops/attention_core.py", "kernels/rope_rotate.py"],
        "tests": [("tests/test_attention_aten_core.py", None), ("tests/test_attention_cudnn_core.py", None),
                  ("tests/test_rope_rotate.py", None), ("tests/test_attention.py", "aten or opcheck"),
                  ("tests/test_varlen_attention.py", "rope or opcheck")],
        "skip_functions": {"aot_specs": "ahead-of-time compile specs, exercised by tests/test_triton_aot.py"},
    },
}

BINOP_SWAPS = {
    ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult], ast.FloorDiv: [ast.Div],
    ast.Mod: [ast.Mult], ast.Pow: [ast.Mult], ast.LShift: [ast.RShift], ast.RShift: [ast.LShift],
    ast.BitAnd: [ast.BitOr], ast.BitOr: [ast.BitAnd], ast.BitXor: [ast.BitAnd], ast.MatMult: [ast.Mult],
}
OP_TEXT = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
    ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.MatMult: "@",
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
    ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.And: "and", ast.Or: "or",
}
COMPARE_SWAPS = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
OP_PATTERN = {  # how the operator appears in the text between its operands
    "is not": r"is\s+not", "not in": r"not\s+in", "is": r"is(?!\s+not)", "in": r"(?<!not )in",
}
CALL_SWAPS = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum"}


@dataclass
class Mutant:
    file: str  # repo-relative source path
    start: int  # byte offsets in the file's UTF-8 text
    end: int
    replacement: str
    kind: str
    line: int
    end_line: int
    scope: str  # "line": tests covering [cover_lines]; "function"/"module": any line of that range
    cover_lines: tuple
    ident: str = ""
    status: str = ""
    seconds: float = 0.0
    tests_run: int = 0
    killed_by: str = ""
    detail: dict = field(default_factory=dict)


class _Source:
    """A file's text with (line, column) <-> byte offset conversion (ast columns are UTF-8 bytes)."""

    def __init__(self, text):
        self.data = text.encode()
        self.line_starts = [0]
        for i, byte in enumerate(self.data):
            if byte == 0x0A:
                self.line_starts.append(i + 1)

    def offset(self, line, col):
        return self.line_starts[line - 1] + col

    def segment(self, start, end):
        return self.data[start:end].decode()


def _docstring_nodes(tree):
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                nodes.add(id(body[0].value))
    return nodes


def _excluded_subtrees(tree, skip_functions):
    """ids of nodes never mutated: annotations, decorators, type-only code, skipped functions."""
    excluded = set()

    def exclude(node):
        if node is not None:
            for sub in ast.walk(node):
                excluded.add(id(sub))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in skip_functions:
                exclude(node)
            for dec in node.decorator_list:
                exclude(dec)
            exclude(node.returns)
            for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                exclude(arg.annotation)
        elif isinstance(node, ast.ClassDef):
            for dec in node.decorator_list:
                exclude(dec)
        elif isinstance(node, ast.AnnAssign):
            exclude(node.annotation)
    return excluded


def _scopes(tree):
    """For every node id, where its code runs: ("line", (first, last)) for code in a function body (the
    lines of its statement, or of a compound statement's header), ("function", (first, last)) for a
    module-level function's header (defaults run at import; the body lines say which tests use
    them), ("module", None) for module- and class-level code."""
    result = {}

    def mark(node, scope):
        if node is not None:
            for sub in ast.walk(node):
                result[id(sub)] = scope

    def visit_stmts(stmts, in_function):
        for stmt in stmts:
            visit_stmt(stmt, in_function)

    def visit_stmt(stmt, in_function):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([d.lineno for d in stmt.decorator_list] + [stmt.lineno])
            scope = ("line", (first, stmt.lineno)) if in_function else (
                "function", (stmt.body[0].lineno, stmt.end_lineno))
            result[id(stmt)] = scope
            for part in stmt.decorator_list + [stmt.args, stmt.returns]:
                mark(part, scope)
            visit_stmts(stmt.body, True)
            return
        if isinstance(stmt, ast.ClassDef):
            scope = ("line", (stmt.lineno, stmt.lineno)) if in_function else ("module", None)
            result[id(stmt)] = scope
            for part in stmt.decorator_list + stmt.bases + stmt.keywords:
                mark(part, scope)
            visit_stmts(stmt.body, in_function)
            return
        bodies = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)]
        handlers = getattr(stmt, "handlers", [])
        children = [c for c in ast.iter_child_nodes(stmt)
                    if not isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case))]
        if not in_function:
            scope = ("module", None)
        else:
            last = max([c.end_lineno for c in children if hasattr(c, "end_lineno")] + [stmt.lineno])
            scope = ("line", (stmt.lineno, last if bodies or handlers else stmt.end_lineno))
        result[id(stmt)] = scope
        for child in children:
            mark(child, scope)
        for body in bodies:
            visit_stmts(body, in_function)
        for handler in handlers:
            hscope = ("line", (handler.lineno, handler.lineno)) if in_function else ("module", None)
            result[id(handler)] = hscope
            mark(handler.type, hscope)
            visit_stmts(handler.body, in_function)
        for case in getattr(stmt, "cases", []):
            mark(case.pattern, scope)
            mark(case.guard, scope)
            visit_stmts(case.body, in_function)

    visit_stmts(tree.body, False)
    return result


def _find_op(src, start, end, op_text):
    """Byte offsets of the operator op_text in src between start and end, skipping comments."""
    gap = src.segment(start, end)
    pattern = OP_PATTERN.get(op_text, re.escape(op_text))
    cleaned = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), gap)
    for match in re.finditer(pattern, cleaned):
        before, after = cleaned[:match.start()], cleaned[match.end():]
        # A single-character operator must not be part of a longer one (`*` inside `**`).
        if op_text in ("*", "/", "<", ">") and ((after[:1] in "*/=<>" and after[:1]) or
                                                (before[-1:] in "*/<>" and before[-1:])):
            continue
        if op_text in ("is", "in", "and", "or", "not") and (before[-1:].isalnum() or after[:1].isalnum()):
            continue
        prefix = len(gap[:match.start()].encode())
        return start + prefix, start + prefix + len(match.group().encode())
    return None


def generate(path, text, skip_functions):
    """Every mutant of one source file, in file order."""
    tree = ast.parse(text)
    src = _Source(text)
    docstrings = _docstring_nodes(tree)
    excluded = _excluded_subtrees(tree, skip_functions)
    scopes = _scopes(tree)
    lines = text.splitlines()
    mutants = []

    def node_range(node):
        return src.offset(node.lineno, node.col_offset), src.offset(node.end_lineno, node.end_col_offset)

    def add(node, start, end, replacement, kind):
        if "pragma: no mutate" in lines[node.lineno - 1]:
            return
        scope, cover = scopes.get(id(node), ("module", None))
        if scope == "line" and cover is None:
            cover = (node.lineno, node.end_lineno)
        mutants.append(Mutant(path, start, end, replacement, kind, node.lineno, node.end_lineno, scope,
                              tuple(cover) if cover else ()))

    def add_op(node, left, right, old, new, kind):
        found = _find_op(src, node_range(left)[1], node_range(right)[0], OP_TEXT[old])
        if found:
            add(node, found[0], found[1], OP_TEXT[new], kind)

    for node in ast.walk(tree):
        if id(node) in excluded:
            continue
        if isinstance(node, ast.BinOp):
            for new in BINOP_SWAPS.get(type(node.op), []):
                add_op(node, node.left, node.right, type(node.op), new, "binop")
        elif isinstance(node, ast.AugAssign) and type(node.op) in BINOP_SWAPS:
            found = _find_op(src, node_range(node.target)[1], node_range(node.value)[0], OP_TEXT[type(node.op)] + "=")
            if found:
                add(node, found[0], found[1], OP_TEXT[BINOP_SWAPS[type(node.op)][0]] + "=", "augassign")
        elif isinstance(node, ast.Compare):
            operands = [node.left] + node.comparators
            for i, op in enumerate(node.ops):
                if type(op) in COMPARE_SWAPS:
                    add_op(node, operands[i], operands[i + 1], type(op), COMPARE_SWAPS[type(op)], "compare")
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            for left, right in zip(node.values, node.values[1:]):
                add_op(node, left, right, type(node.op), new, "boolop")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            start = node_range(node)[0]
            operand_start = node_range(node.operand)[0]
            add(node, start, operand_start, "", "unary")
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            value = node.value
            start, end = node_range(node)
            if isinstance(value, bool):
                add(node, start, end, str(not value), "constant")
            elif isinstance(value, int):
                add(node, start, end, str(value + 1), "constant")
            elif isinstance(value, float):
                add(node, start, end, repr(value + 1.0), "constant")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in CALL_SWAPS and (isinstance(func, ast.Name) or name in ("minimum", "maximum")):
                end = node_range(func)[1]
                add(node, end - len(name), end, CALL_SWAPS[name], "call")
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            start, end = node_range(node)
            add(node, start, end, "pass", "delete-call")
    mutants.sort(key=lambda m: (m.start, m.end, m.replacement))
    for i, m in enumerate(mutants):
        m.ident = f"{path}:{m.line}:{i}"
    return mutants


def apply(text, mutant):
    data = text.encode()
    return (data[:mutant.start] + mutant.replacement.encode() + data[mutant.end:]).decode()


def diff(text, mutated, path):
    lines = difflib.unified_diff(text.splitlines(), mutated.splitlines(), path, path, n=0, lineterm="")
    return "\n".join(line for line in lines if not line.startswith(("---", "+++", "@@")))


def sha(data):
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def module_name(path):
    if path.startswith("python/"):
        return path[len("python/"):-3].replace("/", ".")
    if path.startswith("kernels/"):
        return "remat." + path[:-3].replace("/", ".")
    raise ValueError(path)


def shadow_path(shadow, path):
    if path.startswith("python/"):
        return os.path.join(shadow, path[len("python/"):])
    if path.startswith("kernels/"):
        return os.path.join(shadow, "remat", path)
    raise ValueError(path)


class Shadow:
    """The copy the tests import, with restore-on-exit of whatever file is mutated."""

    def __init__(self, block_sources, keep=False):
        self.dir = tempfile.mkdtemp(prefix="remat-mutation-")
        self.keep = keep
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        shutil.copytree(os.path.join(ROOT, "python", "remat"), os.path.join(self.dir, "remat"), ignore=ignore)
        shutil.copytree(os.path.join(ROOT, "kernels"), os.path.join(self.dir, "remat", "kernels"), ignore=ignore)
        shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(self.dir, "tests"), ignore=ignore)
        shutil.copy2(os.path.join(ROOT, "pyproject.toml"), self.dir)
        shutil.copy2(os.path.join(ROOT, "mutation", "pytest_plugin.py"), os.path.join(self.dir, PLUGIN + ".py"))
        self.originals = {}
        for path in block_sources:
            with open(shadow_path(self.dir, path)) as handle:
                self.originals[path] = handle.read()
        self.current = None

    def write(self, path, text):
        self.current = path
        with open(shadow_path(self.dir, path), "w") as out:
            out.write(text)

    def restore(self):
        if self.current is None:
            return
        path, self.current = self.current, None
        target = shadow_path(self.dir, path)
        with open(target, "w") as out:
            out.write(self.originals[path])
        with open(target) as handle:
            if sha(handle.read()) != sha(self.originals[path]):
                raise RuntimeError(f"could not restore {target}")

    def close(self):
        self.restore()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def pytest_env(shadow, extra=None):
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1", REMAT_MUTATION_SHADOW=shadow.dir,
               PYTHONPATH=shadow.dir, HYPOTHESIS_STORAGE_DIRECTORY=os.path.join(shadow.dir, ".hypothesis"))
    env.pop("REMAT_BACKEND", None)
    env.update(extra or {})
    return env


def pytest_cmd(args):
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", PLUGIN, "-q", "--no-header",
            "-o", "addopts=", "-rfE", "--tb=line"] + args


def run_pytest(shadow, args, env_extra=None, timeout=None, log=None):
    """(returncode or "timeout", seconds, output)."""
    start = time.monotonic()
    proc = subprocess.Popen(pytest_cmd(args), cwd=shadow.dir, env=pytest_env(shadow, env_extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = "timeout"
    seconds = time.monotonic() - start
    if log:
        with open(log, "a") as handle:
            handle.write(f"\n$ pytest {' '.join(args[:6])}{' ...' if len(args) > 6 else ''}\n{out}")
    return code, seconds, out


def collect(shadow, tests, extra_keyword=None):
    node_ids = []
    for path, keyword in tests:
        if extra_keyword:
            keyword = f"({keyword}) and ({extra_keyword})" if keyword else extra_keyword
        if not os.path.exists(os.path.join(shadow.dir, path)):
            print(f"  (no {path}; skipped)")
            continue
        args = ["--collect-only", path] + (["-k", keyword] if keyword else [])
        code, _, out = run_pytest(shadow, args)
        ids = [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))]
        if code not in (0, 5):
            raise SystemExit(f"collecting {path} failed (exit {code}):\n{out[-3000:]}")
        node_ids += [i for i in ids if i not in node_ids]
    return node_ids


def baseline(shadow, block, node_ids, log):
    """Runs every test once under coverage: {tests: {id: {outcome, duration}}, lines: {file: {line: [ids]}}}."""
    cover_files = [os.path.realpath(shadow_path(shadow.dir, p)) for p in block["sources"]]
    out_json = os.path.join(shadow.dir, "baseline.json")
    args_file = os.path.join(shadow.dir, "baseline-args.txt")
    with open(args_file, "w") as handle:
        handle.write("\n".join(node_ids))
    env = {"REMAT_MUTATION_COVERAGE": out_json, "REMAT_MUTATION_COVER_FILES": os.pathsep.join(cover_files),
           "REMAT_MUTATION_CHECK": ",".join(f"{module_name(p)}=" for p in block["sources"])}
    code, seconds, out = run_pytest(shadow, [f"@{args_file}"], env, log=log)
    if code == SETUP_ERROR or not os.path.exists(out_json):
        raise SystemExit(f"baseline run failed to start (exit {code}):\n{out[-3000:]}")
    with open(out_json) as handle:
        data = json.load(handle)
    data["seconds"] = seconds
    data["exit"] = code
    return data


def select_tests(mutant, shadow, base, good):
    """The passing baseline tests that execute the mutant's code, fastest first."""
    path = os.path.realpath(shadow_path(shadow.dir, mutant.file))
    lines = base["lines"].get(path, {})
    if mutant.scope in ("line", "function"):
        lo, hi = mutant.cover_lines
        wanted = [str(n) for n in range(lo, hi + 1)]
    else:
        wanted = list(lines)
    chosen = set()
    for n in wanted:
        chosen.update(c for c in lines.get(n, []) if c)
    tests = [t for t in chosen if t in good]
    return sorted(tests, key=lambda t: (base["tests"][t]["duration"], t))


def classify(code, out):
    if code == "timeout":
        return "timeout", ""
    if code == SETUP_ERROR:
        raise SystemExit(f"setup check failed during a mutant run:\n{out[-3000:]}")
    if code == 0:
        return "survived", ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if code in (1, 2) or (isinstance(code, int) and code < 0):
        return "killed", failed[0] if failed else f"exit {code}"
    if code == 5:
        raise SystemExit(f"no tests ran for a mutant (exit 5):\n{out[-3000:]}")
    return "killed", f"pytest exit {code}: {out.strip().splitlines()[-1] if out.strip() else ''}"


def run_mutant(shadow, mutant, tests, base, args, log):
    original = shadow.originals[mutant.file]
    mutated = apply(original, mutant)
    expected = ",".join(f"{module_name(p)}={sha(shadow.originals[p]) if p != mutant.file else sha(mutated)}"
                        for p in shadow.originals)
    estimate = args.startup + sum(base["tests"][t]["duration"] for t in tests)
    timeout = args.timeout_factor * estimate + args.timeout_constant
    args_file = os.path.join(shadow.dir, "mutant-args.txt")
    with open(args_file, "w") as handle:
        handle.write("\n".join(tests))
    shadow.write(mutant.file, mutated)
    try:
        code, seconds, out = run_pytest(shadow, ["-x", f"@{args_file}"], {"REMAT_MUTATION_CHECK": expected},
                                        timeout=timeout, log=log)
    finally:
        shadow.restore()
    mutant.status, mutant.killed_by = classify(code, out)
    mutant.seconds = round(seconds, 1)
    mutant.tests_run = len(tests)
    return mutant


def canary(shadow, path, base, good, log):
    """A module-level raise appended to the file must be killed (the tests import the shadow copy)."""
    text = shadow.originals[path]
    data = text.encode()
    m = Mutant(path, len(data), len(data), "\nraise RuntimeError('remat mutation-runner canary')\n", "canary",
               text.count("\n") + 1, text.count("\n") + 1, "module", ())
    tests = select_tests(m, shadow, base, good)
    if not tests:
        raise SystemExit(f"no baseline test executes {path}: the block's tests do not import it")
    tests = tests[:3]
    mutated = apply(text, m)
    expected = ",".join(f"{module_name(p)}={sha(shadow.originals[p]) if p != path else sha(mutated)}"
                        for p in shadow.originals)
    shadow.write(path, mutated)
    try:
        code, seconds, out = run_pytest(shadow, ["-x"] + tests, {"REMAT_MUTATION_CHECK": expected}, log=log)
    finally:
        shadow.restore()
    if code == SETUP_ERROR or code == 0 or "remat mutation-runner canary" not in out:
        raise SystemExit(f"canary in {path} was not killed (exit {code}): the tests do not run the shadow copy\n"
                         f"{out[-3000:]}")
    return seconds


def sample(mutants, n, seed):
    """The mutants in a seeded random order (so a run cut short by its budget has run a random
    sample), or a seeded sample of n of them with each file represented in proportion."""
    rng = random.Random(seed)
    if n is None or n >= len(mutants):
        chosen = list(mutants)
    else:
        by_file = {}
        for m in mutants:
            by_file.setdefault(m.file, []).append(m)
        chosen = []
        for group in by_file.values():
            k = max(1, round(n * len(group) / len(mutants)))
            chosen += rng.sample(group, min(k, len(group)))
    rng.shuffle(chosen)
    return chosen[:n] if n else chosen


def write_report(path, block_name, summary, mutants, shadow, excluded_tests):
    counts = summary["counts"]
    lines = [f"# Mutation run: {block_name}", "",
             f"- date: {summary['date']}, commit {summary['commit']}, wall {summary['wall_s']:.0f} s "
             f"(baseline {summary['baseline_s']:.0f} s)",
             f"- mutants generated: {summary['generated']}; scheduled: {summary['run']} "
             f"(in a seeded random order, seed {summary['seed']}"
             f"{'' if summary['sampled'] is None else ', a sample of ' + str(summary['sampled'])}; "
             f"{summary['counts']['not-run']} not started within the {summary['budget_s']:.0f} s budget)",
             "- " + ", ".join(f"{k}: {v}" for k, v in counts.items()),
             "- source hashes: " + ", ".join(f"{p} {h[:12]}" for p, h in summary["hashes"].items()),
             f"- tests: {summary['tests']} selected by the block, {summary['good_tests']} passing in the baseline",
             ""]
    if excluded_tests:
        lines += ["Left out (not passing in the baseline):", ""] + [f"- {t}: {o}" for t, o in excluded_tests] + [""]
    for status in ("survived", "no-tests", "timeout"):
        group = [m for m in mutants if m.status == status]
        if not group:
            continue
        lines += [f"## {status} ({len(group)})", ""]
        for m in group:
            lines += [f"### {m.ident} ({m.kind}, {m.tests_run} tests, {m.seconds} s)", "", "```diff",
                      diff(shadow.originals[m.file], apply(shadow.originals[m.file], m), m.file), "```", ""]
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", required=True, choices=sorted(BLOCKS))
    parser.add_argument("--max-mutants", type=int, default=None, help="run a seeded sample of this many")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=1500.0,
                        help="stop starting mutants after this many seconds of wall time, baseline included (the "
                             "rest are reported as not run); 0 for no limit. Default 1500 (25 minutes)")
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids (file:line:index) to run")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout-factor", type=float, default=3.0)
    parser.add_argument("--timeout-constant", type=float, default=30.0)
    parser.add_argument("--keyword", default=None, help="a further -k expression on the block's tests (quick runs)")
    parser.add_argument("--report", default=None)
    parser.add_argument("--keep-shadow", action="store_true")
    args = parser.parse_args(argv)
    block = BLOCKS[args.block]
    wall_start = time.monotonic()

    mutants = []
    texts = {}
    for path in block["sources"]:
        with open(os.path.join(ROOT, path)) as handle:
            texts[path] = handle.read()
        mutants += generate(path, texts[path], block["skip_functions"])
    print(f"{args.block}: {len(mutants)} mutants in " +
          ", ".join(f"{p} ({sum(m.file == p for m in mutants)})" for p in block["sources"]))
    if args.list:
        for m in mutants:
            print(f"{m.ident} [{m.kind}] {diff(texts[m.file], apply(texts[m.file], m), m.file)}")
        return 0
    if args.only:
        chosen = [m for m in mutants if m.ident in set(args.only)]
        missing = set(args.only) - {m.ident for m in chosen}
        if missing:
            raise SystemExit(f"unknown mutant ids: {sorted(missing)}")
    else:
        chosen = sample(mutants, args.max_mutants, args.seed)

    os.makedirs(CACHE, exist_ok=True)
    log = os.path.join(CACHE, f"{args.block}-pytest.log")
    open(log, "w").close()
    shadow = Shadow(block["sources"], keep=args.keep_shadow)
    for path in block["sources"]:
        if shadow.originals[path] != texts[path]:
            raise SystemExit(f"{path} changed while being copied; run again")

    def on_signal(signum, frame):
        shadow.close()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        print(f"shadow tree: {shadow.dir}")
        node_ids = collect(shadow, block["tests"], args.keyword)
        print(f"baseline: {len(node_ids)} tests under coverage ...", flush=True)
        base = baseline(shadow, block, node_ids, log)
        good = {t for t, e in base["tests"].items() if e["outcome"] == "passed"}
        excluded = sorted((t, e["outcome"]) for t, e in base["tests"].items()
                          if e["outcome"] not in ("passed", "skipped"))
        print(f"baseline: {len(good)} passed, {len(excluded)} left out as not passing, "
              f"{sum(e['outcome'] == 'skipped' for e in base['tests'].values())} skipped, {base['seconds']:.0f} s")
        for t, o in excluded:
            print(f"  left out: {t} ({o})")
        startup = []
        for path in block["sources"]:
            startup.append(canary(shadow, path, base, good, log))
            print(f"canary killed in {path} ({startup[-1]:.0f} s)", flush=True)
        args.startup = max(startup)
        for i, m in enumerate(chosen):
            if args.budget_s and time.monotonic() - wall_start > args.budget_s:
                m.status = "not-run"
                continue
            tests = select_tests(m, shadow, base, good)
            if not tests:
                m.status = "no-tests"
            else:
                run_mutant(shadow, m, tests, base, args, log)
            note = f" <- {m.killed_by}" if m.killed_by else ""
            print(f"[{i + 1}/{len(chosen)}] {m.status:8s} {m.ident} {m.kind} ({m.tests_run} tests, "
                  f"{m.seconds:.0f} s){note}", flush=True)
            if m.status in ("survived", "timeout", "no-tests"):
                print("    " + diff(texts[m.file], apply(texts[m.file], m), m.file).replace("\n", "\n    "))
        counts = {s: sum(m.status == s for m in chosen) for s in ("killed", "survived", "timeout", "no-tests",
                                                                  "not-run")}
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        summary = {"block": args.block, "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
                   "wall_s": time.monotonic() - wall_start, "baseline_s": base["seconds"],
                   "generated": len(mutants), "run": len(chosen), "budget_s": args.budget_s or 0,
                   "sampled": args.max_mutants if not args.only else None, "seed": args.seed, "counts": counts,
                   "hashes": {p: sha(t) for p, t in texts.items()}, "tests": len(node_ids),
                   "good_tests": len(good)}
        with open(os.path.join(CACHE, f"{args.block}-results.json"), "w") as out:
            json.dump({"summary": summary, "mutants": [asdict(m) for m in chosen]}, out, indent=1)
        report = args.report or os.path.join(CACHE, f"{args.block}-report.md")
        write_report(report, args.block, summary, chosen, shadow, excluded)
        print(f"\n{args.block}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) +
              f" of {len(chosen)} run ({len(mutants)} generated); {summary['wall_s']:.0f} s; report {report}")
        return 0
    finally:
        shadow.close()


if __name__ == "__main__":
    sys.exit(main())
