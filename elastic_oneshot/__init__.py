"""elastic-oneshot: GPTQ compression that survives machines coming and going."""

__version__ = "0.1.0"


def oneshot(*args, **kwargs):
    """See `elastic_oneshot.surface.api.oneshot` (imported lazily: the command line starts fast)."""
    from elastic_oneshot.surface.api import oneshot as _oneshot

    return _oneshot(*args, **kwargs)
