"""Fault tolerance without a restart, the worker's side: the Runtime's replication (``replication``:
none, or ``groups.ReplicaGroups``, one replica group of a fault-tolerant job over torchft's ``Manager``),
the alarm that ends the other participants' wait when a step's all-reduce fails (``alarm``), and
torchft's private APIs behind one compat module (``_torchft_compat``). The launcher's side (the
lighthouse, the supervisor that runs and replaces the groups) is ``runtime/launch/replicas.py``.

Imports ``parallel`` (the membership), ``comm``, ``seed``; never ``data`` or ``checkpoint``
(docs/fault-tolerance.md, docs/architecture.md).
"""
