"""strata: run Mixture-of-Experts models larger than the GPU's memory, and serve them."""

import os as _os

__version__ = "0.1.0"

# How long OpenMP threads spin for the next parallel region before they sleep (libgomp's GOMP_SPINCOUNT). The
# CPU lane's kernel shares torch's OpenMP runtime, which reads its environment once, when torch loads — so this
# is set here, before strata imports torch. A decode step calls the lane once per MoE layer, a fraction of a
# millisecond apart; with libgomp's default the threads slept between layers and waking them cost more than the
# experts they then computed (the gain for plans with a CPU share: docs/BENCHMARKS.md). Set after torch has loaded,
# the count changes nothing. Idle, the threads spin about a second, then sleep.
OMP_SPINCOUNT = 20_000_000
# Without a GPU, a short spin: libgomp's default (300,000) kept a 2-core machine's idle decode ~15% faster, but where
# anything else wants the cores (a browser, an editor, a second process) the threads spinning between a step's small
# kernels took them from the one doing the work, and decode fell 10-30x (docs/BENCHMARKS.md, "Measurements behind
# the engine's constants"); sleeping at once (OMP_WAIT_POLICY=passive) lost ~45% idle.
CPU_OMP_SPINCOUNT = 1000


def omp_spin_default(environ=_os.environ, gpu: bool | None = None) -> None:
    """Set GOMP_SPINCOUNT, unless the user chose a count or a wait policy: long where a GPU's decode may call the
    CPU lane (an NVIDIA device node exists), short on a CPU alone, whose cores the host's own work shares."""
    if gpu is None:
        gpu = _os.path.exists("/dev/nvidiactl")
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = str(OMP_SPINCOUNT if gpu else CPU_OMP_SPINCOUNT)


omp_spin_default()


class StrataError(Exception):
    """An error with a message meant for the user: the CLI prints it as one line and exits non-zero."""
