"""The library's import graph: no circles, no private names imported across modules, no Ray in rlpad/."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("rlpad", "workers")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: pathlib.Path, top_level_only: bool) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import; only module-level statements if ``top_level_only``."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def test_no_import_circle():
    """Function-level (lazy) imports count too: a lazy import hides a circle, it does not end it."""
    mods = modules()
    graph = {m: {dep for dep, _ in imports(p, False) if dep in mods and dep != m} for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(dep):] + [m, dep]))
            if dep not in state:
                visit(dep, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_private_names_imported_across_modules():
    mods = modules()
    bad = [f"{m} imports {dep}.{name}" for m, p in mods.items() for dep, names in imports(p, False)
           if dep in mods for name in names if name.startswith("_")]
    assert not bad, bad


def test_library_never_imports_ray():
    bad = [m for m, p in modules().items() if m.startswith("rlpad")
           for dep, _ in imports(p, False) if dep == "ray" or dep.startswith("ray.")]
    assert not bad, bad


# The scoring core's layer: rlpad/core and the one module below it, the config schema. Every other
# module of rlpad/ and workers/ is ABOVE the core: the embedded demo (which registers its tiny:<arch>
# model source with rlpad.core.models), the rollout backends, RL math, data, trainer, entry points,
# benchmarks and the Ray workers all build on it, so none of them may be imported by it.
CORE = "rlpad.core"
BELOW_CORE = ("rlpad.config",)


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _deps(path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """Project modules ``path`` imports, lazily too; ``from pkg import sub`` counts as pkg.sub."""
    out = set()
    for module, names in imports(path, False):
        out |= {f"{module}.{n}" for n in names if f"{module}.{n}" in mods}
        if module in mods:
            out.add(module)
    return out


def test_core_imports_nothing_above_it():
    """rlpad/core reaches (through every import, lazy ones too) only itself and BELOW_CORE."""
    mods = modules()
    above = {m for m in mods if not _in(m, (CORE, *BELOW_CORE))}
    assert {"rlpad.rollout", "rlpad.rollout.layout", "rlpad.training.trainer", "rlpad.train", "workers.actor",
            "rlpad.embedded.tiny", "rlpad.embedded.shapes"} <= above
    assert not any(_in(m, BELOW_CORE) for m in above)
    reached: dict[str, str] = {}  # module -> the core module it was reached from
    todo = [(m, m) for m in mods if _in(m, (CORE,))]
    while todo:
        module, origin = todo.pop()
        for dep in _deps(mods[module], mods):
            if dep not in reached:
                reached[dep] = origin
                todo.append((dep, origin))
    bad = sorted(f"{reached[m]} -> ... -> {m}" for m in reached if m in above)
    assert not bad, bad


def test_core_never_imports_the_embedded_demo():
    """No module of rlpad/core names rlpad/embedded in any import (lazy ones too): the embedded side
    registers its model source (rlpad.core.models.register_model_source)."""
    mods = modules()
    bad = sorted(f"{m} imports {dep}" for m, p in mods.items() if _in(m, (CORE,))
                 for dep in _deps(p, mods) if _in(dep, ("rlpad.embedded",)))
    assert not bad, bad


# Within rlpad/, the modules that may import workers/: the entry points and the benchmarks' room.
IMPORTS_WORKERS = ("rlpad.train", "rlpad.cli", "rlpad.bench")


def test_only_entry_points_and_benchmarks_import_workers():
    mods = modules()
    assert {"rlpad.bench.worker_group", "rlpad.bench.sync"} <= set(mods)  # the Ray-side benchmarks live there
    bad = sorted(f"{m} imports {dep}" for m, p in mods.items() if _in(m, ("rlpad",)) and not _in(m, IMPORTS_WORKERS)
                 for dep in _deps(p, mods) if _in(dep, ("workers",)))
    assert not bad, bad


def test_no_benchmark_in_the_worker_package():
    names = sorted(p.stem for p in (ROOT / "workers").rglob("*.py"))
    bad = [n for n in names if n.startswith("bench") or n.endswith("_bench")]
    assert not bad, f"benchmarks belong in rlpad/bench: {bad}"


def test_config_package_is_the_ground_floor():
    """rlpad/config (the schema and its generated reference) imports nothing else of rlpad."""
    mods = modules()
    bad = sorted(f"{m} imports {dep}" for m, p in mods.items() if _in(m, ("rlpad.config",))
                 for dep in _deps(p, mods) if not _in(dep, ("rlpad.config",)))
    assert not bad, bad


def test_package_inits_hold_only_a_docstring():
    """Each package of rlpad/ says in its __init__.py what it owns; rlpad.rollout's BACKENDS registry is
    public API; rlpad holds __version__ (no re-exports of moved modules)."""
    public_api = {"rlpad", "rlpad.rollout"}  # __version__; the backend registry
    bad = []
    for init in sorted((ROOT / "rlpad").rglob("__init__.py")):
        module = ".".join(init.relative_to(ROOT).parent.parts)
        tree = ast.parse(init.read_text())
        if not ast.get_docstring(tree):
            bad.append(f"{module}: no docstring")
        if module not in public_api and len(tree.body) > 1:
            bad.append(f"{module}: holds code beside its docstring")
    assert not bad, bad
