"""The C core's files call each other one way only: no file calls back into a file that
calls it (directly or through others). Checked on the compiled objects with `nm`: file
A depends on file B when A references a global symbol that B defines."""

from __future__ import annotations

import collections
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The core's objects, and the kernel sources' (built once per ISA level: their scalar build's
# objects stand for every level; kernel_levels.c calls them by their suffixed names).
# The folders: the core, the kernels (shared by the core and the module) and the module.
FOLDERS = ("powerinfer_c", "powerinfer_kernels", "powerinfer_accel")
OBJ_GLOBS = [os.path.join(ROOT, "build", "CMakeFiles", d, "src", f, "*.c.o")
             for d in ("powerinfer.dir", "pi-kernels-scalar.dir") for f in FOLDERS]
FOLDER_OF = {os.path.basename(p)[:-2]: f for f in FOLDERS for p in glob.glob(os.path.join(ROOT, "src", f, "*.c"))}
# accel_missing.c stands in for accel.c in builds without ggml's backend interface, and module.c is
# libggml-powerinfer.so's entry point (it calls the module through libpowerinfer)
SOURCES = sorted(s for s in FOLDER_OF if s not in ("accel_missing", "module"))  # module.c: the loadable shim, its own library


def _symbols(obj: str):
    out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDBR":
            defined.add(parts[2])
        elif len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
    return defined, undefined


def file_graph():
    """{file: set of files it calls}, from the objects of the current build."""
    objs = {os.path.basename(p)[: -len(".c.o")]: p for g in OBJ_GLOBS for p in glob.glob(g)}
    missing = [s for s in SOURCES if s not in objs]
    assert not missing, f"no object files for {missing} under {[os.path.dirname(g) for g in OBJ_GLOBS]}: build with ./scripts/setup.sh"
    syms = {name: _symbols(p) for name, p in objs.items() if name in SOURCES}
    owner = {s: name for name, (defined, _) in syms.items() for s in defined}
    graph = collections.defaultdict(set)
    for name, (_, undefined) in syms.items():
        graph[name] |= {owner[s] for s in undefined if s in owner and owner[s] != name}
    return graph


def find_cycle(graph):
    """A list of files forming a cycle, or None."""
    state = {}
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_c_files_call_one_way():
    graph = file_graph()
    cycle = find_cycle(graph)
    edges = "\n".join(f"  {a} -> {', '.join(sorted(b))}" for a, b in sorted(graph.items()))
    assert cycle is None, f"C files call each other in a circle: {' -> '.join(cycle)}\nall calls:\n{edges}"


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_kernels_call_nothing_of_the_core_or_the_module():
    """The kernels are a layer of their own: the core and the module call them, they call
    neither (but the core's log and error functions, error.c)."""
    graph = file_graph()
    bad = {a: sorted(b for b in callees if FOLDER_OF[b] != "powerinfer_kernels" and b != "error")
           for a, callees in graph.items() if FOLDER_OF[a] == "powerinfer_kernels"}
    assert not any(bad.values()), bad
    assert any(FOLDER_OF[b] == "powerinfer_kernels" for b in graph["accel"]), "the module runs the kernels"
