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
    # sampled recording: weighted counters and a rate in the header
    "perl_sampled": ["env", "HEAPDUMP_SAMPLE_BYTES=4096", "perl", "-e",
                     "my @k = map { 'x' x $_ } 1..3000; sleep 30"],
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


def seed(alloc, res, final=False):
    """final: the fuzzer reads the allocations table as an exited process's (bit 15)."""
    out = bytearray(struct.pack("<HH", len(alloc) // PAGE | (0x8000 if final else 0), len(res) // PAGE))
    for table, offset, data in [*patches(0, alloc), *patches(1, res)]:
        out += struct.pack("<BIH", table, offset, len(data)) + data
    return bytes(out)


def hostile_variants(alloc, res):
    """Yields (suffix, allocations, resources): the tables of a real program as a hostile one
    would change them. Offsets are those shm_layout.h pins."""
    alloc, res = bytearray(alloc), bytearray(res)
    node_size, = struct.unpack_from("<I", alloc, 24)
    high_water, = struct.unpack_from("<I", alloc, 52)
    nodes_offset, = struct.unpack_from("<Q", alloc, 72)
    one_address = bytearray(alloc)  # every live node claims the first one's address
    words = [struct.unpack_from("<Q", alloc, nodes_offset + i * node_size + 16)[0]
             for i in range(high_water)]
    first = next(word for word in words if word)
    for i, word in enumerate(words):
        if word:
            struct.pack_into("<Q", one_address, nodes_offset + i * node_size + 16, first)
    yield "one_address", one_address, res
    huge = bytearray(alloc)
    struct.pack_into("<I", huge, 52, 0xFFFFFFFF)  # node_high_water past any capacity
    huge_res = bytearray(res)
    struct.pack_into("<5Q", huge_res, 56, *[0xFFFFFFFFFFFFFFF0] * 5)  # statistics near wrap
    yield "huge_counts", huge, huge_res
    seq_offset, = struct.unpack_from("<Q", alloc, 56)
    held = bytearray(alloc)
    for slot in range(0, 4096, 7):  # writers that died holding these slot locks
        count, = struct.unpack_from("<I", held, seq_offset + slot * 4)
        struct.pack_into("<I", held, seq_offset + slot * 4, count | 1)
    yield "final_held_locks", held, res


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
        alloc, res = capture(library, argv)
        tables = [(name, alloc, res)]
        if name == "sleep":
            tables += [(f"{name}_{suffix}", a, r) for suffix, a, r in hostile_variants(alloc, res)]
        for seed_name, a, r in tables:
            data = seed(a, r, final=seed_name.endswith("final_held_locks"))
            with open(os.path.join(out_dir, seed_name), "wb") as f:
                f.write(data)
            print(f"{seed_name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
