//! Reduction contracts (filled in by issue 4).
