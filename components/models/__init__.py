"""Build or load Hugging Face causal LMs: tiny configs, seeded or meta-device builds, and loading
each rank's shard."""

from components.models.build import build_causal_lm, local_parameter_bytes, meta_causal_lm
from components.models.configs import tiny_config
from components.models.load import load_config, materialize_pretrained

__all__ = [
    "build_causal_lm",
    "load_config",
    "local_parameter_bytes",
    "materialize_pretrained",
    "meta_causal_lm",
    "tiny_config",
]
