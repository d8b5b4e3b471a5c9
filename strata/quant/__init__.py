"""Weight formats: GGML blocks kept as stored (QTensor), reference dequantizers in torch, qmatmul."""

from strata.quant.dequant import dequantize
from strata.quant.formats import SUPPORTED_TYPES, bytes_for, type_name
from strata.quant.matmul import qmatmul, register_kernel
from strata.quant.qtensor import QTensor
from strata.quant.random import random_qtensor, random_raw_bytes

__all__ = [
    "QTensor", "dequantize", "qmatmul", "register_kernel", "random_qtensor", "random_raw_bytes",
    "SUPPORTED_TYPES", "type_name", "bytes_for",
]
