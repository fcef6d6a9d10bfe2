"""Checkpoints: the Checkpointer (DCP shards, async saves), the on-disk format (metadata, commit,
reading), integrity (checksums, reading that runs no code), and consolidation into one file.

DCP loads with ``checkpointer``, ``parts`` and ``consolidate``; ``format`` needs none of it, so the
Trainer reads metadata cheaply. It uses ``parallel`` (to unwrap models) and the shared
foundations; it never imports ``data``, ``launch`` or the facade (import-linter contracts).
"""
