"""The values the training objectives' options take, listed once: the config's schema offers them
and the losses dispatch on them. Imports nothing, so a config is checked without loading torch."""

DPO_LOSS_TYPES = ("sigmoid", "ipo")  # dpo.loss_type (components.training.preference)
