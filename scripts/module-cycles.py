#!/usr/bin/env python3
"""Module import cycles inside each crate of the workspace.

Builds each crate's module graph from the paths its source files name (`use crate::a::b`,
`use super::c`, `crate::a::f()` in code, brace groups expanded), with test modules
(`#[cfg(test)] mod …` to the end of a file) left out. An edge between two modules counts at
the level where their paths part: `a::x` using `b::y` is the edge `a -> b` among the children
of the crate root, and a child using its own ancestors is no edge (a parent declares its
children, so that direction is already there). A cycle is a strongly connected set of
sibling modules; each is printed with one path that closes it.

Usage: module-cycles.py [workspace root]. Exits 1 when a crate has a cycle."""
import os
import re
import sys
import tomllib

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
members = tomllib.load(open(os.path.join(root, "Cargo.toml"), "rb"))["workspace"]["members"]


def module_of(src, path):
    rel = os.path.relpath(path, src)[: -len(".rs")].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel in (["lib"], ["main"]):
        return ()
    if rel[0] == "bin":
        return None  # binaries are their own crates
    return tuple(rel)


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
    return text[: m.start()] if m else text


def expand(tail):
    """`a::{b, c::d}` -> ['a::b', 'a::c::d'] (tail is what follows `crate::`)."""
    m = re.match(r"((?:\w+::)*)\{", tail)
    if not m:
        p = re.match(r"\w+(::\w+)*", tail)
        return [p.group(0)] if p else []
    prefix, depth, i = m.group(1), 1, m.end()
    start, parts = i, []
    while i < len(tail) and depth:
        c = tail[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if (c == "," and depth == 1) or depth == 0:
            parts.append(tail[start:i].strip())
            start = i + 1
        i += 1
    out = []
    for part in parts:
        if part and part != "self":
            out += [prefix + e for e in expand(part)]
        elif part == "self":
            out.append(prefix.rstrip(":"))
    return out


def targets(module, text):
    for m in re.finditer(r"\b(crate|super)::", text):
        tail = text[m.end():]
        for p in expand(tail):
            segs = [s for s in p.split("::") if s]
            if m.group(1) == "crate":
                yield tuple(segs)
            else:
                base = list(module[:-1])
                while segs and segs[0] == "super":
                    base, segs = base[:-1], segs[1:]
                yield tuple(base + segs)


def cycles(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def closing_path(graph, comp):
    """One cycle through the component's first node, for the report."""
    start, members = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


found = 0
for member in members:
    src = os.path.join(root, member, "src")
    modules, edges = {}, {}
    for folder, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                path = os.path.join(folder, f)
                mod = module_of(src, path)
                if mod is not None:
                    modules[mod] = strip(open(path, encoding="utf-8").read())
    known = set(modules)
    for mod, text in modules.items():
        for target in targets(mod, text):
            # The longest prefix of the path that is a module of this crate.
            while target and target not in known:
                target = target[:-1]
            k = 0
            while k < min(len(mod), len(target)) and mod[k] == target[k]:
                k += 1
            if k == len(mod) or k == len(target):
                continue  # a module and its own ancestor or descendant
            parent = mod[:k]
            edges.setdefault(parent, {}).setdefault(mod[k], set()).add(target[k])
    for parent, graph in sorted(edges.items()):
        for comp in cycles(graph):
            found += 1
            where = "::".join(("crate",) + parent)
            print(f"{member}: {where}: {{{', '.join(comp)}}}, e.g. " + " -> ".join(closing_path(graph, comp)))
if found:
    sys.exit(1)
print("module cycles: none")
