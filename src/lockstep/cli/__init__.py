"""The ``lockstep`` command line."""
