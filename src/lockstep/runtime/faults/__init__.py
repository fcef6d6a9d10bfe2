"""Failures, said plainly: the collective watchdog and hang reports, stragglers named, preemption (SLURM's signals),
root-cause reports of a failed worker, and process lifetime (workers that die with their parent).

It imports only the shared foundations: never ``comm`` or the rooms above it (``data``,
``parallel``, ``checkpoint``, ``launch``), never the facade (import-linter contracts).
"""
