"""The package version, in a module of its own so that modules inside the package can read it
without importing the package's ``__init__`` (which imports them)."""

__version__ = "0.1.0"
