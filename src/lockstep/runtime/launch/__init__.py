"""The launcher side: ``lockstep run``'s request and its engines (torch elastic, Ray Train, replica
groups), the torch engine's plan, ``lockstep.launch`` (spawn), the torch elastic agent, the node watch
and the membership report of elastic jobs (docs/architecture.md).

It runs before any model exists, so it never imports ``parallel``, ``data`` or ``checkpoint``
(an import-linter contract); it may use ``comm``, ``faults`` and the shared foundations.
"""
