"""Getting models onto the machine (`strata pull`) and judging whether they fit it (`strata check`)."""

from strata.hub.local import default_models_dir, resolve_model

__all__ = ["default_models_dir", "resolve_model"]
