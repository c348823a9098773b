"""Native kernels: C++ for CPU, built on the user's machine (cpu.py)."""
