"""The GPU script (``python benchmarks/gpu/run.py`` or ``hatch run bench gpu``): every mode
against serial on one device, the CUDA attention kernels, offload, the chunk manager's
device tier, overlap seen in a profiler trace, and the MFU of a Llama-style model; JSON lines.
"""
