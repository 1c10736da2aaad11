#!/usr/bin/python3
"""A client of heapdump-collector written from docs/wire-protocol.md alone (no generated code):
raw SOCK_SEQPACKET datagrams, hand-encoded protobuf. Starts a real collector and checks the error
paths a client meets first: no process to snapshot, an unknown stored snapshot, an empty listing,
an unsupported selector, and that a malformed message closes only its own connection.

usage: wire_client_test.py PATH/TO/heapdump-collector
"""
import array
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

MAGIC = 0x01
RESPONSE = 0x01


def varint(v):
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field_varint(num, v):
    return varint(num << 3) + varint(v)


def field_bytes(num, payload):
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def header(txid, ordinal, flags=0):
    return struct.pack("<IBBBBQ", txid, flags, 0, 0, MAGIC, ordinal)


def parse_header(data):
    txid, flags, _, _, magic, ordinal = struct.unpack("<IBBBBQ", data[:16])
    assert magic == MAGIC, magic
    return txid, flags, ordinal, data[16:]


def read_varint(buf, pos):
    shift = value = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def fields(buf):
    """Yields (number, wire type, value) of a protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = read_varint(buf, pos)
        elif wt == 2:
            n, pos = read_varint(buf, pos)
            v, pos = buf[pos:pos + n], pos + n
        else:
            raise AssertionError("unexpected wire type %d" % wt)
        yield num, wt, v


def send(sock, data, fds=()):
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], anc)


def receive_errors_or_batches(mine):
    """Serves SnapshotReceiver on `mine` until the stream ends; returns ('error', code) or
    ('batches', [element bodies])."""
    elements = []
    while True:
        data = mine.recv(65536)
        assert data, "receiver channel closed early"
        txid, flags, ordinal, body = parse_header(data)
        assert txid != 0 and flags == 0
        mine.send(header(txid, ordinal, RESPONSE))  # acknowledge: the flow control
        if ordinal == 0x202:
            error = dict((n, v) for n, _, v in fields(body)).get(1)
            return "error", error
        assert ordinal == 0x201, hex(ordinal)
        batch = [v for n, _, v in fields(body) if n == 1]
        if not batch:
            return "batches", elements
        elements += batch


def take_live_snapshot(path, selector):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    body = (field_bytes(1, selector) if selector is not None else b"") + field_bytes(2, field_varint(1, 0))
    send(sock, header(0, 0x101) + body, [theirs.fileno()])
    theirs.close()
    result = receive_errors_or_batches(mine)
    sock.close()
    return result


def accepts(path):
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def main():
    collector = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="hd-wire-")
    path = os.path.join(tmp, "run", "collector.sock")
    proc = subprocess.Popen([collector, "--foreground", "--socket", path, "--storage",
                             os.path.join(tmp, "state"), "--log-level", "debug"])
    try:
        # Listening, not just bound: the socket file exists a moment before it accepts.
        for _ in range(400):
            if accepts(path):
                break
            assert proc.poll() is None, "collector exited with %s" % proc.returncode
            time.sleep(0.05)
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700

        # No process registered: any selector gives PROCESS_SELECTOR_NO_MATCH (2).
        assert take_live_snapshot(path, None) == ("error", 2)
        assert take_live_snapshot(path, field_bytes(1, b"nosuchproc")) == ("error", 2)
        assert take_live_snapshot(path, field_varint(2, 1)) == ("error", 2)
        # A selector variant from the future: PROCESS_SELECTOR_UNSUPPORTED (1).
        assert take_live_snapshot(path, field_varint(9, 1)) == ("error", 1)

        # Download of an unknown id: STORED_SNAPSHOT_NOT_FOUND (5).
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        send(sock, header(0, 0x103) + field_varint(1, 12345) + field_bytes(2, field_varint(1, 0)),
             [theirs.fileno()])
        theirs.close()
        assert receive_errors_or_batches(mine) == ("error", 5)

        # Listing with nothing stored: GetNext answers an empty response at once.
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        send(sock, header(0, 0x102) + field_bytes(1, field_varint(1, 0)), [theirs.fileno()])
        theirs.close()
        mine.send(header(77, 0x301))
        txid, flags, ordinal, body = parse_header(mine.recv(65536))
        assert (txid, flags, ordinal) == (77, RESPONSE, 0x301)
        result = list(fields(body))
        assert len(result) == 1 and result[0][0] == 1, result  # the `response` variant
        assert [n for n, _, _ in fields(result[0][2]) if n == 1] == []  # no StoredSnapshot

        # A malformed message (bad magic) closes that connection only.
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bad.connect(path)
        bad.send(struct.pack("<IBBBBQ", 0, 0, 0, 0, 0x7F, 0x101))
        assert bad.recv(65536) == b""
        assert take_live_snapshot(path, None) == ("error", 2)
        print("wire client: 1 passed, 0 failed")
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0, "collector did not shut down cleanly"
        assert not os.path.exists(path), "socket left behind"


if __name__ == "__main__":
    main()
