"""The TP replica sync behind ``components.distributed.tp_replicas``: one explicit ``ReplicaSync``
(sync.py) over the replica selection (selection.py) and its flat buffers (buckets.py,
flat_buffers.py), and the drift check that proves the copies stayed equal (drift.py)."""

from components.distributed.replicas.drift import check_replicas, write_drift_report
from components.distributed.replicas.sync import ReplicaSync

__all__ = ["ReplicaSync", "check_replicas", "write_drift_report"]
