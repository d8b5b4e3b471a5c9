"""Rewrite a GGUF file tensor by tensor (tests: re-quantize a model, or dequantize it with gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np


def rewrite(src: Path, dst: Path, fn: Callable[[str, np.ndarray, int, tuple], tuple[np.ndarray, int]] | None = None,
            arch: str | None = None, meta: dict[str, str] | None = None) -> Path:
    """fn(name, raw_bytes_or_array, qtype, torch_shape) -> (data, qtype) where data is what GGUFWriter takes:
    a float32 array of the logical shape (qtype F32) or uint8 raw blocks `[..., row_bytes]`; or None to leave the
    tensor out; or a list of (name, data, qtype): tensors written in its place (a fused pair, say); None keeps every
    tensor as it is. meta: string metadata written in place of the source's (a chat template, say)."""
    r = gguf.GGUFReader(src)
    arch = arch or r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in (meta or {}):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vt, sub_type=sub)
    for name, value in (meta or {}).items():
        w.add_key_value(name, value, gguf.GGUFValueType.STRING)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        got = (fn or (lambda _n, data, qt, _s: (data, qt)))(t.name, np.asarray(t.data), int(t.tensor_type), shape)
        if got is None:
            continue
        for name, data, qt in (got if isinstance(got, list) else [(t.name, *got)]):
            if qt == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32).reshape(
                    shape if name == t.name else data.shape))
            else:
                w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=gguf.GGMLQuantizationType(qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
