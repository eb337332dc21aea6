"""The dependency direction of docs/develop/architecture.md, checked on the source: an import that runs
against it fails here, before it can tangle the layers.

    kernels <- runtime <- engine <- triton_adapter <- model_repository/*/1/model.py
    core (pure Python) <- engine;   client apart: client and backend never import each other

Within and across those packages no two modules may import each other, directly or through others
(an import circle): a circle makes the modules one unit that can only be read, tested and loaded
together, and at module level it breaks as soon as one side needs a name the other has not defined
yet. Imports inside functions count as much as those at the top: the project imports in functions
(a heavy or optional dependency only on the path that needs it: torch.multiprocessing, tritonclient),
and such an import still ties the two modules; it only defers the circle to the first call (the two
circles this check found, engine <-> tensor_parallel_ranks and contract <-> vllm_params, hid exactly
that way). `if TYPE_CHECKING:` imports count too (types shared both ways are the same tangle). The
import of a module's parent packages that Python makes on the way is not an edge: only the module
an import statement names (for `from package import name`, package.name when that is a module).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvshare": ROOT / "backend", "kvshare_kernels": ROOT / "kernels", "kvshare_client": ROOT / "client",
            "kvshare_openai": ROOT / "openai_frontend"}

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
    "openai": frozenset({"openai"}),
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
    # the OpenAI frontend loads only the tokenizer (transformers without torch) and talks gRPC
    "openai": frozenset({"torch", "triton", "triton_python_backend_utils"}),
}


@dataclass(frozen=True)
class Import:
    source: str   # dotted module name of the importing file
    target: str   # dotted name imported
    line: int
    names: tuple[str, ...] = ()     # `from target import names`


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
                found += [Import(name, f"{target}.{a.name}" if not node.module else target, node.lineno,
                                 () if not node.module else (a.name,)) for a in node.names]
            else:
                found.append(Import(name, node.module or "", node.lineno, tuple(a.name for a in node.names)))
    return found


def layer(module: str) -> str | None:
    top, _, rest = module.partition(".")
    if top == "kvshare_kernels":
        return "kernels"
    if top == "kvshare_client":
        return "client"
    if top == "kvshare_openai":
        return "openai"
    if top == "kvshare":
        return rest.partition(".")[0] or "package"
    return None


def project_files() -> list[Path]:
    return [p for top, base in PACKAGES.items() for p in sorted((base / top).rglob("*.py"))]


def all_imports() -> list[Import]:
    return [imp for path in project_files() for imp in imports_of(path)]


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


def imported_modules(imp: Import, modules: frozenset[str]) -> set[str]:
    """The project modules an import statement names: for `from package import name`, package.name
    where that is a module, else package; for `import a.b.c`, the longest prefix that is a module."""
    found = {f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules}
    if len(found) < len(imp.names) or not imp.names:
        parts = imp.target.split(".")
        prefixes = (".".join(parts[:k]) for k in range(len(parts), 0, -1))
        found |= {next((m for m in prefixes if m in modules), None)} - {None}
    return found


def import_graph(imports: list[Import], modules: frozenset[str]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for imp in imports:
        for target in imported_modules(imp, modules) - {imp.source}:
            graph.setdefault(imp.source, {}).setdefault(target, imp.line)
    return graph


def _reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each group of modules that import one another (directly or through others), each group as
    "a:line imports b" lines, so that a failure names the imports to undo."""
    reach = {m: _reachable(graph, m) for m in graph}
    groups, placed = [], set()
    for m in sorted(graph):
        if m in placed or m not in reach[m]:
            continue
        group = {m} | {o for o in reach[m] if m in reach[o]}
        placed |= group
        groups.append([f"{a}:{line} imports {b}" for a in sorted(group)
                       for b, line in sorted(graph[a].items()) if b in group])
    return groups


def test_every_import_follows_the_dependency_direction():
    imports = all_imports()
    assert len(imports) > 100, "the scan found too few imports: are the package folders where it looks?"
    assert violations(imports) == []


def test_the_checker_catches_an_import_against_the_direction():
    wrong = [Import("kvshare.core.scheduler", "torch", 1), Import("kvshare_kernels.kv_write", "kvshare.core", 2),
             Import("kvshare_client.cli", "kvshare.engine", 3), Import("kvshare.engine.engine", "kvshare_client", 4),
             Import("kvshare.runtime.llama", "kvshare.engine.engine", 5)]
    assert len(violations(wrong)) == len(wrong)


def test_no_modules_import_each_other():
    modules = frozenset(module_name(p) for p in project_files())
    graph = import_graph(all_imports(), modules)
    assert sum(map(len, graph.values())) > 100, "the graph has too few edges: are imports resolved to modules?"
    assert import_cycles(graph) == []


def test_the_cycle_finder_catches_direct_indirect_and_in_function_circles():
    """The two circles the project had (one side's import of the other was inside a function: line
    118 of tensor_parallel_ranks, 403 of contract), and one through a third module."""
    modules = frozenset({"kvshare.engine.engine", "kvshare.engine.tensor_parallel_ranks",
                         "kvshare.triton_adapter.contract", "kvshare.triton_adapter.vllm_params",
                         "kvshare_client.a", "kvshare_client.b", "kvshare_client.c"})
    imports = [Import("kvshare.engine.engine", "kvshare.engine.tensor_parallel_ranks", 120, ("TensorParallelRanks",)),
               Import("kvshare.engine.tensor_parallel_ranks", "kvshare.engine.engine", 118, ("_DTYPES",)),
               Import("kvshare.triton_adapter.vllm_params", "kvshare.triton_adapter.contract", 18,
                      ("MAX_RETURN_SEQUENCES",)),
               Import("kvshare.triton_adapter.contract", "kvshare.triton_adapter.vllm_params", 403, ("KEY_DOCS",)),
               Import("kvshare_client.a", "kvshare_client", 1, ("b",)),       # from . import b
               Import("kvshare_client.b", "kvshare_client.c", 1),
               Import("kvshare_client.c", "kvshare_client.a", 1, ("helper",))]
    cycles = import_cycles(import_graph(imports, modules))
    assert [sorted({line.split(":")[0] for line in c}) for c in cycles] == [
        ["kvshare.engine.engine", "kvshare.engine.tensor_parallel_ranks"],
        ["kvshare.triton_adapter.contract", "kvshare.triton_adapter.vllm_params"],
        ["kvshare_client.a", "kvshare_client.b", "kvshare_client.c"]]
    assert "kvshare.engine.tensor_parallel_ranks:118 imports kvshare.engine.engine" in cycles[0]
    one_edge_less = [i for i in imports if i.line not in (118, 403) and i.source != "kvshare_client.c"]
    assert import_cycles(import_graph(one_edge_less, modules)) == []


def test_a_package_init_importing_its_submodules_is_no_circle():
    """A submodule's import of a sibling loads their package's __init__ on the way: not an edge."""
    modules = frozenset({"kvshare.engine", "kvshare.engine.engine", "kvshare.engine.outputs"})
    imports = [Import("kvshare.engine", "kvshare.engine.engine", 1, ("LLMEngine",)),
               Import("kvshare.engine.engine", "kvshare.engine.outputs", 2, ("RequestOutput",))]
    graph = import_graph(imports, modules)
    assert graph["kvshare.engine.engine"] == {"kvshare.engine.outputs": 2} and import_cycles(graph) == []


def test_a_function_level_import_is_an_edge():
    found = {i.target for i in imports_of(ROOT / "backend" / "kvshare" / "engine" / "data_parallel.py")}
    assert "kvshare.engine.model_dtypes" in found, found       # imported inside build_engines


def test_relative_imports_resolve_to_their_package():
    found = {i.target for i in imports_of(ROOT / "backend" / "kvshare" / "engine" / "engine.py")}
    assert any(t.startswith("kvshare.core") for t in found), found


@pytest.mark.parametrize("model", sorted(p.parent.parent.name for p in (ROOT / "model_repository").glob("*/1/model.py")))
def test_model_repository_entry_points_import_only_the_adapter(model):
    tree = ast.parse((ROOT / "model_repository" / model / "1" / "model.py").read_text())
    targets = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    targets += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert targets and all(t.startswith("kvshare.triton_adapter") for t in targets), targets
