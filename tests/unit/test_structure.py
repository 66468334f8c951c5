"""The package's shape: no import cycle among hf_longctx modules, every import points down the layers
(`LAYERS`), no module over 400 lines, no loose top-level modules beyond the public entry points, and
`import hf_longctx` pulls no torch.

Imports are read from the source (ast), all of them: module level, inside functions and under
`TYPE_CHECKING`; importing `a.b.c` also imports its parent packages `a.b` and `a`, so those count too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hf_longctx

PACKAGE = Path(hf_longctx.__file__).parent
MAX_LINES = 400
# Public entry points and internals.
TOP_LEVEL = {"__init__", "_compat", "_lazy", "_patching", "config", "loss", "trainer"}

# The layers, lowest first. A module may import its own layer and the layers below it, never one above:
# a lower layer that needs something from a higher one means the shared piece belongs lower down.
# Every module must fall in one of them (longest matching prefix), so a new package is placed on purpose.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hf_longctx._compat", "hf_longctx._lazy", "hf_longctx._patching"),  # version gates, lazy exports, Patch
    ("hf_longctx.instrument",),  # counters and timers the collectives report to
    ("hf_longctx.distributed",),  # process groups, collectives, the layout slot a group carries
    ("hf_longctx.data",),  # sharding, token layouts, collator, cross-rank input checks
    ("hf_longctx.multimodal",),  # the vision side of VLMs, on the data layer's shards
    ("hf_longctx.sequence",),  # what a model computes over the whole sequence outside attention
    ("hf_longctx.attention",),  # SP attention and its registration
    ("hf_longctx.memory", "hf_longctx.loss"),  # memory flags and the SP loss, on top of attention
    ("hf_longctx.planner", "hf_longctx.check", "hf_longctx.integrations"),  # users of the model layers
    ("hf_longctx.config",),  # ParallelismConfig attaches the integrations
    ("hf_longctx.trainer", "hf_longctx.cli"),  # entry points
    ("hf_longctx",),  # the package's lazy public names
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["hf_longctx", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the hf_longctx modules it imports (resolved to modules, parents included)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets |= {f"{base}.{alias.name}" for alias in node.names}
        resolved = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the module and every parent package it implies
                prefix = ".".join(parts[:i])
                if prefix in modules:
                    resolved.add(prefix)
        graph[name] = resolved - {name} - _parents(name)
    return graph


def _parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer_of(module: str) -> int:
    """Index in `LAYERS` of the longest prefix of `module` (a package or a module) listed there."""
    best, depth = -1, -1
    for index, members in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and member.count(".") > depth:
                best, depth = index, member.count(".")
    if best < 0:
        raise AssertionError(f"{module} is in no layer of LAYERS; add its package there, in order")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every `importer -> imported` edge whose target sits in a higher layer than its source."""
    return [
        f"{source} (layer {layer_of(source)}) -> {target} (layer {layer_of(target)})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(source)
    ]


def test_no_import_cycle_among_modules():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()))}"


def test_cycle_finder_sees_a_cycle_through_a_function_level_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_import_points_down_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a lower layer to a higher one (move the shared piece down):\n" + "\n".join(upward)


def test_layer_check_sees_an_upward_import():
    assert upward_imports({"hf_longctx.distributed.groups": {"hf_longctx.data.layout"}}) == [
        "hf_longctx.distributed.groups (layer 2) -> hf_longctx.data.layout (layer 3)"
    ]
    assert upward_imports({"hf_longctx.data.layout": {"hf_longctx.distributed.layout_slot"}}) == []
    assert layer_of("hf_longctx.config") > layer_of("hf_longctx.integrations.trainer.state")


def test_no_module_over_400_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_loose_top_level_modules():
    loose = {p.stem for p in PACKAGE.glob("*.py")} - TOP_LEVEL
    assert not loose, f"top-level modules outside a package: {sorted(loose)}; put them in the package of their concept"


def test_public_names_resolve():
    for name in hf_longctx.__all__:
        assert getattr(hf_longctx, name) is not None, name


def test_import_hf_longctx_pulls_no_torch():
    heavy = "('torch', 'transformers', 'accelerate')"
    code = f"import sys, hf_longctx; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
