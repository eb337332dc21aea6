"""The dependency direction of docs/develop/architecture.md, checked on the source: an import that runs
against it fails here, before it can tangle the layers.

    kernels <- runtime <- engine <- triton_adapter <- model_repository/*/1/model.py
    core (pure Python) <- engine;   client apart: client and backend never import each other
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvshare": ROOT / "backend", "kvshare_kernels": ROOT / "kernels", "kvshare_client": ROOT / "client"}

# Layer of a module: its package, or for kvshare its first subpackage.
ALLOWED: dict[str, frozenset[str]] = {
    "kernels": frozenset({"kernels"}),
    "core": frozenset({"core", "sampling_params"}),
    "sampling_params": frozenset(),
    "runtime": frozenset({"runtime", "kernels", "sampling_params"}),
    "engine": frozenset({"engine", "runtime", "core", "sampling_params"}),
    "triton_adapter": frozenset({"triton_adapter", "engine", "runtime", "sampling_params"}),
    "launch": frozenset({"launch"}),
    "package": frozenset(),
    "client": frozenset({"client"}),
}
# Third-party modules a layer must not import at all.
FORBIDDEN_EXTERNAL: dict[str, frozenset[str]] = {
    "core": frozenset({"torch", "triton", "numpy", "triton_python_backend_utils"}),
    "sampling_params": frozenset({"torch", "triton", "triton_python_backend_utils"}),
    "kernels": frozenset({"triton_python_backend_utils"}),
    "runtime": frozenset({"triton_python_backend_utils"}),
    "engine": frozenset({"triton_python_backend_utils"}),
    "launch": frozenset({"torch", "triton", "triton_python_backend_utils"}),
    "client": frozenset({"torch", "triton", "transformers", "triton_python_backend_utils"}),
}


@dataclass(frozen=True)
class Import:
    source: str   # dotted module name of the importing file
    target: str   # dotted name imported
    line: int


def module_name(path: Path) -> str:
    for top, base in PACKAGES.items():
        if path.is_relative_to(base / top):
            parts = path.relative_to(base).with_suffix("").parts
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def imports_of(path: Path) -> list[Import]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                found += [Import(name, f"{target}.{a.name}" if not node.module else target, node.lineno)
                          for a in node.names]
            else:
                found.append(Import(name, node.module or "", node.lineno))
    return found


def layer(module: str) -> str | None:
    top, _, rest = module.partition(".")
    if top == "kvshare_kernels":
        return "kernels"
    if top == "kvshare_client":
        return "client"
    if top == "kvshare":
        return rest.partition(".")[0] or "package"
    return None


def all_imports() -> list[Import]:
    files = [p for top, base in PACKAGES.items() for p in sorted((base / top).rglob("*.py"))]
    return [imp for path in files for imp in imports_of(path)]


def violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = layer(imp.source), layer(imp.target)
        if dst is not None and dst not in ALLOWED[src]:
            bad.append(f"{imp.source}:{imp.line} imports {imp.target} ({src} may not depend on {dst})")
        ext = imp.target.partition(".")[0]
        if dst is None and ext in FORBIDDEN_EXTERNAL.get(src, ()):
            bad.append(f"{imp.source}:{imp.line} imports {imp.target} ({src} may not use {ext})")
    return bad


def test_every_import_follows_the_dependency_direction():
    imports = all_imports()
    assert len(imports) > 100, "the scan found too few imports: are the package folders where it looks?"
    assert violations(imports) == []


def test_the_checker_catches_an_import_against_the_direction():
    wrong = [Import("kvshare.core.scheduler", "torch", 1), Import("kvshare_kernels.kv_write", "kvshare.core", 2),
             Import("kvshare_client.cli", "kvshare.engine", 3), Import("kvshare.engine.engine", "kvshare_client", 4),
             Import("kvshare.runtime.llama", "kvshare.engine.engine", 5)]
    assert len(violations(wrong)) == len(wrong)


def test_relative_imports_resolve_to_their_package():
    found = {i.target for i in imports_of(ROOT / "backend" / "kvshare" / "engine" / "engine.py")}
    assert any(t.startswith("kvshare.core") for t in found), found


@pytest.mark.parametrize("model", sorted(p.parent.parent.name for p in (ROOT / "model_repository").glob("*/1/model.py")))
def test_model_repository_entry_points_import_only_the_adapter(model):
    tree = ast.parse((ROOT / "model_repository" / model / "1" / "model.py").read_text())
    targets = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    targets += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert targets and all(t.startswith("kvshare.triton_adapter") for t in targets), targets
