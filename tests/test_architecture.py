"""Imports run one way: foundations <- kernels <- op <- plan (and the masks it derives for other sizes) <-
runner (a plan run on a model's calls, for every integration) <- pipelines <- calibration <- demo model and
demo <- CLI and benchmarks, and no modules import each other in a loop. A module may import its own layer or
lower ones, never a higher one (function-level imports included: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import paroattn

PACKAGE = Path(paroattn.__file__).parent

# lowest first; a module belongs to the longest prefix that names it
LAYERS = [
    ("paroattn.errors", "paroattn.layout", "paroattn.masks", "paroattn.modes", "paroattn.metrics", "paroattn.files"),
    ("paroattn.kernels",),
    ("paroattn.attention",),
    ("paroattn.plan",),
    ("paroattn.runner",),
    ("paroattn.pipelines", "paroattn.linear"),
    ("paroattn.calibrate",),
    ("paroattn.demo_model",),
    ("paroattn.app", "paroattn.__init__"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def layer_of(name: str) -> int | None:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    return None if best is None else best[0]


def imported_modules(source: str, name: str, is_package: bool = False):
    """(line, absolute module) of every import in `source` (module `name`), `from .x import y` giving
    x.y where y is a module and x otherwise."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                as_path = PACKAGE.parent.joinpath(*candidate.split("."))
                is_module = as_path.with_suffix(".py").is_file() or (as_path / "__init__.py").is_file()
                yield node.lineno, candidate if is_module else source


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in PACKAGE.rglob("*.py") if layer_of(module_name(p)) is None
                and module_name(p) != "paroattn"]
    assert not unplaced, f"modules outside LAYERS (place them): {unplaced}"


def test_no_module_imports_a_higher_layer():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        rank = layer_of(name if name != "paroattn" else "paroattn.__init__")
        if rank is None:
            continue  # reported by test_every_module_has_a_layer
        for line, target in imported_modules(path.read_text(), name, path.name == "__init__.py"):
            if not target.startswith("paroattn"):
                continue
            target_rank = layer_of(target) if target != "paroattn" else len(LAYERS) - 1
            if target_rank is not None and target_rank > rank:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({name}, layer {rank}) imports "
                                  f"{target} (layer {target_rank})")
    assert not violations, "imports that run upward:\n" + "\n".join(violations)


def test_the_checker_sees_an_upward_import():
    # the test above must be able to fail: a lazy import of the pipelines inside the plan is caught
    source = "from .masks import mask_shape\n\ndef f():\n    from .pipelines import apply\n"
    targets = [t for _, t in imported_modules(source, "paroattn.plan")]
    assert targets == ["paroattn.masks", "paroattn.pipelines"]
    assert layer_of(targets[0]) < layer_of("paroattn.plan") < layer_of(targets[1])


# what the layers above the op may use of the kernels: data structures and calibration's own statistics
# kernel; which attention kernel runs a call is the op's decision (`paroattn.attention.kernel_for`), never theirs,
# and the kernels' state (`kernels.runtime`) is the op's alone
KERNEL_MODULES_ABOVE_THE_OP = {"paroattn.kernels", "paroattn.kernels.block_lists", "paroattn.kernels.index_math",
                               "paroattn.kernels.dispatch.block_stats_backend"}


def test_processors_and_calibration_ask_the_op_not_the_kernels():
    reaching = []
    for folder in ("runner", "pipelines", "calibrate", "demo_model"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and "kernels" in node.module.split("."):
                    names = {f"paroattn.kernels.{node.module.split('kernels')[-1].strip('.')}".rstrip(".")}
                    names |= {f"{next(iter(names))}.{alias.name}" for alias in node.names}
                    if not names & KERNEL_MODULES_ABOVE_THE_OP:
                        reaching.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {sorted(names)}")
    assert not reaching, "modules above the op reaching into the kernels:\n" + "\n".join(reaching)


def import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (function-level imports included)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        targets = {target for _, target in imported_modules(path.read_text(), name, path.name == "__init__.py")}
        graph[name] = {t for t in targets if t.startswith("paroattn") and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_loop():
    assert not cycles(import_graph()), cycles(import_graph())


def test_the_loop_checker_sees_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
