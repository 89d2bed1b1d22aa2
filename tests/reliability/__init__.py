"""Reliability tests: crashes (SIGKILL), injected I/O errors, concurrent writers and readers, and
loading without unpickling. Figures for docs/reliability.md are printed by each test (``-s``) and
gathered in the terminal summary."""
