"""Exceptions. Messages name what was expected, what was found and what to do."""


class PlanError(ValueError):
    """A plan file or a plan is unusable: missing, corrupt, newer format, inconsistent, or made for
    another model, resolution or head count."""


class PAROInputError(ValueError):
    """Arguments of `paro_attention` that break its contract (shapes, dtypes, modes, devices)."""


class PlanWarning(UserWarning):
    """A plan loads but something about it deserves a note (a file written without a checksum)."""
