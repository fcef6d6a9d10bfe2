"""Parallelism and numerics: the device mesh and ``lockstep.Parallel`` (``mesh``), strategies (DDP, FSDP,
DP, single device), the model kinds and the one order in which ``rt.setup`` prepares a model
(``models``; pipeline stages in the ``pipeline`` room), tensor-parallel plans, precision (float8
included), device placement, the wrapper ``rt.setup`` returns, compile, activation checkpointing,
clipping over meshes, ``num_items`` gradient normalisation, meta-device init (docs/architecture.md).

FSDP, DTensor and their kin load where a model is sharded, not at import. It never imports
``data``, ``checkpoint``, ``launch``, ``fault_tolerance`` or the facade (import-linter contracts in
pyproject.toml).
"""
