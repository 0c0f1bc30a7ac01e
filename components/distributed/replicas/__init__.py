"""What sits behind ``components.distributed.tp_replicas``: the replica selection (selection.py),
the cached plan (plan.py) and its flat buffers (buckets.py, flat_buffers.py); and the drift check
that proves the copies stayed equal (drift.py)."""

from components.distributed.replicas.drift import check_replicas, write_drift_report

__all__ = ["check_replicas", "write_drift_report"]
