"""elastic-oneshot: GPTQ compression that survives machines coming and going."""

__version__ = "0.1.0"


def oneshot(*args, **kwargs):
    """See `elastic_oneshot.surface.api.oneshot` (imported lazily: the command line starts fast)."""
    from elastic_oneshot.surface.api import oneshot as _oneshot

    return _oneshot(*args, **kwargs)


def teach_transformers(path: str):
    """Before `from_pretrained(path)` in a new process, where the checkpoint's README says so: teaches transformers
    to load its per-expert weights into the fused experts of its type (see `elastic_oneshot.models.source`)."""
    from elastic_oneshot.models.source import teach_transformers as _teach

    _teach(path)
