//! CUDA kernels (filled in by issue 4).
