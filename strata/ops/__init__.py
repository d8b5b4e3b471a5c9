"""Kernels: each op is chosen in `strata.ops.registry` against its reference twin in `strata.ops.reference`."""
