"""The launcher side: ``lockstep run``'s plan, ``lockstep.launch`` (spawn), the torch elastic agent,
the node watch and the membership report of elastic jobs.

It runs before any model exists, so it never imports ``parallel``, ``data`` or ``checkpoint``
(an import-linter contract); it may use ``comm``, ``faults`` and the shared foundations.
"""
