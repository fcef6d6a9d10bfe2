"""Communication: joining the process group, collectives over nested data (pytree), and the network
interfaces and stores that the groups use.

It may import the shared foundations only; never the concerns above it (``data``, ``parallel``,
``checkpoint``, ``launch``) or the facade.
"""
