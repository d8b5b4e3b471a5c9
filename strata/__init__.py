"""strata: run Mixture-of-Experts models larger than the GPU's memory, and serve them."""

__version__ = "0.1.0"


class StrataError(Exception):
    """An error with a message meant for the user: the CLI prints it as one line and exits non-zero."""
