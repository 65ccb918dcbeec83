"""Minimal safetensors reader/writer (numpy), written from the format description:
8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw bytes."""
import json
import struct

import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _encode(arr, dtype):
    """Returns (dtype name, bytes). dtype 'BF16' rounds float32 to bfloat16 (nearest even)."""
    if dtype == "BF16":
        bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return "BF16", rounded.tobytes()
    return dtype, np.ascontiguousarray(arr, dtype=_DTYPES[dtype]).tobytes()


def save(path, tensors, dtypes=None, metadata=None):
    """tensors: {name: ndarray}; dtypes: {name: 'F32'|'F16'|'BF16'|...} (default from the array)."""
    dtypes = dtypes or {}
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        default = {np.dtype(v): k for k, v in _DTYPES.items()}[arr.dtype]
        dt, blob = _encode(arr, dtypes.get(name, default))
        header[name] = {"dtype": dt, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = metadata
    hbytes = json.dumps(header).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)


def load(path):
    """Returns {name: float64/int ndarray}; F16 and BF16 are widened exactly."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        raw = body[b:end]
        if e["dtype"] == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, _DTYPES[e["dtype"]])
        out[name] = arr.reshape(e["shape"])
    return out
