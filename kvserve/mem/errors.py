"""Errors raised by the memory pools."""


class DoubleFreeError(RuntimeError):
    """A page, row or Mamba slot was freed while already free (or reserved), or listed
    twice in one release."""


class PoolError(ValueError):
    """An id outside the pool, or a pool built with impossible sizes."""
