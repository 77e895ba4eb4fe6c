"""The shape of the package (docs/development.md, "The shape of the code"): imports flow one way between its parts,
and no module grows past 500 lines. Read from the source, no import: a lazy import inside a function counts too."""

import ast
import os
from collections import defaultdict

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "orb")
MAX_LINES = 500


def modules() -> dict:
    """Each module of ``orb`` by dotted name: its path."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def part(dotted: str) -> str:
    """The part of the package a module belongs to: ``orb.data`` for ``orb.data.graphs``, ``orb.cache`` for itself."""
    return ".".join(dotted.split(".")[:2])


def imports_between_parts() -> dict:
    """{(importing part, imported part): ["module:line", ...]} over every import of the package's own modules."""
    edges = defaultdict(list)
    for dotted, path in modules().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "orb" \
                    and not node.level:
                targets = [f"orb.{a.name}" for a in node.names] if node.module == "orb" else [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "orb"]
            else:
                continue
            for target in targets:
                if part(target) != part(dotted) and part(target) != "orb":
                    edges[(part(dotted), part(target))].append(f"{dotted}:{node.lineno}")
    return edges


def cycle_through(start: str, edges: dict):
    """A path of imports from ``start`` back to itself, or None."""
    following = defaultdict(list)
    for a, b in edges:
        following[a].append(b)
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in following[node]:
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_imports_between_the_packages_parts_flow_one_way():
    edges = imports_between_parts()
    assert ("orb.io", "orb.models") in edges and ("orb.models", "orb.data") in edges  # (the reader sees imports)
    for start in sorted({a for a, _ in edges}):
        loop = cycle_through(start, edges)
        assert loop is None, " -> ".join(loop) + ": " + "; ".join(
            f"{a} -> {b} at {edges[(a, b)][0]}" for a, b in zip(loop, loop[1:]))


def test_the_reader_finds_a_loop_made_by_a_lazy_import():
    edges = imports_between_parts()
    edges[("orb.files", "orb.models")] = ["a lazy import inside a function"]
    assert cycle_through("orb.models", edges) is not None  # models -> cache -> files -> models


def test_no_module_is_longer_than_500_lines():
    long = {}
    for dotted, path in modules().items():
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            long[dotted] = lines
    assert not long, f"split these modules (more than {MAX_LINES} lines): {long}"


def test_every_test_file_has_its_place_in_the_suites_order():
    """A file missing from ``conftest.LONGEST_FIRST`` runs after every other, on one worker while the other idles
    (tests/test_edge_input.py did: 81 s with a core idle at the end of a full run, 2026-12-03)."""
    from conftest import LONGEST_FIRST

    files = {name[:-3] for name in os.listdir(os.path.join(ROOT, "tests"))
             if name.startswith("test_") and name.endswith(".py")}
    assert sorted(files - set(LONGEST_FIRST)) == []
    assert len(LONGEST_FIRST) == len(set(LONGEST_FIRST))
