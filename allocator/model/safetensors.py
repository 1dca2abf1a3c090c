"""The header of a safetensors file: where its data starts and each tensor's dtype, shape and offsets, read without
the tensors."""

from __future__ import annotations

import json
import struct

__all__ = ["SAFETENSORS_DTYPES", "safetensors_header"]

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16",
                      "U32": "uint32", "U64": "uint64", "BOOL": "bool"}
"""safetensors' dtype codes, as torch dtype names (transformers' ``str_to_torch_dtype``)."""
_HEADER_LIMIT = 100 * 2**20  # safetensors itself refuses headers over 100 MB


def safetensors_header(path: str) -> tuple[int, dict]:
    """The byte offset where a safetensors file's data starts, and its header (name -> dtype, shape, offsets).

    A safetensors file starts with an 8-byte little-endian length and that many bytes of JSON describing each tensor;
    only those are read.

    Raises
    ------
    OSError
        The file cannot be read.
    ValueError
        Its header is not a safetensors header.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 < n <= _HEADER_LIMIT:
            raise ValueError(f"header length {n} is not that of a safetensors file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + n, header
