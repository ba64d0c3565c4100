"""What keeps the code's shape from growing back, checked on every run:

- the import graph keeps its layers: kernels <- models <- proposers <- engine <- loading <- writing
  <- api <- training and bench. Every import counts, also one inside a function, so a cycle cannot
  hide in a late import;
- no module of the packages or bench is over MAX_LINES lines, unless LONG_MODULES names it with the
  reason it stays whole;
- no module assigns to another module's or class's attribute, to another object's private one, or
  through another object's attribute (behaviour is chosen by config fields, never by patching);
- BENCHMARKS.md holds the current table per topic (history lives in git): at most MAX_BENCHMARKS_LINES.

Each check is shown failing on a planted violation."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "models", "proposers", "spec_jax", "bench")
# Longest matching prefix wins; a module may import its own layer and the ones below it.
LAYERS = {"pallas_kernels": 0, "models": 1, "proposers": 2, "spec_jax.engine": 3, "spec_jax.loading": 4,
          "spec_jax.writing": 5, "spec_jax.default_model": 6, "spec_jax.api": 7, "spec_jax": 8,
          "spec_jax.training": 8, "bench": 9}


MAX_LINES = 500
LONG_MODULES: dict[str, str] = {}  # module path -> the reason it stays whole past MAX_LINES
MAX_BENCHMARKS_LINES = 400
OWN = {"self", "cls"}  # an object may set its own attributes


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


def long_modules(limit: int = MAX_LINES) -> list[str]:
    """Package and bench modules over `limit` lines that LONG_MODULES does not name."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name, lines = path.relative_to(ROOT).as_posix(), len(path.read_text().splitlines())
            if lines > limit and name not in LONG_MODULES:
                found.append(f"{name}: {lines} lines")
    return found


def outside_assignments(source: str) -> list[str]:
    """Assignments (and del, setattr) in `source` to another module's or class's attribute (one
    it imports or a class it defines, set from outside the class), to another object's private
    attribute, or through another object's attribute (`llm.engine.plan = ...`), as "line: target"."""
    tree = ast.parse(source)
    imported, classes = set(), {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.update(a.asname or a.name for a in node.names)

    def outside(target) -> bool:
        attrs = []
        while isinstance(target, ast.Attribute):
            attrs.append(target.attr)
            target = target.value
        root = target.id if isinstance(target, ast.Name) else None
        private = attrs[0].startswith("_") and not attrs[0].endswith("__")
        return root not in OWN and (root in imported or root in classes or len(attrs) > 1 or private)

    found = []
    for node in ast.walk(tree):
        targets = {ast.Assign: lambda n: n.targets, ast.AugAssign: lambda n: [n.target],
                   ast.AnnAssign: lambda n: [n.target], ast.Delete: lambda n: n.targets}.get(type(node), lambda n: [])
        for target in targets(node):
            for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(t, ast.Attribute) and outside(t):
                    found.append((node.lineno, ast.unparse(t)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and isinstance(node.args[0], ast.Name)
                and node.args[0].id in imported | classes):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {what}" for line, what in sorted(found)]


def assignments_from_outside() -> list[str]:
    return [f"{path.relative_to(ROOT)}:{hit}" for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
            for hit in outside_assignments(path.read_text())]


def test_no_module_is_over_the_line_limit():
    assert not long_modules(), "split these, or name them in LONG_MODULES with a reason"


def test_the_allow_list_names_only_long_modules():
    short = [name for name in LONG_MODULES if len((ROOT / name).read_text().splitlines()) <= MAX_LINES]
    assert not short, f"{short} fit in {MAX_LINES} lines now: drop them from LONG_MODULES"


def test_no_module_patches_another():
    found = assignments_from_outside()
    assert not found, "\n".join(found)


def test_benchmarks_md_is_a_reference_not_a_log():
    lines = len((ROOT / "BENCHMARKS.md").read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_LINES, f"BENCHMARKS.md has {lines} lines: keep the current table per topic"


def test_the_checks_see_long_modules_and_patches():
    assert "spec_jax/engine/core.py" in " ".join(long_modules(limit=100))  # a real module over a lower limit
    planted = """
import models.qwen3_5
from models import qwen3_5
from models.qwen3_5 import DecoderLayer

class Engine:
    pass

def configure(llm, engine, out):
    models.qwen3_5.gdn_chunked = None
    qwen3_5.DecoderLayer.fuse_projections = lambda self: None
    DecoderLayer.fuse_projections += 1
    Engine.plan: int = 1
    setattr(qwen3_5, "CHUNK", 32)
    llm.engine.plan = None
    engine._compiled = None
    del engine._compiled
    out.index, self.ok, run.__name__ = 0, 1, "run"
"""
    assert [hit.split(": ")[1] for hit in outside_assignments(planted)] == [
        "models.qwen3_5.gdn_chunked", "qwen3_5.DecoderLayer.fuse_projections", "DecoderLayer.fuse_projections",
        "Engine.plan", "setattr(qwen3_5, 'CHUNK', 32)", "llm.engine.plan", "engine._compiled", "engine._compiled"]
