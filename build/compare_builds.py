#!/usr/bin/python3
"""Fails when the CMake and GN builds differ in what they build and test.

usage: compare_builds.py SOURCE_DIR CMAKE_BUILD_DIR GN_OUT_DIR

Compares, per source file, the defines, warning options and code-generation options of every
compilation (CMAKE_EXPORT_COMPILE_COMMANDS=ON and `gn gen --export-compile-commands`), and the
test executables each build runs (ctest's list and gn_tests.txt). Differences that are only
the build tools' own ways are not reported (see IGNORED, KNOWN and normalize()).
"""
import json
import os
import re
import shlex
import subprocess
import sys

# Flags that say what is built: defines, warnings, -f code generation, -std, -O.
MEANINGFUL = re.compile(r"^(-D|-W(?!l,|p,)|-f|-std=|-O)")
# Differences of the tools alone: position-independent code either way, CMake's NAME_EXPORTS
# and GoogleTest-target defines, and -fno-sanitize=all (the programs run under LD_PRELOAD are
# unsanitized in both builds: CMake says so per target, GN removes the sanitizer config).
IGNORED = re.compile(r"^(-fPIE|-fPIC|-D\w+_EXPORTS|-DGTEST_HAS_PTHREAD=1|-fno-sanitize=all)$")
# What one build has on purpose, per source: (source, flag) -> why.
KNOWN = {
    ("tests/tools/daemon_test.cc", "-DHD_CMAKE_COMMAND=<path>"): "tests `cmake --install`",
    ("tests/tools/daemon_test.cc", "-DHD_BUILD_DIR=<path>"): "tests `cmake --install`",
}


def normalize(flags, build_dir, source_dir):
    """The flags of one compilation as a set; a define naming a file keeps only its name, since
    the builds lay their outputs out differently; only the last -O counts."""
    result = set()
    optimization = None
    for a in flags:
        if not MEANINGFUL.match(a) or IGNORED.match(a):
            continue
        if a.startswith("-O"):
            optimization = a
            continue
        m = re.match(r"^-D(\w+)=(.*)$", a)
        if m and (build_dir in m.group(2) or source_dir in m.group(2) or
                  m.group(2).strip('"').startswith("/")):
            a = "-D%s=<path>" % m.group(1)
        result.add(a)
    if optimization:
        result.add(optimization)
    return result


def compilations(build_dir, source_dir):
    """{source: set of frozensets of flags} from build_dir/compile_commands.json."""
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        entries = json.load(f)
    result = {}
    for e in entries:
        path = os.path.realpath(os.path.join(e["directory"], e["file"]))
        if path.startswith(build_dir + os.sep):
            # Generated: named by its file name alone (each build has its own gen/ layout).
            name = "<generated>/" + os.path.basename(path)
        else:
            name = os.path.relpath(path, source_dir)
        args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
        flags = normalize(args, build_dir, source_dir)
        flags -= {f for (source, f) in KNOWN if source == name}
        result.setdefault(name, set()).add(frozenset(flags))
    return result


def cmake_tests(build_dir):
    """{(program, detached)} of the tests ctest runs."""
    out = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build_dir, check=True,
                         stdout=subprocess.PIPE, universal_newlines=True).stdout
    result = set()
    for t in json.loads(out)["tests"]:
        command = t.get("command") or []
        programs = [c for c in command if c.startswith(build_dir) or c.endswith(".py")]
        name = os.path.basename(programs[-1] if programs[-1].endswith(".py") else programs[0])
        result.add((name, t["name"].startswith("detached.")))
    return result


def gn_tests(out_dir):
    """{(program, detached)} of the tests build/run_gn_tests.sh runs."""
    result = set()
    with open(os.path.join(out_dir, "gn_tests.txt")) as f:
        for line in f:
            words = line.split()[1:]
            if not words:
                continue
            scripts = [w for w in words if w.endswith(".py")]
            programs = [w for w in words if w.startswith("./")]
            name = os.path.basename(scripts[0] if scripts else programs[0])
            result.add((name, "HD_TEST_COLLECTOR_MODE=detached" in words))
    return result


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    source_dir, cmake_dir, gn_dir = (os.path.realpath(p) for p in sys.argv[1:])
    problems = []
    c, g = compilations(cmake_dir, source_dir), compilations(gn_dir, source_dir)
    for name in sorted(set(c) - set(g)):
        problems.append("compiled by CMake only: " + name)
    for name in sorted(set(g) - set(c)):
        problems.append("compiled by GN only: " + name)
    for name in sorted(set(c) & set(g)):
        if c[name] != g[name]:
            only_c = set().union(*c[name]) - set().union(*g[name])
            only_g = set().union(*g[name]) - set().union(*c[name])
            problems.append("%s: CMake only %s, GN only %s" % (name, sorted(only_c) or "-",
                                                               sorted(only_g) or "-"))
    ct, gt = cmake_tests(cmake_dir), gn_tests(gn_dir)
    for name, detached in sorted(ct - gt):
        problems.append("tested by CMake only: %s%s" % (name, " (detached)" if detached else ""))
    for name, detached in sorted(gt - ct):
        problems.append("tested by GN only: %s%s" % (name, " (detached)" if detached else ""))
    for p in problems:
        print("compare_builds: " + p)
    if problems:
        sys.exit("compare_builds: the CMake and GN builds differ (%d differences)" % len(problems))
    print("compare_builds: CMake and GN build the same sources with the same flags, and run the "
          "same tests (%d sources, %d test programs)" % (len(c), len(ct)))


if __name__ == "__main__":
    main()
