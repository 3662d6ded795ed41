//! Minimal NCCL FFI (filled in by issue 2).
