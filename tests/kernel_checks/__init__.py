"""Host harness for the CUDA headers in bmt_wrap/kernels (built with g++, called through ctypes)."""
