"""Parallelism and numerics: strategies (DDP, FSDP, DP, single device), precision, device placement,
the wrapper ``rt.setup`` returns, compile, ``num_items`` gradient normalisation, meta-device init.

FSDP, DTensor and their kin load where a model is sharded, not at import. It never imports
``data``, ``checkpoint``, ``launch`` or the facade (import-linter contracts in pyproject.toml).
"""
