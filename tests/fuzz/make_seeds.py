#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/). Re-run after format changes:

    python3 tests/fuzz/make_seeds.py --golden build/golden
"""
import argparse
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, blobs, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def seeds_safetensors():
    f32 = struct.pack("<6f", 1.5, -2.0, 0.25, 3.0, -0.5, 7.0)
    f16 = struct.pack("<4e", 1.0, -2.5, 0.125, 65504.0)
    bf16 = b"\x80\x3f\x00\xc0\x80\x3e\x00\x00"
    write("safetensors_fuzz", "f32", safetensors({"w": ("F32", [2, 3], f32)}))
    write("safetensors_fuzz", "mixed", safetensors(
        {"a": ("F16", [4], f16), "b": ("BF16", [2, 2], bf16), "i": ("I64", [1], struct.pack("<q", -7)),
         "u": ("U8", [3], b"\x01\x02\x03"), "e": ("F32", [0, 5], b"")}, metadata={"format": "pt"}))
    write("safetensors_fuzz", "scalar", safetensors({"s": ("F64", [], struct.pack("<d", 3.25))}))
    good = safetensors({"w": ("F32", [2, 3], f32)})
    write("safetensors_fuzz", "truncated", good[:-5])
    write("safetensors_fuzz", "bad_offsets", safetensors({"w": ("F32", [2, 3], f32)}).replace(b"[0, 24]", b"[8, 24]"))
    write("safetensors_fuzz", "not_json", struct.pack("<Q", 4) + b"{{{{")


def seeds_config(golden):
    engine = os.path.join(golden, "engine")
    for name in sorted(os.listdir(engine)):
        cfg = os.path.join(engine, name, "config.json")
        if os.path.exists(cfg):
            shutil.copy(cfg, os.path.join(HERE, "corpus", "config_fuzz", name + ".json"))
    default = os.path.join(HERE, "..", "..", "models", "default", "config.json")
    if os.path.exists(default):
        shutil.copy(default, os.path.join(HERE, "corpus", "config_fuzz", "default.json"))


def seeds_tokenizer():
    samples = {
        "ascii": b"The quick brown fox jumps over the lazy dog.",
        "utf8": "naïve café, 東京, Ünïcödé ✓ 🎵 music".encode(),
        "overlong": b"\xc0\xaf\xe0\x80\xaf",
        "surrogate": b"\xed\xa0\x80\xed\xbf\xbf",
        "max_and_beyond": b"\xf4\x8f\xbf\xbf\xf4\x90\x80\x80",
        "truncated": b"abc\xe6\x9d",
        "lone_continuations": b"\x80\xbf\x80",
        "control": b"\x00\x01\x7f\n\t",
    }
    for name, data in samples.items():
        write("tokenizer_fuzz", name, data)


def varint(v):
    out = b""
    v &= (1 << 64) - 1
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    return varint(num << 3 | wire) + payload


def string(num, s):
    b = s.encode() if isinstance(s, str) else s
    return field(num, 2, varint(len(b)) + b)


def packed(num, values):
    body = b"".join(varint(v) for v in values)
    return field(num, 2, varint(len(body)) + body)


def f32(num, x):
    return field(num, 5, struct.pack("<f", x))


def seeds_validation():
    write("validation_fuzz", "text", string(2, "Once upon a time") + field(4, 0, varint(8)))
    write("validation_fuzz", "tokens", string(1, "req-1") + string(3, packed(1, [1, 2, 3, 255])) +
          field(4, 0, varint(20)) + f32(5, 0.7) + field(6, 0, varint(40)) + f32(7, 0.9) + f32(8, 1.2) +
          field(9, 0, varint(42)) + string(10, "\n\n") + packed(11, [257]) + field(12, 0, varint(5)) +
          field(13, 0, varint(1)))
    write("validation_fuzz", "greedy", string(2, "abc") + f32(5, 0.0))
    write("validation_fuzz", "bad_id", string(3, packed(1, [300])))
    write("validation_fuzz", "negative", string(3, packed(1, [-1])) + field(4, 0, varint(-5)))
    write("validation_fuzz", "too_long", string(2, "x" * 60) + field(4, 0, varint(40)))
    write("validation_fuzz", "nan", string(2, "a") + f32(5, float("nan")) + f32(7, float("inf")))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--golden", required=True, help="the golden directory tests/make_goldens.py wrote")
    a = ap.parse_args()
    corpus = os.path.join(HERE, "corpus")
    if os.path.isdir(corpus):
        shutil.rmtree(corpus)
    for t in ("safetensors_fuzz", "config_fuzz", "tokenizer_fuzz", "validation_fuzz"):
        os.makedirs(os.path.join(corpus, t))
    seeds_safetensors()
    seeds_config(a.golden)
    seeds_tokenizer()
    seeds_validation()
    for t in sorted(os.listdir(corpus)):
        print(t, len(os.listdir(os.path.join(corpus, t))), "seeds")


if __name__ == "__main__":
    main()
