"""The import rules of DESIGN.md "Layers", read from the source (ast), and
``hicache simulate`` run in a process where vLLM and torch cannot be imported.

Every import statement of the product code counts, including those inside
functions; an import under ``if TYPE_CHECKING:`` is for the type checker only
and is allowed where EXCEPTIONS says so.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("connector", "tiers", "kernels", "integration")


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root
    line: int
    module: str  # absolute dotted name
    typing_only: bool

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(path: Path) -> list[Import]:
    rel = path.relative_to(ROOT).as_posix()
    package = ["hicache", *rel.split("/")[:-1]]
    found: list[Import] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, typing_only)
                continue
            visit_stmt(child, typing_only)

    def visit_stmt(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(rel, node.lineno, alias.name, typing_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append(Import(rel, node.lineno, module, typing_only))
        visit(node, typing_only)

    visit(ast.parse(path.read_text(), filename=rel), False)
    return found


def product_imports() -> list[Import]:
    out: list[Import] = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            out += _imports_of(path)
    return out


IMPORTS = product_imports()


def top(module: str) -> str:
    return module.split(".")[0]


def under(imp: Import, *folders: str) -> bool:
    return any(imp.path.startswith(f.rstrip("/") + "/") for f in folders)


def refers_to(imp: Import, *layers: str) -> bool:
    return any(imp.module == f"hicache.{x}" or imp.module.startswith(f"hicache.{x}.")
               for x in layers)


# (file, imported module): the allowed exceptions, each with its reason.
EXCEPTIONS = {
    # The admin view names the connector's config type for the type checker only.
    ("tiers/controller/admin.py", "hicache.tiers.config"),
    # The connector starts the admin HTTP server when hicache_admin_port is set
    # (imported inside that function, so FastAPI loads only then).
    ("connector/connector.py", "hicache.integration.admin.server"),
}


def violations(bad) -> list[str]:
    return [str(i) for i in IMPORTS if bad(i) and (i.path, i.module) not in EXCEPTIONS]


def test_the_source_is_read():
    # The walk sees what it must: a rule over nothing would pass.
    assert any(i.path == "connector/connector.py" and top(i.module) == "vllm" for i in IMPORTS)
    assert any(i.path.startswith("tiers/l2/") and i.module == "torch" for i in IMPORTS)
    assert any(i.typing_only for i in IMPORTS)


def test_only_the_connector_and_the_vllm_glue_import_vllm():
    assert violations(lambda i: top(i.module) == "vllm"
                      and not under(i, "connector", "integration/vllm")) == []


def test_the_index_and_the_controller_import_no_torch():
    """Neither directly nor through a module of ours that does (the kernels, the worker
    core, the settings naming the io backends); the type checker may see them."""
    torch_modules = ("kernels", "tiers.worker", "tiers.config", "tiers.engine_shape")
    assert violations(lambda i: under(i, "tiers/index", "tiers/controller") and (
        top(i.module) in {"torch", "vllm"}
        or (refers_to(i, *torch_modules) and not i.typing_only))) == []


def test_tiers_import_neither_the_connector_nor_integration():
    assert violations(lambda i: under(i, "tiers")
                      and refers_to(i, "connector", "integration")) == []


def test_only_the_worker_core_and_the_settings_use_the_kernels():
    """The worker core (tiers/worker/) moves bytes with kernels/; the settings name the
    io backends kernels/io_backend.py implements. Nothing else in tiers/ reaches down."""
    assert violations(lambda i: under(i, "tiers") and refers_to(i, "kernels")
                      and not under(i, "tiers/worker") and i.path != "tiers/config.py") == []
    assert any(i.path.startswith("tiers/worker/") and refers_to(i, "kernels") for i in IMPORTS)


def test_the_worker_core_is_engine_free():
    assert [str(i) for i in IMPORTS if under(i, "tiers/worker") and top(i.module) == "vllm"] == []
    assert any(i.path == "tiers/worker/core.py" for i in IMPORTS)


def test_kernels_import_neither_the_connector_nor_integration():
    assert violations(lambda i: under(i, "kernels")
                      and (refers_to(i, "connector", "integration", "tiers")
                           or top(i.module) == "vllm")) == []


def test_the_connector_does_not_import_integration():
    assert violations(lambda i: under(i, "connector") and refers_to(i, "integration")) == []


# Each L3 backend is a folder of tiers/l3/; what tiers/l3/ keeps at its top (base, guard,
# integrity, native I/O, verify, the factory) is shared.
BACKENDS = ("file", "mooncake", "lmcache", "nixl")


def _named_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of what ``path`` imports, ``from X import a`` as ``X.a``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def test_l3_is_a_folder_per_backend():
    l3 = ROOT / "tiers" / "l3"
    assert sorted(p.name for p in l3.iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(BACKENDS)
    assert not [p.name for p in l3.glob("*_backend.py")]


def test_the_data_plane_keeps_small_rooms():
    """No L3 module over 500 lines (the worker's L3 I/O thread included), the worker
    facade at most 300."""
    files = [*(ROOT / "tiers" / "l3").rglob("*.py"), *(ROOT / "tiers" / "worker").glob("l3_*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
    assert len((ROOT / "tiers" / "worker" / "core.py").read_text().splitlines()) <= 300


def test_l3_backends_never_import_each_other():
    def backend_of(dotted: str) -> str | None:
        if not dotted.startswith("hicache.tiers.l3."):
            return None
        name = dotted.removeprefix("hicache.tiers.l3.").split(".")[0]
        return name if name in BACKENDS else None

    seen, bad = 0, []
    for backend in BACKENDS:
        for path in sorted((ROOT / "tiers" / "l3" / backend).glob("*.py")):
            for line, name in _named_imports(path):
                seen += 1
                other = backend_of(name)
                if other not in (None, backend):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert seen, "the walk saw no backend import"
    assert bad == []


# Where a backend's verbs are called inside a broad ``except`` outside the guard: the
# scheduler half's lookups, which count a failing store as a lookup error (its stores
# are guarded too; these catch what a lookup path itself raises).
CATCHES_BESIDE_THE_GUARD = {
    ("tiers/controller/admin.py", "lookup"),
    ("tiers/controller/admin.py", "_plan_prefetch"),
    ("tiers/controller/fetches.py", "_ask"),
}
VERBS = {"read", "write", "exists_prefix", "delete", "clear", "retain"}


def _broad(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return handler.type is None or any(
        isinstance(k, ast.Name) and k.id in ("Exception", "BaseException") for k in kinds)


def _catches_of_backend_calls() -> set[tuple[str, str]]:
    """(file, function) of every broad ``try`` whose body touches a backend verb."""
    found = set()
    for path in [*(ROOT / "tiers").rglob("*.py"), *(ROOT / "connector").glob("*.py")]:
        rel = str(path.relative_to(ROOT))
        if rel == "tiers/l3/guard.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not (isinstance(node, ast.Try) and any(_broad(h) for h in node.handlers)):
                    continue
                touched = [a for sub in node.body for a in ast.walk(sub)
                           if isinstance(a, ast.Attribute) and a.attr in VERBS
                           and any(w in ast.unparse(a.value)
                                   for w in ("storage", "store", "backend", "shard"))]
                if touched:
                    found.add((rel, fn.name))
    return found


def test_only_the_guard_turns_a_backends_exception_into_a_miss():
    """The worker's L3 path (l3_io.py, l3_link.py, the store queue), the shards and the
    backends call their stores bare: a failing store is the guard's to count."""
    assert _catches_of_backend_calls() == CATCHES_BESIDE_THE_GUARD


def test_exceptions_are_still_needed():
    used = {(i.path, i.module) for i in IMPORTS}
    assert EXCEPTIONS <= used, EXCEPTIONS - used


def _left_out_of_the_wheel() -> list[str]:
    """The packages pyproject.toml's setuptools ``exclude`` leaves out of the wheel."""
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["exclude"]
    return [pattern.rstrip("*").rstrip(".") for pattern in found]


def test_what_the_wheel_ships_imports_nothing_it_leaves_out():
    """An installed ``hicache`` command must not reach a module the wheel does not
    carry (``hicache bench peers`` did): modules outside the excluded packages import
    none of them, inside functions included."""
    left_out = _left_out_of_the_wheel()
    assert "hicache.integration.bench.peers" in left_out  # the rule reads the real list

    def shipped(path: str) -> bool:
        dotted = "hicache." + path.removesuffix(".py").replace("/", ".")
        return not any(dotted == x or dotted.startswith(x + ".") for x in left_out)

    bad = [str(i) for i in IMPORTS if shipped(i.path) and not i.typing_only
           and any(i.module == x or i.module.startswith(x + ".") for x in left_out)]
    assert bad == []


_SIMULATE_WITHOUT_ENGINE = """
import importlib.abc, json, sys

class NoEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"vllm", "torch"}:
            raise ImportError(f"{name} is blocked: hicache simulate must run without it")
        return None

sys.meta_path.insert(0, NoEngine())
from hicache.integration.bench.trace import TraceRecord, write_trace
from hicache.integration.cli.main import app

out = sys.argv[1]
recs = [TraceRecord(id=f"c{c}-t{t}", arrival=3 * t + c, finish=3 * t + c + 0.5, output_tokens=4,
                    prompt=tuple(range(c * 5000, c * 5000 + 300 + 100 * t)),
                    prompt_tokens=300 + 100 * t)
        for t in range(2) for c in range(3)]
trace = write_trace(out + "/t.jsonl", recs)
try:
    app(["simulate", str(trace), "--l1-blocks", "20", "--l2-pages", "0,100", "--l3-pages",
         "none", "--out", out + "/sim", "--no-progress"])
except SystemExit as e:
    assert e.code in (0, None), e.code
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "torch"})))
"""


def test_simulate_runs_where_vllm_and_torch_cannot_be_imported(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _SIMULATE_WITHOUT_ENGINE, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    rows = json.loads((tmp_path / "sim" / "simulate.json").read_text())["rows"]
    assert len(rows) == 2 and any(r["hit_l2"] > 0 for r in rows)


def test_the_bench_report_does_not_import_the_client_it_reports_for():
    """client.py imports report.py; the records both read live in records.py, so no
    import runs back (not even for the type checker)."""
    assert [str(i) for i in IMPORTS if i.path == "integration/bench/report.py"
            and refers_to(i, "integration.bench.client")] == []
    assert any(i.path == "integration/bench/client.py"
               and i.module == "hicache.integration.bench.report" for i in IMPORTS)
