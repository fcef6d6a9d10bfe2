"""Communication: joining the process group, collectives over nested data (pytree), and the network
interfaces and stores that the groups use.

It imports only the shared foundations: never ``faults`` or the rooms above it (``data``,
``parallel``, ``checkpoint``, ``launch``), never the facade (import-linter contracts).
"""
