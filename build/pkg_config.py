#!/usr/bin/python3
"""Prints the pkg-config flags of the given packages as JSON for GN's exec_script().

usage: pkg_config.py PACKAGE...
Output: {"cflags": [...], "ldflags": [...], "libs": [...], "lib_dirs": [...]}

usage: pkg_config.py --libdir PACKAGE
Output: the package's library directory (for a static archive of its, named by the caller).
"""
import json
import shlex
import subprocess
import sys


def query(option, packages):
    try:
        out = subprocess.run(["pkg-config", option] + packages, check=True,
                             stdout=subprocess.PIPE, universal_newlines=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit("pkg_config.py: pkg-config %s %s failed: %s" % (option, " ".join(packages), e))
    return shlex.split(out)


def main():
    packages = sys.argv[1:]
    if packages[:1] == ["--libdir"] and len(packages) == 2:
        print(query("--variable=libdir", packages[1:])[0])
        return
    if not packages:
        sys.exit("usage: pkg_config.py PACKAGE...")
    result = {"cflags": query("--cflags", packages), "ldflags": [], "libs": [], "lib_dirs": []}
    for flag in query("--libs", packages):
        if flag.startswith("-l"):
            result["libs"].append(flag[2:])
        elif flag.startswith("-L"):
            result["lib_dirs"].append(flag[2:])
        else:
            result["ldflags"].append(flag)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
