"""Tests of on-disk format v1 against its normative text, docs/format.md."""
