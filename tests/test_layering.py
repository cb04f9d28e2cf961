"""The house rules: imports point down the tiers, nothing imports the benchmarks, no import cycles."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "pagedserve"

# Lowest first. A module may import its own tier and the tiers below it, never one above.
TIERS = [
    {"config", "corpus", "speculative_config", "sampling_params", "lora_request", "outputs"},
    {"model", "embedding"},
    {"engine", "distributed"},
    {"llm", "server"},
    {"cluster"},
    {"gateway"},
    {"bench", "generate", "quantize", "cli"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every pagedserve module this file imports, at the top or inside a function (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pagedserve")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedserve"):
            found.add(node.module)
    return found


def tier_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(TIERS) if top in names)


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py") if p != PKG / "__init__.py"}


def test_every_module_has_a_tier():
    for module in graph():
        tier_of(module)


def test_imports_point_down_the_tiers():
    wrong = [f"{m} -> {d}" for m, deps in graph().items() for d in deps
             if d != "pagedserve" and tier_of(d) > tier_of(m)]
    assert wrong == []


def test_nothing_outside_bench_imports_bench():
    wrong = [f"{m} -> {d}" for m, deps in graph().items() for d in deps
             if d.startswith("pagedserve.bench") and not m.startswith(("pagedserve.bench", "pagedserve.cli"))]
    assert wrong == []


def test_no_import_cycles():
    g = graph()
    # Depth-first search for a back edge; modules that import a package count as importing its __init__.
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d in g and d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_top_level_names_are_lazy():
    import subprocess
    import sys

    code = ("import sys, pagedserve; assert 'torch' not in sys.modules; "
            "from pagedserve import LLM, SamplingParams; "
            "from pagedserve.llm import LLM as L; assert LLM is L; print(SamplingParams(max_tokens=3).max_tokens)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"
