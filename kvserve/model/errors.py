"""The error every model-loading path raises."""


class ModelLoadError(ValueError):
    """A checkpoint that kvserve cannot load, with the reason."""
