#!/usr/bin/python3
"""Writes seeds for fuzz_tables (the input format is described in fuzz_tables.c) from the tables
of real programs: each program runs under LD_PRELOAD=libheapdump.so with a small
HEAPDUMP_MAX_MEMORY, and while it sleeps both of its memfds are read through /proc and stored as
patches of their non-zero bytes.

    make_table_seeds.py BUILD/instrumentation/libheapdump.so tests/fuzz/corpus/tables
"""
import os
import struct
import subprocess
import sys
import time

PAGE = 4096
MAX_PATCH = 0xFFFF
# Zero runs shorter than this stay inside a patch: a new patch header costs 7 bytes.
MIN_GAP = 16

PROGRAMS = {
    "sleep": ["sleep", "30"],
    "perl_strings": ["perl", "-e", "my @k = map { 'x' x $_ } 1..300; sleep 30"],
}


def memfds(pid):
    """Paths of the process's allocations and resources memfds, or None before they exist."""
    found = {}
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        for kind in ("allocations", "resources"):
            if target.startswith(f"/memfd:heapdump-{kind}"):
                found[kind] = f"{fd_dir}/{fd}"
    return found if len(found) == 2 else None


def sleeping(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def patches(table, image):
    """Yields (table, offset, bytes) covering every non-zero byte of image."""
    pos, end = 0, len(image)
    while pos < end:
        while pos < end and image[pos] == 0:
            pos += 1
        if pos == end:
            return
        start, last_nonzero = pos, pos
        while pos < end and pos - start < MAX_PATCH and pos - last_nonzero < MIN_GAP:
            if image[pos]:
                last_nonzero = pos
            pos += 1
        yield table, start, image[start:last_nonzero + 1]
        pos = last_nonzero + 1


def seed(alloc, res):
    out = bytearray(struct.pack("<HH", len(alloc) // PAGE, len(res) // PAGE))
    for table, offset, data in [*patches(0, alloc), *patches(1, res)]:
        out += struct.pack("<BIH", table, offset, len(data)) + data
    return bytes(out)


def capture(library, argv):
    env = dict(os.environ, LD_PRELOAD=library, HEAPDUMP_MAX_MEMORY="1M",
               HEAPDUMP_SOCKET="/nonexistent/heapdump-seeds.sock")
    proc = subprocess.Popen(argv, env=env)
    try:
        for _ in range(200):
            paths = memfds(proc.pid)
            if paths and sleeping(proc.pid):
                break
            time.sleep(0.05)
        else:
            sys.exit(f"{argv[0]}: its tables never appeared (is {library} right?)")
        time.sleep(0.5)  # let start-up finish: the tables are read while it sleeps
        with open(paths["allocations"], "rb") as a, open(paths["resources"], "rb") as r:
            return a.read(), r.read()
    finally:
        proc.kill()
        proc.wait()


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    library, out_dir = os.path.abspath(sys.argv[1]), sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    for name, argv in PROGRAMS.items():
        data = seed(*capture(library, argv))
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
