"""Build or load Hugging Face causal LMs: seeded or meta-device builds, and loading each rank's
shard. The names below are imported on first use (``from components.models import
build_causal_lm``): a submodule such as ``components.models.families`` stays light."""

import importlib

_HOMES = {
    "build_causal_lm": "components.models.build",
    "local_parameter_bytes": "components.models.build",
    "meta_causal_lm": "components.models.build",
    "load_config": "components.models.load",
    "materialize_pretrained": "components.models.load",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once
    return value
