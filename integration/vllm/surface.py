"""The part of vLLM's API the connector stands on, read from vLLM's source without
importing it, so a vLLM release that is not installed (another torch, CUDA-only) can
be checked here.

Contract:
- ``our_imports()``: every ``from vllm.X import N`` in the connector's modules
  (``connector/``, ``integration/vllm/``), TYPE_CHECKING and function-level ones too.
- ``extract(root, imports)``: ``root`` is a folder holding ``vllm/`` or a vLLM wheel.
  For every module named in ``imports``: its top-level names, and for every imported
  name that is a class there, its bases, its methods (parameter names and kinds, which
  have defaults, decorators such as classmethod / abstractmethod) and its class-level
  names (enum members, fields). A module that is missing is recorded as missing.
- ``check(surface)``: what would break against that surface, as readable lines:
  an imported name or module that is gone; a method our class overrides whose vLLM
  signature it no longer accepts (a parameter vLLM passes that ours lacks or renamed,
  an extra parameter of ours without a default, a classmethod that became an instance
  method or back); an abstract method of a vLLM base we do not define; an enum member
  we use (``CacheHitSource.X``) that is gone. Our classes are read from our source
  the same way, so the check needs neither vLLM version installed.
- Snapshots: ``python -m hicache.integration.vllm.surface snapshot --wheel W --out J``
  writes the surface of a wheel as JSON (``surface-vllm-<version>.json`` beside this
  file is vLLM 0.33.0's); ``check --snapshot J`` (or ``--root DIR``) prints the
  problems and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUR_SOURCES = ("connector", "integration/vllm")
SNAPSHOT_033 = HERE / "surface-vllm-0.33.0.json"


# ---- reading Python source -------------------------------------------------------


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[list[Any]]:
    """[[name, kind, has_default], ...] in declaration order; kind is one of
    positional / keyword / var_positional / var_keyword (``self``/``cls`` dropped)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    n_defaults = len(a.defaults)
    out: list[list[Any]] = []
    for i, arg in enumerate(positional):
        out.append([arg.arg, "positional", i >= len(positional) - n_defaults])
    if a.vararg is not None:
        out.append([a.vararg.arg, "var_positional", False])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append([arg.arg, "keyword", default is not None])
    if a.kwarg is not None:
        out.append([a.kwarg.arg, "var_keyword", False])
    decorators = _decorators(fn)
    if out and "staticmethod" not in decorators and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = []
    for d in fn.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.Name):
            names.append(node.id)
    return names


def _class_surface(node: ast.ClassDef) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    attrs: list[str] = []
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            methods[item.name] = {"params": _params(item), "decorators": _decorators(item)}
        elif isinstance(item, ast.Assign):
            attrs += [t.id for t in item.targets if isinstance(t, ast.Name)]
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attrs.append(item.target.id)
    return {"bases": [ast.unparse(b) for b in node.bases], "methods": methods,
            "attrs": sorted(attrs)}


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module defines or re-exports at top level (also under if/try)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return names


# ---- our side --------------------------------------------------------------------


def _our_files() -> Iterator[Path]:
    for folder in OUR_SOURCES:
        yield from sorted((REPO / folder).glob("*.py"))


def our_imports() -> dict[str, list[str]]:
    """module -> sorted names our connector imports from it."""
    out: dict[str, set[str]] = {}
    for path in _our_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and (node.module == "vllm" or node.module.startswith("vllm.")):
                out.setdefault(node.module, set()).update(a.name for a in node.names)
    return {m: sorted(n) for m, n in sorted(out.items())}


@dataclass(frozen=True)
class OurClass:
    name: str
    file: str
    bases: tuple[str, ...]
    methods: dict[str, Any]


def our_classes() -> list[OurClass]:
    """Our classes that derive from a class imported from vLLM."""
    vllm_names = {n for names in our_imports().values() for n in names}
    out = []
    for path in _our_files():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                s = _class_surface(node)
                bases = tuple(b for b in s["bases"] if b in vllm_names)
                if bases:
                    out.append(OurClass(node.name, str(path.relative_to(REPO)), bases,
                                        s["methods"]))
    return out


def enum_uses() -> dict[str, set[str]]:
    """``Name.MEMBER`` uses of the vLLM enums we import (upper-case members only)."""
    enums = {"CacheHitSource"}
    out: dict[str, set[str]] = {}
    for path in _our_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in enums and node.attr.isupper():
                out.setdefault(node.value.id, set()).add(node.attr)
    return out


# ---- vLLM's side -----------------------------------------------------------------


class _Source:
    """Read ``vllm/...`` files from a folder or a wheel."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._zip = zipfile.ZipFile(root) if root.is_file() else None

    def read(self, module: str) -> str | None:
        rel = module.replace(".", "/")
        for cand in (f"{rel}.py", f"{rel}/__init__.py"):
            if self._zip is not None:
                try:
                    return self._zip.read(cand).decode()
                except KeyError:
                    continue
            elif (self.root / cand).exists():
                return (self.root / cand).read_text()
        return None

    def version(self) -> str:
        text = self.read("vllm._version") or ""
        for line in text.splitlines():
            # "__version__ = version = '0.33.0'" (setuptools-scm / vcs-versioning)
            if line.startswith("__version__") and "=" in line and ":" not in line:
                return line.rsplit("=", 1)[1].strip().strip("'\"")
        return "unknown"


def extract(root: Path, imports: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The surface of the vLLM at ``root`` (folder holding ``vllm/``, or a wheel)."""
    imports = imports if imports is not None else our_imports()
    src = _Source(root)
    modules: dict[str, Any] = {}
    for module, names in imports.items():
        text = src.read(module)
        if text is None:
            modules[module] = {"missing": True}
            continue
        tree = ast.parse(text)
        classes = {node.name: _class_surface(node) for node in tree.body
                   if isinstance(node, ast.ClassDef) and node.name in names}
        # The bases of those classes in the same module (SupportsHMA, ...).
        pending = [b for c in classes.values() for b in c["bases"]]
        local = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        while pending:
            base = pending.pop()
            if base in local and base not in classes:
                classes[base] = _class_surface(local[base])
                pending += classes[base]["bases"]
        modules[module] = {"names": sorted(_top_level_names(tree) & set(names)),
                           "classes": classes}
    return {"vllm_version": src.version(), "imports": imports, "modules": modules}


def installed_root() -> Path:
    """The folder holding the installed ``vllm`` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vllm is not installed")
    return Path(spec.origin).parent.parent


# ---- the check -------------------------------------------------------------------


def _vllm_class(surface: dict[str, Any], name: str) -> dict[str, Any] | None:
    for mod in surface["modules"].values():
        if name in mod.get("classes", {}):
            cls: dict[str, Any] = mod["classes"][name]
            return cls
    return None


def _vllm_methods(surface: dict[str, Any], name: str) -> dict[str, Any]:
    """Methods of a vLLM class and of its vLLM bases (nearest first)."""
    out: dict[str, Any] = {}
    seen: set[str] = set()
    queue = [name]
    while queue:
        cls_name = queue.pop(0)
        if cls_name in seen:
            continue
        seen.add(cls_name)
        cls = _vllm_class(surface, cls_name)
        if cls is None:
            continue
        for m, sig in cls["methods"].items():
            out.setdefault(m, sig)
        queue += cls["bases"]
    return out


def signature_problems(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Why vLLM's calls of ``theirs`` would fail against our override ``ours``."""
    problems = []
    kind = {"classmethod", "staticmethod", "property"}
    if set(ours["decorators"]) & kind != set(theirs["decorators"]) & kind:
        problems.append(f"decorators {sorted(set(theirs['decorators']) & kind)} in vLLM, "
                        f"{sorted(set(ours['decorators']) & kind)} here")
    our_params = ours["params"]
    our_pos = [p for p in our_params if p[1] == "positional"]
    our_names = {p[0] for p in our_params}
    our_var_kw = any(p[1] == "var_keyword" for p in our_params)
    our_var_pos = any(p[1] == "var_positional" for p in our_params)
    their_pos = [p for p in theirs["params"] if p[1] == "positional"]
    for i, (name, _, _) in enumerate(their_pos):
        if i < len(our_pos):
            if our_pos[i][0] != name and not our_var_kw:
                problems.append(f"parameter {i + 1} is {name!r} in vLLM, {our_pos[i][0]!r} here")
        elif not our_var_pos:
            problems.append(f"vLLM passes {name!r}, which this override does not take")
    for name, k, _ in theirs["params"]:
        if k == "keyword" and name not in our_names and not our_var_kw:
            problems.append(f"vLLM may pass keyword {name!r}, which this override does not take")
        if k == "var_keyword" and not our_var_kw:
            problems.append(f"vLLM's signature takes **{name}; this override takes no **kwargs")
    their_names = {p[0] for p in theirs["params"]}
    for name, k, has_default in our_params:
        if k in ("positional", "keyword") and name not in their_names and not has_default:
            problems.append(f"parameter {name!r} here has no default and vLLM never passes it")
    return problems


def check(surface: dict[str, Any]) -> list[str]:
    """Every way our connector would break against ``surface`` (empty: none)."""
    problems: list[str] = []
    version = surface["vllm_version"]
    for module, names in our_imports().items():
        mod = surface["modules"].get(module)
        if mod is None:
            problems.append(f"{module}: not in the snapshot (re-take it)")
            continue
        if mod.get("missing"):
            problems.append(f"{module}: gone in vLLM {version}")
            continue
        asked = set(surface.get("imports", {}).get(module, names))
        for name in names:
            if name not in asked:
                problems.append(f"{module}.{name}: not in the snapshot (re-take it)")
            elif name not in mod["names"]:
                problems.append(f"{module}.{name}: gone in vLLM {version}")
    for cls in our_classes():
        theirs: dict[str, Any] = {}
        for base in cls.bases:
            for m, sig in _vllm_methods(surface, base).items():
                theirs.setdefault(m, sig)
        for m, sig in cls.methods.items():
            if m.startswith("__") or m not in theirs:
                continue
            for p in signature_problems(sig, theirs[m]):
                problems.append(f"{cls.name}.{m} ({cls.file}): {p}")
        for m, sig in theirs.items():
            if "abstractmethod" in sig["decorators"] and m not in cls.methods:
                problems.append(f"{cls.name} ({cls.file}): vLLM {version} declares abstract "
                                f"{m}(), not defined here")
    for enum, members in enum_uses().items():
        cls_surface = _vllm_class(surface, enum)
        if cls_surface is None:
            continue
        for member in sorted(members - set(cls_surface["attrs"])):
            problems.append(f"{enum}.{member}: gone in vLLM {version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="write a wheel's (or folder's) surface as JSON")
    s.add_argument("--wheel", type=Path, required=True, help="a vLLM wheel or source folder")
    s.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="our connector against a snapshot or a vLLM folder")
    c.add_argument("--snapshot", type=Path, default=None)
    c.add_argument("--root", type=Path, default=None, help="default: the installed vLLM")
    args = p.parse_args(argv)
    if args.cmd == "snapshot":
        surface = extract(args.wheel)
        args.out.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
        print(f"vLLM {surface['vllm_version']}: {len(surface['modules'])} modules -> {args.out}")
        return 0
    if args.snapshot is not None:
        surface = json.loads(args.snapshot.read_text())
    else:
        surface = extract(args.root or installed_root())
    problems = check(surface)
    for line in problems:
        print(line)
    print(f"vLLM {surface['vllm_version']}: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
