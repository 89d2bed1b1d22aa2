"""The ``gdsckpt`` command: argument parsing and printing over the library."""
