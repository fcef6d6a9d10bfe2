"""Failures, said plainly: the collective watchdog and hang reports, preemption (SLURM's signals),
root-cause reports of a failed worker, and process lifetime (workers that die with their parent).

It may import the shared foundations only; never ``comm``, ``data``, ``parallel``, ``checkpoint``,
``launch`` or the facade.
"""
