"""The TP replica sync behind components.distributed.tp_replicas: its plan, flat buffers, drift check."""
