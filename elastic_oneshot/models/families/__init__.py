"""Model families that need answers of their own (models.family): one module per family, each registering a
`Family` subclass with `@register(model_type, ...)`; every module here is imported on the first lookup."""
