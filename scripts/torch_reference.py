"""What the Python references share: how they make transformers' Mamba a
fair f32 reference (pure-PyTorch path, no TF32). Imported by
hf_crosscheck.py and bench_torch_step.py, which live beside this file (in
the repository's scripts/ and in a bundle's scripts/)."""


def strict_f32(torch):
    """f32 means f32: no TF32 in matmuls or convolutions. cuDNN is switched
    off (conv1d then takes PyTorch's native kernel; cuDNN convolutions default
    to TF32), and the matmul flag is set through one API only: torch >= 2.9
    raises when its legacy (allow_tf32) and new (fp32_precision) settings
    disagree."""
    torch.backends.cudnn.enabled = False
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        m.fp32_precision = "ieee"
        return f"cuda.matmul.fp32_precision = {m.fp32_precision!r}, cuDNN off"
    m.allow_tf32 = False
    return "cuda.matmul.allow_tf32 = False, cuDNN off"


def force_pure_pytorch(mm):
    """Make sure transformers runs its pure-PyTorch Mamba path.

    transformers 5.x calls `causal_conv1d_fn` / `selective_scan_fn` from
    every forward and resolves them to its own reference PyTorch
    implementations when the `causal_conv1d` and `mamba_ssm` packages are
    absent (it logs "falling back to its reference PyTorch implementation").
    Clearing those handles breaks that forward, so instead refuse to run
    when a fast-kernel package is importable. Returns what was checked."""
    import importlib.util

    found = {p: importlib.util.find_spec(p) is not None for p in ("mamba_ssm", "causal_conv1d")}
    present = [p for p, ok in found.items() if ok]
    if present:
        raise RuntimeError(
            f"fast-kernel package(s) {present} are installed: transformers would not take its "
            "pure-PyTorch path; run in an environment without them"
        )
    return found
