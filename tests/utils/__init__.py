"""Helpers shared by the tests, not tests themselves: ``paths`` (ROOT, DATA), ``engines`` (``make_engine``),
``serverproc`` (``kvkeeper serve`` on a free port), ``sessionutil``, ``tiny_models`` (tiny random Hugging Face
folders), ``triton_aot`` (compiles the Triton kernels for an NVIDIA target, run as a script)."""
