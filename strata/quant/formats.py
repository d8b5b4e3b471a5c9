"""Weight-format facts: which GGML types strata handles, their block geometry, their names."""

from __future__ import annotations

import logging

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata import StrataError

Q = GGMLQuantizationType
log = logging.getLogger("strata")

# Every format strata can dequantize and multiply by; order is the gguf enum's.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    Q.F32, Q.F16, Q.BF16,
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS, Q.IQ1_S, Q.IQ4_NL, Q.IQ3_S, Q.IQ2_S, Q.IQ4_XS, Q.IQ1_M,
    Q.TQ1_0, Q.TQ2_0, Q.MXFP4,
})

# Plain float formats: one element per "block".
FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F32, Q.F16, Q.BF16})


def as_qtype(qtype) -> GGMLQuantizationType:
    """The GGMLQuantizationType for an enum member, its int value or its name ("Q4_K")."""
    if isinstance(qtype, GGMLQuantizationType):
        return qtype
    try:
        if isinstance(qtype, str):
            return GGMLQuantizationType[qtype.upper()]
        return GGMLQuantizationType(int(qtype))
    except (KeyError, ValueError, TypeError):
        raise StrataError(f"unknown GGML weight type {qtype!r}") from None


def type_name(qtype) -> str:
    """The format's name as llama.cpp spells it, e.g. "Q4_K"."""
    return as_qtype(qtype).name


def check_supported(qtype) -> GGMLQuantizationType:
    """Return the qtype, or raise StrataError naming it when strata cannot handle it."""
    qt = as_qtype(qtype)
    if qt not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))
        raise StrataError(f"weight format {qt.name} is not supported by strata (supported: {names})")
    return qt


def block_geometry(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block) for the format."""
    return GGML_QUANT_SIZES[as_qtype(qtype)]


def bytes_for(qtype, n_elements: int) -> int:
    """Bytes that n_elements take in the format; n_elements must be a whole number of blocks."""
    qt = as_qtype(qtype)
    block, size = GGML_QUANT_SIZES[qt]
    if n_elements % block:
        raise StrataError(f"{n_elements} elements are not a whole number of {qt.name} blocks of {block}")
    return n_elements // block * size


_WARNED: set[GGMLQuantizationType] = set()


def warn_reference_path(qtype, where: str) -> None:
    """Log, once per format per process, that `qtype` weights have no fast kernel for `where` and go through the
    torch reference dequantizer (dequantize, then a dense matmul): correct, but slow."""
    qt = as_qtype(qtype)
    if qt in _WARNED:
        return
    _WARNED.add(qt)
    log.warning("strata: %s weights have no fast kernel for %s: they run through the torch reference "
                "dequantizer (dequantize + matmul), which is slow", qt.name, where)
