"""Check megatron_lora's layering: lower layers never import upper ones, and no import cycles.

    python tools/check_layering.py        # exit 1 and one line per violation, or "layering ok"

Every import counts, also those inside functions (they are dependencies all the same). The
order, lowest first (a package may import its own modules and those of lower layers):

    runtime -> (top-level modules: jsonfile) -> families -> lora -> models -> convert -> data
        -> export -> training -> inference -> testing -> cli

`runtime` is the only code that knows CUDA and megatron-core versions; `families` is data; the
adapters (`lora`) never know which model holds them.
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Set

LAYERS = ("runtime", "", "families", "lora", "models", "convert", "data", "export", "training",
          "inference", "testing", "cli")
PACKAGE = "megatron_lora"


def modules(root: str) -> Dict[str, str]:
    """{module name: file} of every module under root/megatron_lora."""
    out = {}
    base = os.path.join(root, PACKAGE)
    for directory, _, files in os.walk(base):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[mod[: -len(".__init__")] if mod.endswith(".__init__") else mod] = path
    return out


def imports(path: str, known: Set[str]) -> Set[str]:
    """The megatron_lora modules `path` imports (a `from pkg import name` of a submodule counts
    as that submodule)."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == PACKAGE:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found |= subs or {node.module}
    return found


def layer(module: str) -> str:
    """The layer of a module: its package, "" for top-level modules, `cli` for __main__."""
    parts = module.split(".")
    if parts[1:] == ["__main__"]:
        return "cli"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    problems = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            a, b = layer(mod), layer(dep)
            if a not in rank or b not in rank:
                problems.append(f"{mod} -> {dep}: package not in the layer list {LAYERS}")
            elif rank[b] > rank[a]:
                problems.append(f"{mod} imports {dep}: layer '{a}' is below '{b}'")
    return problems


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on:
                low[node] = min(low[node], index[child])
    return out


def problems(root: str) -> List[str]:
    mods = modules(root)
    graph = {m: {d for d in imports(p, set(mods)) if d != m} for m, p in mods.items()}
    out = upward_imports(graph)
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # also via a link
    if not modules(root):
        print(f"no {PACKAGE} package under {root}")
        return 1
    found = problems(root)
    for line in found:
        print(line)
    print(f"layering ok ({len(modules(root))} modules)" if not found
          else f"{len(found)} layering problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
