"""Imports run downward: kernels <- layers <- models <- runner; the engine (host side) and the runner (device side)
meet only through the neutral step types; the CLI uses the public API alone (tests/test_public_api.py holds its
names). Read from the source with `ast`: every import counts, at module level, inside functions (imported when
used) and under TYPE_CHECKING alike, since each is a dependency someone must keep in mind."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"core": "nanovllm", "kernels": "nanovllm.kernels", "nanovllm_cli": "nanovllm_cli"}

# The layer of each part of the code: a module may import its own part and any part of a lower layer. The engine
# and the runner are one layer apart from each other: neither imports the other (the engine's composition root,
# llm_engine.py, is the one exception: it builds the runner).
LAYERS = {
    "nanovllm.kernels": 0, "nanovllm.quoting": 0,
    "nanovllm.distributed": 1, "nanovllm.kv_groups": 1,
    "nanovllm.attention": 2, "nanovllm.structured": 2,
    "nanovllm.layers": 3, "nanovllm.sampling_params": 3, "nanovllm.pooling_params": 3,
    "nanovllm.models": 4, "nanovllm.config": 4, "nanovllm.step_types": 4,
    "nanovllm.loaders": 5, "nanovllm.pooling": 5,
    "nanovllm.tokenization": 6, "nanovllm.lora": 6,
    "nanovllm.runner": 7, "nanovllm.engine": 7,
    "nanovllm": 8,  # the package itself: the public API
    "nanovllm_cli": 9,
    "nanovllm.__main__": 10,  # `python -m nanovllm`: runs the command line, imported by nothing
}
COMPOSITION_ROOTS = {("nanovllm.engine.llm_engine", "nanovllm.runner")}


def module_name(path: Path) -> str:
    for folder, package in PACKAGES.items():
        if path.is_relative_to(ROOT / folder):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            return ".".join([package] + (parts[:-1] if parts[-1] == "__init__" else parts))
    raise ValueError(path)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the nanovllm modules it imports (a `from X import name` of a submodule counts as X.name)."""
    modules = {}
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            modules[module_name(root / path.relative_to(root))] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                candidates = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                continue
            for candidate in candidates:
                if candidate in modules:
                    targets.add(candidate)
                    break  # the submodule when `from package import submodule`, else the module itself
        graph[name] = targets - {name}
    return graph


def part_of(module: str) -> str:
    """The most specific entry of LAYERS that `module` belongs to ("nanovllm" alone is the package's __init__)."""
    parts = module.split(".")
    for end in range(len(parts), 1 if parts[0] == "nanovllm" and len(parts) > 1 else 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return prefix
    raise KeyError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layering.py")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        part = part_of(module)
        for target in targets:
            target_part = part_of(target)
            if target_part == part or LAYERS[target_part] < LAYERS[part]:
                continue
            if any(module == root and target_part == goes_to for root, goes_to in COMPOSITION_ROOTS):
                continue
            wrong.append(f"{module} ({part}, layer {LAYERS[part]}) imports {target} "
                         f"({target_part}, layer {LAYERS[target_part]})")
    return sorted(wrong)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_module_belongs_to_a_layer():
    for module in import_graph():
        part_of(module)


def test_imports_run_downward():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    graph = {"nanovllm.kernels.a": {"nanovllm.layers.b"}, "nanovllm.layers.b": {"nanovllm.kernels.a"},
             "nanovllm.engine.scheduler": {"nanovllm.runner.model_runner"}, "nanovllm.runner.model_runner": set(),
             "nanovllm.engine.llm_engine": {"nanovllm.runner.model_runner"}}
    assert upward_imports(graph) == [
        "nanovllm.engine.scheduler (nanovllm.engine, layer 7) imports nanovllm.runner.model_runner "
        "(nanovllm.runner, layer 7)",
        "nanovllm.kernels.a (nanovllm.kernels, layer 0) imports nanovllm.layers.b (nanovllm.layers, layer 3)"]
    assert import_cycles(graph) == [["nanovllm.kernels.a", "nanovllm.layers.b"]]
