"""Parallelism and numerics: strategies (DDP, FSDP, DP, single device), the device mesh of tensor
parallel × FSDP and its plans, precision (float8 included), device placement, the wrapper
``rt.setup`` returns, compile, activation checkpointing, clipping over meshes, ``num_items``
gradient normalisation, meta-device init.

FSDP, DTensor and their kin load where a model is sharded, not at import. It never imports
``data``, ``checkpoint``, ``launch`` or the facade (import-linter contracts in pyproject.toml).
"""
