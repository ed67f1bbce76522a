#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_protocol into tests/fuzz/corpus/.

Each file is one fuzzer input: a control byte (chunk size - 1 in bits 0-5,
bit 6: fds with the first chunk, bit 7: fds with every fourth chunk) and then
a stream of valid messages as include/pvgpu/protocol.h lays them out.
Rerun after changing the protocol: python3 tests/fuzz/make_corpus.py
"""
import os
import struct

MAGIC = 0x55504750
CHAN_MEM_SIZE = 4096 + 256 * 16


def msg(mtype, seq, payload=b""):
    return struct.pack("<IHHII", MAGIC, mtype, 0, len(payload), seq) + payload


def name(s, size):
    return s.encode().ljust(size, b"\0")


hello = msg(1, 1, struct.pack("<II", 1, 1) + bytes(range(1, 17)) + name("vm1", 64) + struct.pack("<II", 4242, 0))
hello_host = msg(1, 1, struct.pack("<II", 1, 2) + bytes(16) + name("render", 64) + struct.pack("<II", 77, 0))
alloc = msg(2, 2, struct.pack("<Q", 1234) + name("bench", 32))
free = msg(3, 3, struct.pack("<II", 3, 0))
mode_ack = msg(4, 4, struct.pack("<IIII", 3, 1, 10, 77))
trap = msg(5, 0, struct.pack("<II", 3, 12))
ping = msg(6, 5)
task_weight = msg(7, 6, struct.pack("<QII", 1234, 250, 0))
hello_reply = msg(64, 1, struct.pack("<IIII", 0, 1, 7, 16))
chan_ok = msg(65, 2, struct.pack("<IIII", 0, 3, CHAN_MEM_SIZE, 0))
chan_err = msg(65, 2, struct.pack("<IIII", 4, 0, 0, 0))
free_reply = msg(66, 3, struct.pack("<II", 0, 3))
mode = msg(67, 0, struct.pack("<IIII", 3, 2, 9, 0))
notice = msg(68, 0, struct.pack("<IIQ", 1, 3, 1234))
error = msg(69, 7, struct.pack("<II", 3, 0) + name("HELLO first", 120))
pong = msg(70, 5)
task_weight_reply = msg(71, 6, struct.pack("<II", 4, 0))

corpus = {
    "client-session": bytes([15]) + hello + alloc + ping + mode_ack + trap + task_weight + free,
    "host-session": bytes([63]) + hello_host + alloc + free,
    "daemon-replies": bytes([6]) + hello_reply + chan_err + free_reply + mode + notice + task_weight_reply
    + error + pong,
    "chan-reply-fds": bytes([0x40 | 47]) + chan_ok,
    "fds-every-fourth": bytes([0x80 | 31]) + chan_ok + ping + pong + ping + chan_ok,
    "byte-by-byte": bytes([0]) + hello + ping,
    "oversize-len": bytes([3]) + struct.pack("<IHHII", MAGIC, 1, 0, 0x7FFFFFFF, 1) + bytes(32),
}

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
os.makedirs(out, exist_ok=True)
for fname, data in corpus.items():
    with open(os.path.join(out, fname), "wb") as f:
        f.write(data)
