"""The import graph keeps its layers: kernels <- models <- proposers <- engine <- loading <- writing
<- api <- training and bench. Every import counts, also one inside a function, so a cycle cannot
hide in a late import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "models", "proposers", "spec_jax", "bench")
# Longest matching prefix wins; a module may import its own layer and the ones below it.
LAYERS = {"pallas_kernels": 0, "models": 1, "proposers": 2, "spec_jax.engine": 3, "spec_jax.loading": 4,
          "spec_jax.writing": 5, "spec_jax.default_model": 6, "spec_jax.api": 7, "spec_jax": 8,
          "spec_jax.training": 8, "bench": 9}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def known_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from a.b import c` counts a.b.c when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            found.update(subs or ({node.module} & modules.keys()))
    return found


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def graph() -> dict[str, set[str]]:
    modules = known_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
                  for m, deps in g.items() for d in deps if layer(d) > layer(m))


def find_cycles(g: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Each cycle as the sorted tuple of its modules. A package's __init__ gathering its own
    submodules is not a cycle: parent -> child edges are dropped."""
    edges = {m: {d for d in deps if d in g and not d.startswith(m + ".")} for m, deps in g.items()}
    cycles, state = set(), {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(edges[m]):
            if state.get(d) == "open":
                cycles.add(tuple(sorted(stack[stack.index(d):])))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_runs_up_the_layers():
    upward = upward_imports(graph())
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles = find_cycles(graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in sorted(cycles))


def test_the_checks_see_an_upward_import_and_a_cycle():
    fake = {"models.qwen3_5": {"pallas_kernels.gdn_recurrent"}, "pallas_kernels.gdn_recurrent": {"models.qwen3_5"},
            "spec_jax.api.llm": {"models.qwen3_5"}}
    assert upward_imports(fake) == ["pallas_kernels.gdn_recurrent (layer 0) imports models.qwen3_5 (layer 1)"]
    assert find_cycles(fake) == {("models.qwen3_5", "pallas_kernels.gdn_recurrent")}
    assert "spec_jax.engine.core" in graph()["spec_jax.api.llm"]  # the real graph's imports are seen
