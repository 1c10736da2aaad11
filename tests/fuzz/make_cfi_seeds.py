#!/usr/bin/env python3
"""Writes seeds for fuzz_cfi (tests/fuzz/fuzz_cfi.c) into tests/fuzz/corpus/cfi: the unwind
tables of a real program (objcopy -O binary -j .eh_frame_hdr -j .eh_frame), and small built
images, one per shape of frame, in the target's input format (u32 pc offset, then the image)."""
import os
import struct
import subprocess
import sys
import tempfile

CODE = 0x8000  # where the built images' functions are, from the image's start (never read)


def uleb(v):
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        out.append(byte | (0x80 if v else 0))
        if not v:
            return bytes(out)


def sleb(v):
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        done = (v == 0 and not byte & 0x40) or (v == -1 and byte & 0x40)
        out.append(byte | (0 if done else 0x80))
        if done:
            return bytes(out)


def pad(b):
    return b + b"\0" * ((4 - len(b) % 8) % 8)


def image(cie_aug, cie_aug_data, cie_insns, fdes):
    """An .eh_frame_hdr and an .eh_frame with one CIE and the FDEs (start, range, insns)."""
    eh_at = 12 + 8 * len(fdes)
    cie = pad(struct.pack("<IB", 0, 1) + cie_aug + b"\0" + uleb(1) + sleb(-8) + bytes([16])
              + uleb(len(cie_aug_data)) + cie_aug_data + cie_insns)
    eh = struct.pack("<I", len(cie)) + cie
    fde_at = []
    for start, length, insns in fdes:
        fde_at.append(eh_at + len(eh))
        field = eh_at + len(eh) + 8
        body = pad(struct.pack("<Iii", len(eh) + 4, CODE + start - field, length) + uleb(0) + insns)
        eh += struct.pack("<I", len(body)) + body
    hdr = bytes([1, 0x1B, 0x03, 0x3B]) + struct.pack("<iI", eh_at - 4, len(fdes))
    for (start, _, _), at in zip(fdes, fde_at):
        hdr += struct.pack("<ii", CODE + start, at)
    return hdr + eh


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus", "cfi")
    entry = b"\x0c\x07\x08\x90\x01"  # def_cfa rsp 8; offset ra 1
    push = b"\x41\x0e\x10\x86\x02"  # advance 1; def_cfa_offset 16; offset rbp 2
    seeds = {
        "rbp_frame": (CODE + 5, image(b"zR", b"\x1b", entry, [(0, 64, push + b"\x43\x0d\x06")])),
        "epilogue": (CODE + 3, image(b"zR", b"\x1b", entry,
                                     [(0, 64, push + b"\x41\x0a\x0c\x07\x08\xc6\x41\x0b")])),
        "plt": (CODE + 12, image(b"zR", b"\x1b", entry,
                                 [(0, 64, b"\x0f\x0b\x77\x08\x80\x00\x3f\x1a\x3b\x2a\x33\x24\x22")])),
        "signal": (CODE, image(b"zRS", b"\x1b", entry, [(0, 16, b""), (32, 16, b"\x07\x10")])),
    }
    with tempfile.TemporaryDirectory() as tmp:
        real = os.path.join(tmp, "tables")
        subprocess.run(["objcopy", "-O", "binary", "-j", ".eh_frame_hdr", "-j", ".eh_frame",
                        "/usr/bin/true", real], check=True)
        with open(real, "rb") as f:
            seeds["true_tables"] = (0, f.read())
    os.makedirs(out, exist_ok=True)
    for name, (pc, data) in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(struct.pack("<I", pc) + data)


if __name__ == "__main__":
    main()
