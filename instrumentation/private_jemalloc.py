#!/usr/bin/python3
"""Makes jemalloc's static PIC archive (Debian's libjemalloc_pic.a) linkable into libheapdump.so
without any of it reaching the profiled program's lookup scope.

    private_jemalloc.py ARCHIVE OUT_ARCHIVE

Every symbol the archive defines with default visibility (malloc, mallocx, operator new, mallctl,
malloc_conf, ...) is renamed hd_je_NAME: the library's own malloc and its exported *allocx are
then the only ones of those names, and the version script keeps the renamed ones local. The
archive's imports from beyond libc (libm's log, exp and round, libgcc's _Unwind_Backtrace and
_Unwind_GetIP: only jemalloc's own heap profiling calls them) are renamed hd_je_NAME too and
served by instrumentation/src/jemalloc_imports.c, so that no library is loaded because of us.
Its imports of mmap and munmap are renamed too, to the functions of instrumentation/src/backend.c
that record what jemalloc maps (a leak check must know the allocator's memory exactly), and of
sbrk, to one that fails (jemalloc then leaves the program break to the program). Anything else
the archive imports stays libc's.

jemalloc's constructor (its one .init_array entry: the build fails if there are others) is taken
out: it sets jemalloc up at load, which a process that never allocates from it pays for nothing
(a dormant process, or one on the system allocator: about 0.3 ms and 0.4 MiB at each start).
jemalloc sets itself up at its first call instead, which for a process that records on it is
the library's own initialisation (backend.c, hd_backend_init).

The rename list is computed from the archive at build time (readelf), so a newer jemalloc with
another set of public names is handled alike; the output is checked afterwards: a default-
visibility definition left without the prefix fails the build.
"""

import subprocess
import sys
import tempfile

PREFIX = "hd_je_"
PRIVATE_IMPORTS = {"log", "exp", "round", "_Unwind_Backtrace", "_Unwind_GetIP", "mmap", "munmap",
                   "sbrk"}


def symbols(archive):
    """(name, defined, visibility) of every global or weak symbol in the archive's members."""
    out = subprocess.run(["readelf", "-sW", archive], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        f = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(f) < 8 or not f[0].endswith(":") or f[4] not in ("GLOBAL", "WEAK"):
            continue
        yield f[7], f[6] != "UND", f[5]


def constructors(archive):
    """(member, size) of every .init_array section in the archive's members."""
    out = subprocess.run(["readelf", "-SW", archive], check=True, capture_output=True,
                         text=True).stdout
    member = None
    for line in out.splitlines():
        if line.startswith("File: "):
            member = line[len("File: "):]
        f = line.replace("[ ", "[").split()
        if len(f) > 5 and f[1] in (".init_array", ".ctors"):
            yield member, int(f[5], 16)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    archive, out_archive = sys.argv[1:]
    renames = set()
    for name, defined, visibility in symbols(archive):
        if defined and visibility == "DEFAULT":
            renames.add(name)
        elif not defined and name in PRIVATE_IMPORTS:
            renames.add(name)
    if "mallocx" not in renames or "malloc" not in renames:
        sys.exit(f"{archive}: not jemalloc's archive (no public mallocx and malloc)")
    found = list(constructors(archive))
    if len(found) != 1 or found[0][1] != 8:
        sys.exit(f"{archive}: expected jemalloc's one constructor (one 8-byte .init_array), "
                 f"found {found}: see what the others set up before taking them out")
    with tempfile.NamedTemporaryFile("w", suffix=".syms") as syms:
        syms.writelines(f"{name} {PREFIX}{name}\n" for name in sorted(renames))
        syms.flush()
        subprocess.run(["objcopy", f"--redefine-syms={syms.name}", "--remove-section=.init_array",
                        "--remove-section=.rela.init_array", archive, out_archive], check=True)
    left = sorted(name for name, defined, visibility in symbols(out_archive)
                  if defined and visibility == "DEFAULT" and not name.startswith(PREFIX))
    if left:
        sys.exit(f"{out_archive}: public names left unrenamed: {' '.join(left)}")
    if list(constructors(out_archive)):
        sys.exit(f"{out_archive}: a constructor is left that would set jemalloc up at load")


if __name__ == "__main__":
    main()
