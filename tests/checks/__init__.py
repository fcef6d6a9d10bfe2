"""Helpers the tests share: reference models and loops, data, multi-process checks (``checks.dist``),
Trainer fixtures (``checks.trainer``), FSDP, mesh, compile and Hugging Face checks."""
