"""Adapters to other tools: torch.distributed.checkpoint (``dcp``), Lightning (``lightning``)
and format conversion to and from torch.save / safetensors files (``convert``).
"""
