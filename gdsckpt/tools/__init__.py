"""Measuring and explaining tools behind the command line: the storage benchmark
(``storagebench``), the checkpoint cost model (``costmodel``) and the demo (``demo``).
"""
