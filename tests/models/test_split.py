"""A model split across files (`name-00001-of-00002.gguf`, llama.cpp's gguf-split layout) loads as one."""

import gguf
import numpy as np
import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig
from strata.engine.loader import forward_all, load_model


def _split(src, out_dir, n=2):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    names = [t.name for t in r.tensors]
    parts = [names[i::n] for i in range(n)]
    paths = []
    for i, part in enumerate(parts):
        p = out_dir / f"model-{i + 1:05d}-of-{n:05d}.gguf"
        w = gguf.GGUFWriter(str(p), arch)
        if i == 0:
            for name, f in r.fields.items():
                if name.startswith("GGUF.") or name == "general.architecture":
                    continue
                vt = f.types[0]
                w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", n)
        w.add_int32("split.tensors.count", len(names))
        for t in r.tensors:
            if t.name in part:
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                if t.tensor_type == gguf.GGMLQuantizationType.F32:
                    w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
                else:
                    w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(p)
    return paths


def test_split_model_equals_single_file(hf_and_gguf, tmp_path):
    _, single = hf_and_gguf("qwen3moe")
    first, second = _split(single, tmp_path)
    cfg = EngineConfig(device="cpu", dtype="float32")
    ids = list(range(5, 40))
    a = forward_all(load_model(str(single), cfg, with_tokenizer=False), ids)
    for p in (first, second):  # any shard names the whole set
        b = forward_all(load_model(str(p), cfg, with_tokenizer=False), ids)
        assert torch.equal(a, b)


def test_missing_shard_is_named(hf_and_gguf, tmp_path):
    _, single = hf_and_gguf("qwen3moe")
    first, second = _split(single, tmp_path)
    second.unlink()
    with pytest.raises(StrataError, match="model-00002-of-00002.gguf"):
        load_model(str(first), EngineConfig(device="cpu", dtype="float32"))
