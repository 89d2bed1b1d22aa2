"""Saves that run beside training: the snapshot-then-write async saver (threads) and the
out-of-process save worker, behind one ``SaveHandle`` interface.
"""
