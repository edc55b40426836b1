"""Module import cycles: a crate's modules, read from its source files, and the cycles
between sibling modules (`a` uses `b` and `b` uses `a`, directly or through other siblings).

A module depends on another when its code (comments, string literals and `#[cfg(test)]`
items left out) names a path into it: `use crate::x::..`, `use super::x::..`, an inline
`crate::x::f()`, or a name that a module re-exports (`pub use`) from it. Only dependencies
between siblings are kept, at the level where the two paths part: `crate::a::b` using
`crate::c::d` is an edge from `a` to `c` among the crate root's children, and a module using
its own ancestor or descendant is no edge. A cycle among siblings means a shared type or
function wants a module of its own that both can depend on.

Used by scripts/check-workspace.py; `python3 scripts/module_cycles.py CRATE_DIR...` prints
the cycles of the given crates."""
import os
import re
import tempfile

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
TEST_CFG = re.compile(r"#\[cfg\([^\]]*\btest\b[^\]]*\)\]")


SPECIAL = re.compile(r"//|/\*|(?<![A-Za-z0-9_])b?r#*\"|\"|'")
RAW = re.compile(r'b?r(#*)"')
CHAR = re.compile(r"'(\\.|\\u\{[0-9a-fA-F]+\}|[^\\'])'")
NOT_NL = re.compile(r"[^\n]")


def strip_code(text):
    """Comments, string and char literals blanked (newlines kept, so offsets still give
    line numbers)."""
    out, i, n = [], 0, len(text)
    while (m := SPECIAL.search(text, i)):
        out.append(text[i:m.start()])
        i, tok = m.start(), m.group()
        if tok == "//":
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif tok == "/*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j): depth += 1; j += 2
                elif text.startswith("*/", j): depth -= 1; j += 2
                else: j += 1
        elif tok.endswith('"') and tok != '"':
            r = RAW.match(text, i)
            end = '"' + r.group(1)
            j = text.find(end, r.end())
            j = n if j < 0 else j + len(end)
        elif tok == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            c = CHAR.match(text, i)
            j = c.end() if c else i + 1
            if not c:
                out.append("'"); i = j; continue
        out.append(NOT_NL.sub(" ", text[i:j]))
        i = j
    out.append(text[i:])
    return "".join(out)


def matching_brace(code, open_at):
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{": depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0: return j
    return len(code) - 1


def blank(code, a, b):
    return code[:a] + re.sub(r"[^\n]", " ", code[a:b]) + code[b:]


def drop_test_items(code):
    """Blanks every item under a cfg(test)-like attribute; returns the code and the names of
    `mod x;` declarations so marked (their files are test-only)."""
    test_mods = set()
    while (m := TEST_CFG.search(code)):
        j = m.end()
        while (a := re.compile(r"\s*#\[[^\]]*\]").match(code, j)):
            j = a.end()
        semi, brace = code.find(";", j), code.find("{", j)
        if (d := re.compile(r"\s*(pub(\([^)]*\))?\s+)?mod\s+(%s)\s*;" % IDENT).match(code, j)):
            test_mods.add(d.group(3)); end = d.end()
        elif brace >= 0 and (semi < 0 or brace < semi):
            end = matching_brace(code, brace) + 1
        else:
            end = semi + 1 if semi >= 0 else len(code)
        code = blank(code, m.start(), end)
    return code, test_mods


def parse_use_tree(body):
    """`a::b::{c, d::e as f, g::*}` -> [[a,b,c], [a,b,d,e], [a,b,g,*]]."""
    toks = re.findall(r"%s|::|\{|\}|,|\*" % IDENT, body)
    pos = 0

    def tree(prefix):
        nonlocal pos
        path = list(prefix)
        out = []
        while pos < len(toks):
            t = toks[pos]
            if t == "{":
                pos += 1
                while pos < len(toks) and toks[pos] != "}":
                    out += tree(path)
                    if pos < len(toks) and toks[pos] == ",": pos += 1
                pos += 1
                return out
            if t in (",", "}"):
                break
            if t == "::":
                pos += 1; continue
            if t == "as":
                pos += 2; continue
            path.append(t); pos += 1
        return out + ([path] if len(path) > len(prefix) else [])

    return tree([])


class Crate:
    def __init__(self, root_file):
        self.files = {}        # module path (tuple) -> file
        self.code = {}         # module path -> code (tests and comments removed)
        self.reexports = {}    # (module path, name) -> absolute path it names
        self.load(root_file, (), True)

    def load(self, path, mod, own_dir):
        text = open(path, encoding="utf-8").read()
        code, test_mods = drop_test_items(strip_code(text))
        base = os.path.dirname(path) if own_dir else os.path.splitext(path)[0]
        self.add(mod, path, code, base, test_mods)

    def add(self, mod, path, code, base, test_mods):
        # Inline (non-test) modules are modules of their own.
        while (m := re.compile(r"\b(pub(\([^)]*\))?\s+)?mod\s+(%s)\s*\{" % IDENT).search(code)):
            end = matching_brace(code, m.end() - 1)
            inner = code[m.end():end]
            self.add(mod + (m.group(3),), path, " " * m.end() + inner, os.path.join(base, m.group(3)), set())
            code = blank(code, m.start(), end + 1)
        self.files[mod], self.code[mod] = path, code
        for d in re.finditer(r"\bmod\s+(%s)\s*;" % IDENT, code):
            name = d.group(1)
            if name in test_mods: continue
            for cand, own in ((os.path.join(base, name + ".rs"), False), (os.path.join(base, name, "mod.rs"), True)):
                if os.path.isfile(cand):
                    self.load(cand, mod + (name,), own)
                    break

    def absolute(self, mod, segs):
        """A path as written in module `mod` -> absolute segments, or None (extern/local)."""
        if not segs: return None
        if segs[0] in ("crate", "$crate"): return segs[1:]
        if segs[0] == "self": return list(mod) + segs[1:]
        if segs[0] == "super":
            m = list(mod)
            while segs and segs[0] == "super":
                if not m: return None
                m.pop(); segs = segs[1:]
            return m + segs
        if tuple(mod) + (segs[0],) in self.files: return list(mod) + segs
        return None

    def collect_reexports(self):
        for mod, code in self.code.items():
            for u in re.finditer(r"\bpub(\([^)]*\))?\s+use\s+([^;]*);", code):
                for p in parse_use_tree(u.group(2)):
                    ab = self.absolute(mod, p)
                    if ab and p[-1] != "*":
                        alias = re.search(r"\b%s\s+as\s+(%s)" % (re.escape(p[-1]), IDENT), u.group(2))
                        self.reexports[(mod, alias.group(1) if alias else p[-1])] = ab

    def target_module(self, segs, depth=0):
        m = ()
        for i, s in enumerate(segs):
            if m + (s,) in self.files:
                m = m + (s,); continue
            hop = self.reexports.get((m, s))
            if hop and depth < 8 and hop != list(m) + [s]:
                return self.target_module(hop + segs[i + 1:], depth + 1)
            break
        return m

    def uses(self, mod):
        code = self.code[mod]
        found = []
        for u in re.finditer(r"\buse\s+([^;]*);", code):
            for p in parse_use_tree(u.group(1)):
                found.append((p, u.start()))
            code = blank(code, u.start(), u.end())
        for p in re.finditer(r"(?<![A-Za-z0-9_:])(\$?crate|super|self)((?:\s*::\s*%s)+)" % IDENT, code):
            found.append(([p.group(1)] + re.findall(IDENT, p.group(2)), p.start()))
        return found

    def sibling_edges(self):
        self.collect_reexports()
        edges = {}   # parent -> {(a, b): (file, line, written)}
        for mod in self.code:
            text = self.code[mod]
            for segs, at in self.uses(mod):
                ab = self.absolute(mod, segs)
                if ab is None: continue
                tgt = self.target_module(ab)
                k = 0
                while k < min(len(mod), len(tgt)) and mod[k] == tgt[k]: k += 1
                if k == len(mod) or k == len(tgt): continue   # same, ancestor or descendant
                parent, a, b = mod[:k], mod[k], tgt[k]
                line = text.count("\n", 0, at) + 1
                edges.setdefault(parent, {}).setdefault((a, b), (self.files[mod], line, "::".join(segs)))
        return edges


def find_cycle(nodes, adj):
    """One simple cycle inside a strongly connected set of nodes."""
    start = min(nodes)
    path, seen = [start], {start}
    def dfs(n):
        for m in sorted(adj.get(n, ())):
            if m not in nodes: continue
            if m == start and len(path) > 1: return True
            if m not in seen:
                seen.add(m); path.append(m)
                if dfs(m): return True
                path.pop()
        return False
    dfs(start)
    return path


def sccs(nodes, adj):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop(); on.discard(w); comp.add(w)
                if w == v: break
            out.append(comp)
    for v in sorted(nodes):
        if v not in index: visit(v)
    return out


def module_cycles(root, crate_dir):
    """One finding per cycle between sibling modules of each crate root under crate_dir/src."""
    findings = []
    src = os.path.join(crate_dir, "src")
    roots = [os.path.join(src, f) for f in ("lib.rs", "main.rs") if os.path.isfile(os.path.join(src, f))]
    bindir = os.path.join(src, "bin")
    if os.path.isdir(bindir):
        roots += sorted(os.path.join(bindir, f) for f in os.listdir(bindir) if f.endswith(".rs"))
    for r in roots:
        crate = Crate(r)
        for parent, edges in sorted(crate.sibling_edges().items()):
            adj = {}
            for a, b in edges: adj.setdefault(a, set()).add(b)
            nodes = set(adj) | {b for s in adj.values() for b in s}
            for comp in sccs(nodes, adj):
                if len(comp) < 2: continue
                cyc = find_cycle(comp, adj)
                where = "::".join(("crate",) + parent)
                steps = []
                for a, b in zip(cyc, cyc[1:] + cyc[:1]):
                    f, line, written = edges[(a, b)]
                    steps.append(f"{a} -> {b} ({os.path.relpath(f, root)}:{line} `{written}`)")
                among = "" if len(comp) == len(cyc) else f" (and {len(comp) - len(cyc)} more of {', '.join(sorted(comp - set(cyc)))})"
                findings.append(f"{os.path.relpath(r, root)}: module cycle in {where}{among}: " + "; ".join(steps))
    return findings


def self_test():
    """The check finds a planted cycle and nothing else: a cycle through `use` and an inline
    path, and next to it what must not count (a mention in a comment or a string, test-only
    code, a module using its parent)."""
    files = {
        "src/lib.rs": "pub mod a;\npub mod b;\npub mod c;\n",
        "src/a.rs": "use crate::b::B;\npub struct A;\n",
        "src/b.rs": "pub struct B;\npub fn f() -> usize { std::mem::size_of::<super::a::A>() }\n",
        "src/c.rs": (
            "// uses crate::a::A in a comment\n"
            "pub const S: &str = \"crate::a::A\";\n"
            "#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n"
        ),
    }
    with tempfile.TemporaryDirectory() as d:
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(d, path)), exist_ok=True)
            with open(os.path.join(d, path), "w") as f:
                f.write(text)
        found = module_cycles(d, d)
        assert len(found) == 1 and "a -> b" in found[0] and "b -> a" in found[0], found
        with open(os.path.join(d, "src/c.rs"), "a") as f:
            f.write("pub fn g() { crate::a::A; }\n")
        with open(os.path.join(d, "src/b.rs"), "w") as f:
            f.write("pub struct B;\n")
        assert module_cycles(d, d) == [], "a one-way dependency is no cycle"


if __name__ == "__main__":
    import sys

    self_test()
    root = os.getcwd()
    for crate_dir in sys.argv[1:]:
        for finding in module_cycles(root, os.path.abspath(crate_dir)):
            print(finding)
