#!/usr/bin/env python3
"""Workspace hygiene checks that `./dev test` runs before it builds anything.

1. Unused dependencies. A crate's dependency is used when its name (dashes as underscores)
   appears as a path (`name::` that does not follow another segment, as in
   `metronome_runtime::redis::`; `use name`; `extern crate name`) in the crate's src/,
   tests/, benches/, examples/ or build.rs. Grep-based, as cargo-machete is: a name
   mentioned only in a comment counts as used, so it can miss an unused dependency but never
   flags a used one.
   A `[workspace.dependencies]` entry no crate declares is unused too.
2. Test modules. A crate with `autotests = false` builds its integration tests as one binary
   from tests/main.rs; a tests/*.rs file that main.rs does not declare as a module would never
   be compiled or run, so it fails the check.
3. Module import cycles. Within each crate (library, binary), sibling modules that depend on
   each other, directly or round a longer loop, fail the check (scripts/module_cycles.py:
   what counts as a dependency, and a self-test run first).

Exits 1 with one line per finding; prints one summary line when everything is in order."""
import os
import re
import sys
import tomllib

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts
from module_cycles import module_cycles, self_test

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
workspace = tomllib.load(open(os.path.join(root, "Cargo.toml"), "rb"))["workspace"]
TABLES = ("dependencies", "dev-dependencies", "build-dependencies")


def sources(crate_dir):
    texts = []
    for sub in ("src", "tests", "benches", "examples"):
        for folder, _, files in os.walk(os.path.join(crate_dir, sub)):
            for f in files:
                if f.endswith(".rs"):
                    texts.append(open(os.path.join(folder, f), encoding="utf-8", errors="replace").read())
    build = os.path.join(crate_dir, "build.rs")
    if os.path.isfile(build):
        texts.append(open(build, encoding="utf-8").read())
    return "\n".join(texts)


self_test()
failures = []
declared_anywhere = set()
for member in workspace["members"]:
    crate_dir = os.path.join(root, member)
    manifest = tomllib.load(open(os.path.join(crate_dir, "Cargo.toml"), "rb"))
    code = sources(crate_dir)
    for table in TABLES:
        for name in manifest.get(table, {}):
            declared_anywhere.add(name)
            ident = re.escape(name.replace("-", "_"))
            if not re.search(r"(?<!\w::)\b%s\s*::|\buse\s+%s\b|\bextern\s+crate\s+%s\b" % (ident, ident, ident), code):
                failures.append(f"{member}/Cargo.toml: [{table}] {name} is declared but never used")

    if manifest["package"].get("autotests") is False:
        tests_dir = os.path.join(crate_dir, "tests")
        main = os.path.join(tests_dir, "main.rs")
        modules = set(re.findall(r"^\s*mod\s+(\w+)\s*;", open(main).read(), re.M)) if os.path.isfile(main) else set()
        for f in sorted(os.listdir(tests_dir)):
            if f.endswith(".rs") and f != "main.rs" and f[:-3] not in modules:
                failures.append(f"{member}/tests/{f}: not declared in tests/main.rs (add `mod {f[:-3]};`), so it never runs")

    failures += module_cycles(root, crate_dir)

for name in workspace.get("dependencies", {}):
    if name not in declared_anywhere:
        failures.append(f"Cargo.toml: [workspace.dependencies] {name} is pinned but no crate uses it")

if failures:
    print("\n".join(failures))
    print(f"{len(failures)} workspace check(s) failed")
    sys.exit(1)
print(f"workspace checks: no unused dependencies, every test file declared, no module cycles ({len(workspace['members'])} crates)")
