"""Attention kernels, apart from the modules (as flash-linear-attention's ``layers`` / ``ops``):
one package per family (:mod:`.pola`, :mod:`.nala`) with its reference, torch, chunked-CPU and
Triton implementations behind one signature, :mod:`.ffn` for the blocks' inference forms and
:mod:`.dispatch` for the core names and Triton's availability. Triton is imported on first use."""
