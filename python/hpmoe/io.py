"""safetensors files for hpmoe's Python side: the checkpoints of the training
example, and the weights, tokens and outputs ``hpmoe run --save`` writes.

    tensors, meta = hpmoe.io.load_safetensors(path)
    hpmoe.io.save_safetensors(path, {"w": tensor}, {"step": "3"})   # whole or not at all

Reads F32, F64, BF16, I32, I64 and U8 tensors (copies; the file is not kept
open). A malformed file raises ValueError naming the file and what is wrong.
"""
import json
import math
import os
import struct

import numpy as np
import torch

_NUMPY = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "U8": np.uint8}
_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
          torch.bfloat16: "BF16"}
_SIZES = {"F32": 4, "F64": 8, "I32": 4, "I64": 8, "U8": 1, "BF16": 2}


def _int_list(v, length=None):
    return isinstance(v, list) and (length is None or len(v) == length) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in v)


def load_safetensors(path):
    """(name -> tensor, the __metadata__ dict) of a safetensors file."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8:
            raise ValueError(f"{path}: its header claims {n} bytes, more than the file's {size - 8}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: its header is not JSON ({e})") from None
        data = f.read()
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: its __metadata__ is not a JSON object")
    out = {}
    for name, info in header.items():
        if not isinstance(info, dict) or not _int_list(info.get("shape")) or not _int_list(info.get("data_offsets"), 2):
            raise ValueError(f"{path}: tensor '{name}' lacks a dtype, an integer shape or two integer data_offsets")
        dtype, shape, (b, e) = info.get("dtype"), info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _SIZES:
            raise ValueError(f"{path}: tensor '{name}' has dtype {dtype}; hpmoe reads {sorted(_SIZES)}")
        count = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= b <= e <= len(data) or e - b != count * _SIZES[dtype]:
            raise ValueError(f"{path}: tensor '{name}' of shape {shape} ({dtype}) does not fit bytes [{b}, {e}) "
                             f"of the file's {len(data)}")
        if dtype == "BF16":
            bits = np.frombuffer(data[b:e], dtype=np.int16).reshape(shape).copy()
            out[name] = torch.from_numpy(bits).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(np.frombuffer(data[b:e], dtype=_NUMPY[dtype]).reshape(shape).copy())
    return out, meta


def save_safetensors(path, tensors, metadata=None):
    """Writes tensors (name -> tensor) and string metadata, atomically: a temporary file renamed over path."""
    path = os.fspath(path)
    header, blobs, offset = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor '{name}' is {t.dtype}; safetensors here takes {sorted(map(str, _NAMES))}")
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    write_atomically(path, [struct.pack("<Q", len(head)) + head, *blobs])


def write_atomically(path, data):
    """data (bytes, str, or a list of byte chunks) to path through a temporary beside it (synced, then renamed
    over path), removed if anything fails: a full disk, a file-size limit or an exception (a signal that
    Python turns into one) leaves the previous file, or none, and no stray temporary."""
    path = os.fspath(path)
    chunks = [data] if isinstance(data, (bytes, bytearray, str)) else data
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c.encode() if isinstance(c, str) else c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
