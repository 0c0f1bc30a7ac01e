"""The values a model's build options take, listed once: the config's schema offers them and the
builders dispatch on them. Imports nothing, so a config is checked without loading a model."""

PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp8")  # train.precision (components.models.precision)
FP8_RECIPES = ("tensorwise", "rowwise")  # train.fp8_recipe (components.models.fp8)
# train.activation_checkpointing (components.models.activation_checkpointing)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
