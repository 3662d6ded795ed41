#!/usr/bin/env python3
"""Cross-check mamba-train's Mamba model against Hugging Face transformers.

    python3 scripts/hf_crosscheck.py HF_LOGITS MAMBA_TRAIN WORK_DIR [options]
    python3 scripts/hf_crosscheck.py HF_LOGITS MAMBA_TRAIN WORK_DIR --self-test-format

HF_LOGITS and MAMBA_TRAIN are our binaries (a bundle's bin/hf_logits and
bin/mamba-train); WORK_DIR is created and receives every file the run makes.

Main mode (needs torch + transformers; CUDA unless --no-cuda):

(a) ours -> HF. `mamba-train train` trains a small model on the CPU
    (selective copying, d_model 64, 2 layers, vocabulary 64, --steps). On the
    same random tokens (B x T, T not a multiple of the CUDA scan's chunk),
    our `hf_logits` scores the checkpoint on the CPU (f32 and the f64
    program) and on CUDA, and transformers' MambaForCausalLM, loaded from the
    same directory with from_pretrained (every key must match), scores it in
    float32, eval mode, on its pure-PyTorch path (the fast-kernel entry point
    is replaced by one that raises), on the CPU and on the GPU.
(b) HF -> ours. A randomly initialised MambaForCausalLM (vocab 64, hidden 64,
    2 layers, state 16, use_bias False, use_conv_bias True, tied embeddings;
    the norm weights, D, conv bias and A_log, which transformers initialises
    to constants, get N(0, 0.1) / N(0, 0.05) noise so that a loader that
    mixed them up could not pass) is written with save_pretrained and scored
    by our hf_logits from that directory; a copy of the directory with the
    tied lm_head.weight stored explicitly (or dropped, whichever
    save_pretrained did not do) must give the same bits.

Checks (every row marked "check" must pass, else the exit status is 1):
logits elementwise |ours - ref| <= atol + rtol * |ref| (torch.allclose's
rule; defaults atol = rtol = 1e-4, f32 rounding through two layers is
~1e-6 relative), and |loss_ours - loss_ref| <= loss_tol * (1 + |loss_ref|)
(default 1e-5). The reference is transformers on the CPU in f32; ours on
CUDA is also compared with transformers on CUDA. Rows marked "info" measure
each f32 result against our CPU model's f64 program (same operations in
f64): how far each side is from higher-precision arithmetic. A negative
control compares ours with transformers on an input that differs in one
token: it must exceed the tolerance, else the comparison could not fail
(exit 1). max_rel is over reference entries at least 1e-3 of the largest.

(c), (d) the same two directions for Mamba-2 (Mamba2ForCausalLM, its
    torch_forward path): our CLI trains `--arch mamba2` (4 heads of 16 in 2
    groups, state 16, chunks of 32), and a random Mamba2ForCausalLM (8 heads
    of 16 in 2 groups, chunks of 32; norms, gated-norm weight, D, conv bias,
    A_log and dt_bias perturbed) is saved and scored by us. Ours runs on the
    CPU and on CUDA (the chunked SSD kernels, two groups of B and C);
    transformers on the CPU and the GPU.

--self-test-format (no torch needed; runs on the development machines):
checks our side of the plumbing against an independent pure-Python f64
Mamba forward written from transformers' slow path: a checkpoint trained by
our CLI, and a transformers-style directory written here (config.json with
non-default conv_kernel and time_step_rank, shuffled tensor order, a stored
tied lm_head.weight), both scored by hf_logits and compared in the same
table; the same two for Mamba-2 against a plain sequential recurrence (no
chunks; the directory's config.json carries time_step_limit as the bare
Infinity Python writes); plus the refusals: an lm_head that differs from the
embedding, a layer_norm_epsilon that is not 1e-5, a token file of the wrong
length.

File formats (see mamba-train/examples/hf_logits.rs): tokens are B*T
little-endian u32, row-major; hf_logits writes safetensors with `logits`
[B, T, V] (F32, or F64 under --precision f64), `loss` (scalar, same dtype)
and `tokens` [B, T] U32. This script reads and writes safetensors with its
own few lines of struct/json, so the same reader runs here and there.

Exit status: 0 all checks passed, 1 a check failed, 2 the run could not be
set up (a binary failed, a file was malformed, torch missing, ...).
"""

import argparse
import array
import json
import math
import os
import random
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import force_pure_pytorch, strict_f32  # noqa: E402

# ----------------------------------------------------------------------------
# safetensors, by hand (header length u64 LE, JSON header, raw LE data)
# ----------------------------------------------------------------------------

_TYPECODES = {"F32": "f", "F64": "d", "U32": "I", "I32": "i", "I64": "q", "U64": "Q"}


class SetupError(Exception):
    """The run could not be set up or a file was malformed (exit 2)."""


def read_safetensors(path):
    """Return ({name: (dtype, shape, array)}, metadata) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise SetupError(f"{path}: {len(raw)} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise SetupError(f"{path}: header length {n} runs past the end of the file")
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    data = raw[8 + n :]
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        dtype, shape, (s, e) = info["dtype"], info["shape"], info["data_offsets"]
        code = _TYPECODES.get(dtype)
        if code is None:
            raise SetupError(f"{path}: tensor {name} has dtype {dtype}, which this reader does not handle")
        a = array.array(code)
        if a.itemsize * math.prod(shape) != e - s:
            raise SetupError(f"{path}: tensor {name} {dtype}{shape} has {e - s} bytes")
        a.frombytes(data[s:e])
        if sys.byteorder != "little":
            a.byteswap()
        out[name] = (dtype, list(shape), a)
    return out, meta


def write_safetensors(path, tensors, metadata=None):
    """Write {name: (dtype, shape, sequence)} in the given (dict) order."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, values) in tensors.items():
        a = array.array(_TYPECODES[dtype], values)
        if len(a) != math.prod(shape):
            raise ValueError(f"tensor {name}: {len(a)} values for shape {shape}")
        if sys.byteorder != "little":
            a.byteswap()
        b = a.tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_tokens(path, tokens):
    """Token ids as little-endian u32, no header (hf_logits --tokens)."""
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(tokens)}I", *tokens))


def f32(x):
    """x rounded to the nearest f32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


# ----------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------


class Table:
    """Rows of comparisons; prints itself; remembers failures."""

    def __init__(self, atol, rtol, loss_tol):
        self.atol, self.rtol, self.loss_tol = atol, rtol, loss_tol
        self.rows = []
        self.failed = []

    def compare(self, part, what, got, ref, loss_got, loss_ref, kind="check"):
        """kind: "check" (must pass), "info" (printed only), "control" (must fail)."""
        if len(got) != len(ref):
            raise SetupError(f"{part} {what}: {len(got)} logits vs {len(ref)}")
        refmax = max((abs(r) for r in ref), default=0.0)
        max_abs = max_rel = 0.0
        viol = 0
        for g, r in zip(got, ref):
            d = abs(g - r)
            if not math.isfinite(g) or not math.isfinite(r):
                viol += 1
                max_abs = math.inf
                continue
            if d > self.atol + self.rtol * abs(r):
                viol += 1
            max_abs = max(max_abs, d)
            if abs(r) >= 1e-3 * refmax and r != 0.0:
                max_rel = max(max_rel, d / abs(r))
        dloss = abs(loss_got - loss_ref)
        loss_ok = math.isfinite(dloss) and dloss <= self.loss_tol * (1.0 + abs(loss_ref))
        within = viol == 0 and loss_ok
        if kind == "check":
            status = "ok" if within else "FAIL"
        elif kind == "control":
            # The altered input must be detected by the logits comparison.
            status = "ok (differs)" if viol > 0 else "FAIL (not detected)"
        else:
            status = "info"
        if status.startswith("FAIL"):
            self.failed.append(f"{part}: {what}")
        self.rows.append((part, what, kind, max_abs, max_rel, viol, len(ref), loss_got, loss_ref, dloss, status, refmax))
        return within

    def print(self):
        print()
        print(f"tolerances: logits |d| <= {self.atol:g} + {self.rtol:g}*|ref|; "
              f"loss |d| <= {self.loss_tol:g}*(1+|ref|)")
        hdr = ("part", "comparison", "kind", "max|d|", "max rel", "viol", "max|ref|", "loss", "loss ref", "|d loss|", "status")
        w = (4, 44, 7, 9, 9, 11, 8, 11, 11, 9, 0)
        print("  ".join(h.ljust(n) for h, n in zip(hdr, w)))
        for (part, what, kind, ma, mr, viol, n, lg, lr, dl, status, refmax) in self.rows:
            cells = (part, what, kind, f"{ma:.2e}", f"{mr:.2e}", f"{viol}/{n}", f"{refmax:.3g}",
                     f"{lg:.7f}", f"{lr:.7f}", f"{dl:.1e}", status)
            print("  ".join(c.ljust(n) for c, n in zip(cells, w)))
        print()


# ----------------------------------------------------------------------------
# Our binaries
# ----------------------------------------------------------------------------


def child_env():
    """The GPU hosts keep cuBLAS and libcuda outside the loader cache."""
    env = dict(os.environ)
    extra = [d for d in ("/usr/local/cuda/lib64", "/usr/local/nvidia/lib64") if os.path.isdir(d)]
    if extra:
        env["LD_LIBRARY_PATH"] = ":".join(extra + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def run_cmd(cmd, what, expect_ok=True, timeout=900):
    shown = " ".join(str(c) for c in cmd)
    print(f"$ {shown}", flush=True)
    t0 = time.time()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=child_env(), timeout=timeout)
    if expect_ok and p.returncode != 0:
        raise SetupError(f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    if expect_ok:
        print(f"  ({time.time() - t0:.1f} s) {tail}")
    return p


# Our Mamba-2 shape in the cross-check: 4 heads of 16 channels in 2 groups
# (so a loader that mixed up the groups' B / C could not pass), d_state 16,
# chunks of 32 tokens (100 is not a multiple: a partial last chunk).
MAMBA2_FLAGS = ["--arch", "mamba2", "--head-dim", 16, "--n-groups", 2, "--chunk-size", 32, "--d-state", 16]


def train_ours(mamba_train, run_dir, steps, d_model, alphabet, seed, extra=()):
    """A small selective-copy model trained on the CPU (Mamba-1, or what
    `extra` flags ask for); returns the checkpoint dir."""
    run_cmd([mamba_train, "train", "--device", "cpu", "--steps", steps, "--d-model", d_model, "--layers", 2,
             "--batch", 8, "--seq-len", 48, "--memorize", 8, "--alphabet", alphabet, "--seed", seed,
             "--eval-batches", 1, "--out", run_dir, *extra], "mamba-train train")
    latest = os.path.join(run_dir, "checkpoints", "LATEST")
    with open(latest) as f:
        return os.path.join(run_dir, "checkpoints", f.read().strip())


def ours(hf_logits, ckpt, tokens_path, b, t, out, device="cpu", precision="f32", expect_tokens=None):
    """Run hf_logits; return (flat logits, loss, vocab)."""
    run_cmd([hf_logits, "--checkpoint", ckpt, "--tokens", tokens_path, "--batch", b, "--seq-len", t,
             "--device", device, "--precision", precision, "--out", out], f"hf_logits --device {device}")
    tensors, meta = read_safetensors(out)
    for name in ("logits", "loss", "tokens"):
        if name not in tensors:
            raise SetupError(f"{out}: no tensor {name!r} (has {sorted(tensors)})")
    dtype, shape, logits = tensors["logits"]
    want = "F64" if precision == "f64" else "F32"
    if dtype != want or len(shape) != 3 or shape[:2] != [b, t]:
        raise SetupError(f"{out}: logits are {dtype}{shape}, expected {want}[{b}, {t}, V]")
    ldt, lshape, loss = tensors["loss"]
    if ldt != want or lshape != [] or len(loss) != 1:
        raise SetupError(f"{out}: loss is {ldt}{lshape}, expected a {want} scalar")
    tdt, tshape, toks = tensors["tokens"]
    if tdt != "U32" or tshape != [b, t]:
        raise SetupError(f"{out}: tokens are {tdt}{tshape}, expected U32[{b}, {t}]")
    if expect_tokens is not None and list(toks) != list(expect_tokens):
        raise SetupError(f"{out}: hf_logits read other tokens than were written")
    if meta.get("device", "").split(":")[0] != device or meta.get("precision") != precision:
        raise SetupError(f"{out}: metadata {meta} does not match --device {device} --precision {precision}")
    return list(logits), float(loss[0]), shape[2]


# ----------------------------------------------------------------------------
# An independent f64 reference: transformers' slow path, in plain Python
# ----------------------------------------------------------------------------


def hf_dims(cfg):
    d = cfg["hidden_size"]
    expand = cfg.get("expand", 2)
    r = cfg.get("time_step_rank", "auto")
    return {
        "D": d,
        "L": cfg["num_hidden_layers"],
        "N": cfg.get("state_size", 16),
        "K": cfg.get("conv_kernel", 4),
        "E": cfg.get("intermediate_size", expand * d),
        "R": math.ceil(d / 16) if r == "auto" else int(r),
        "V": cfg["vocab_size"],
        "eps": cfg.get("layer_norm_epsilon", 1e-5),
    }


def py_forward(cfg, weights, tokens, b, t):
    """Logits (flat, [B, T, V]) and mean next-token loss, in f64, following
    transformers' MambaMixer.slow_forward / MambaRMSNorm / tied lm_head."""
    dm = hf_dims(cfg)
    D, L, N, K, E, R, V, eps = (dm[k] for k in ("D", "L", "N", "K", "E", "R", "V", "eps"))

    def rows(name, n_rows, n_cols):
        return f64_rows(weights, name, n_rows, n_cols)

    def vec(name, n):
        return rows(name, 1, n)[0]

    matvec, silu, softplus = f64_matvec, f64_silu, f64_softplus

    def rms(x, w):
        return f64_rms(x, w, eps)

    emb = rows("backbone.embeddings.weight", V, D)
    layers = []
    for i in range(L):
        p = f"backbone.layers.{i}."
        layers.append({
            "norm": vec(p + "norm.weight", D),
            "in": rows(p + "mixer.in_proj.weight", 2 * E, D),
            "cw": rows(p + "mixer.conv1d.weight", E, K),
            "cb": vec(p + "mixer.conv1d.bias", E),
            "xp": rows(p + "mixer.x_proj.weight", R + 2 * N, E),
            "dw": rows(p + "mixer.dt_proj.weight", E, R),
            "db": vec(p + "mixer.dt_proj.bias", E),
            "A": [[-math.exp(a) for a in row] for row in rows(p + "mixer.A_log", E, N)],
            "Dp": vec(p + "mixer.D", E),
            "out": rows(p + "mixer.out_proj.weight", D, E),
        })
    norm_f = vec("backbone.norm_f.weight", D)
    logits, total, count = [], 0.0, 0
    for row in range(b):
        toks = tokens[row * t : (row + 1) * t]
        xs = [list(emb[k]) for k in toks]
        for ly in layers:
            us, zs = [], []
            for x in xs:
                xz = matvec(ly["in"], rms(x, ly["norm"]))
                us.append(xz[:E])
                zs.append(xz[E:])
            state = [[0.0] * N for _ in range(E)]
            for s in range(t):
                uc = []
                for c in range(E):
                    acc = ly["cb"][c]
                    for k in range(K):
                        j = s - (K - 1) + k
                        if j >= 0:
                            acc += ly["cw"][c][k] * us[j][c]
                    uc.append(silu(acc))
                dbc = matvec(ly["xp"], uc)
                dtr, bv, cv = dbc[:R], dbc[R : R + N], dbc[R + N :]
                y = []
                for c in range(E):
                    dt = softplus(sum(w * v for w, v in zip(ly["dw"][c], dtr)) + ly["db"][c])
                    h, a, u = state[c], ly["A"][c], uc[c]
                    acc = 0.0
                    for n in range(N):
                        h[n] = math.exp(dt * a[n]) * h[n] + dt * bv[n] * u
                        acc += h[n] * cv[n]
                    y.append((acc + ly["Dp"][c] * u) * silu(zs[s][c]))
                xs[s] = [xv + o for xv, o in zip(xs[s], matvec(ly["out"], y))]
        total, count = head_and_loss(xs, toks, emb, norm_f, eps, logits, total, count)
    return logits, (total / count if count else 0.0)


def f64_rows(weights, name, n_rows, n_cols):
    """Tensor `name` as n_rows lists of n_cols floats (its element count checked)."""
    _, shape, a = weights[name]
    if math.prod(shape) != n_rows * n_cols:
        raise SetupError(f"tensor {name} has shape {shape}, expected {n_rows} x {n_cols} elements")
    return [list(a[i * n_cols : (i + 1) * n_cols]) for i in range(n_rows)]


def f64_matvec(m, x):
    return [sum(w * v for w, v in zip(row, x)) for row in m]


def f64_rms(x, w, eps):
    s = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [wi * v * s for wi, v in zip(w, x)]


def f64_silu(x):
    return x / (1.0 + math.exp(-x)) if x > -700 else 0.0


def f64_softplus(x):
    return x if x > 20.0 else math.log1p(math.exp(x))


def head_and_loss(xs, toks, emb, norm_f, eps, logits, total, count):
    """One row's final norm, tied head and next-token cross-entropy: the
    logits appended to `logits`; the running (total, count) returned."""
    t = len(toks)
    for s in range(t):
        lg = f64_matvec(emb, f64_rms(xs[s], norm_f, eps))
        logits.extend(lg)
        if s + 1 < t:
            m = max(lg)
            total += m + math.log(sum(math.exp(v - m) for v in lg)) - lg[toks[s + 1]]
            count += 1
    return total, count


def py_forward_mamba2(cfg, weights, tokens, b, t):
    """Logits (flat, [B, T, V]) and mean next-token loss, in f64, of a
    Mamba-2 model as transformers' Mamba2ForCausalLM defines it (the
    torch_forward path: in_proj to z | xBC | dt, causal conv1d + SiLU over
    xBC, dt = softplus(dt + dt_bias), A = -exp(A_log) per head, B and C of
    group h // (heads / n_groups) for head h, y + D x, MambaRMSNormGated
    norm(y * silu(z)) over the whole inner width, out_proj; tied head), but
    computed by the plain sequential recurrence h_t = exp(dt A) h_{t-1} +
    dt x_t B_t^T, y_t = h_t C_t: no chunks, so it checks the chunked SSD
    algorithm on both sides rather than sharing it."""
    D, L, N, K, V = (cfg[k] for k in ("hidden_size", "num_hidden_layers", "state_size", "conv_kernel", "vocab_size"))
    E = cfg["expand"] * D
    H, P, G = cfg["num_heads"], cfg["head_dim"], cfg["n_groups"]
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    if H * P != E or H % G:
        raise SetupError(f"Mamba-2 config: {H} heads x {P} != inner width {E}, or {G} groups do not divide the heads")
    CI = E + 2 * G * N  # conv channels: x, B, C
    rows = lambda name, n, m: f64_rows(weights, name, n, m)  # noqa: E731
    vec = lambda name, n: rows(name, 1, n)[0]  # noqa: E731
    emb = rows("backbone.embeddings.weight", V, D)
    layers = []
    for i in range(L):
        p = f"backbone.layers.{i}."
        layers.append({
            "norm": vec(p + "norm.weight", D),
            "in": rows(p + "mixer.in_proj.weight", 2 * E + 2 * G * N + H, D),
            "cw": rows(p + "mixer.conv1d.weight", CI, K),
            "cb": vec(p + "mixer.conv1d.bias", CI),
            "dtb": vec(p + "mixer.dt_bias", H),
            "A": [-math.exp(a) for a in vec(p + "mixer.A_log", H)],
            "Dp": vec(p + "mixer.D", H),
            "ng": vec(p + "mixer.norm.weight", E),
            "out": rows(p + "mixer.out_proj.weight", D, E),
        })
    norm_f = vec("backbone.norm_f.weight", D)
    logits, total, count = [], 0.0, 0
    for row in range(b):
        toks = tokens[row * t : (row + 1) * t]
        xs = [list(emb[k]) for k in toks]
        for ly in layers:
            proj = [f64_matvec(ly["in"], f64_rms(x, ly["norm"], eps)) for x in xs]
            state = [[[0.0] * N for _ in range(P)] for _ in range(H)]
            for s in range(t):
                z, dt = proj[s][:E], proj[s][E + CI :]
                conv = []
                for c in range(CI):
                    acc = ly["cb"][c]
                    for k in range(K):
                        j = s - (K - 1) + k
                        if j >= 0:
                            acc += ly["cw"][c][k] * proj[j][E + c]
                    conv.append(f64_silu(acc))
                xv, bv, cv = conv[:E], conv[E : E + G * N], conv[E + G * N :]
                y = [0.0] * E
                for h in range(H):
                    g = h // (H // G)
                    dth = f64_softplus(dt[h] + ly["dtb"][h])
                    a = math.exp(dth * ly["A"][h])
                    for q in range(P):
                        c = h * P + q
                        st, acc = state[h][q], 0.0
                        for n in range(N):
                            st[n] = a * st[n] + dth * bv[g * N + n] * xv[c]
                            acc += cv[g * N + n] * st[n]
                        y[c] = acc + ly["Dp"][h] * xv[c]
                gated = f64_rms([y[c] * f64_silu(z[c]) for c in range(E)], ly["ng"], eps)
                xs[s] = [xv_ + o for xv_, o in zip(xs[s], f64_matvec(ly["out"], gated))]
        total, count = head_and_loss(xs, toks, emb, norm_f, eps, logits, total, count)
    return logits, (total / count if count else 0.0)


def py_reference(cfg, weights, tokens, b, t):
    """The pure-Python f64 forward of the directory's architecture."""
    if cfg.get("model_type") == "mamba2":
        return py_forward_mamba2(cfg, weights, tokens, b, t)
    return py_forward(cfg, weights, tokens, b, t)


def read_hf_dir(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    weights, _ = read_safetensors(os.path.join(d, "model.safetensors"))
    return cfg, weights


# ----------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------



def load_torch():
    try:
        import torch
        import transformers
        from transformers.models.mamba import modeling_mamba
    except ImportError as e:
        raise SetupError(f"the main mode needs torch and transformers ({e}); "
                         "use --self-test-format on a machine without them")
    print(f"float32 arithmetic: {strict_f32(torch)}")
    return torch, transformers, modeling_mamba


def hf_score(torch, model, tokens, b, t, device):
    ids = torch.tensor(tokens, dtype=torch.long).reshape(b, t).to(device)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, use_cache=False)
    if out.logits.dtype != torch.float32:
        raise SetupError(f"transformers returned {out.logits.dtype} logits, expected float32")
    return out.logits.double().cpu().reshape(-1).tolist(), float(out.loss)


def altered(tokens, t, vocab):
    """The same tokens with one id changed (row 0, middle position)."""
    x = list(tokens)
    x[t // 2] = (x[t // 2] + 1) % vocab
    return x


def random_tokens(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)]


# ----------------------------------------------------------------------------
# Main mode
# ----------------------------------------------------------------------------


def part_a(a, table, torch, mm):
    from transformers import MambaForCausalLM

    w = os.path.join(a.work, "a")
    os.makedirs(w, exist_ok=True)
    ck = train_ours(a.mamba_train, os.path.join(w, "run"), a.steps, 64, 62, a.seed)
    cfg, _ = read_hf_dir(ck)
    vocab = cfg["vocab_size"]
    b, t = a.batch, a.seq_len
    rng = random.Random(a.seed)
    tokens = random_tokens(rng, b * t, vocab)
    tok_path = os.path.join(w, "tokens.bin")
    write_tokens(tok_path, tokens)

    o_cpu, l_cpu, _ = ours(a.hf_logits, ck, tok_path, b, t, os.path.join(w, "ours_cpu.safetensors"), "cpu", "f32", tokens)
    o_f64, l_f64, _ = ours(a.hf_logits, ck, tok_path, b, t, os.path.join(w, "ours_f64.safetensors"), "cpu", "f64", tokens)
    if not a.no_cuda:
        o_gpu, l_gpu, _ = ours(a.hf_logits, ck, tok_path, b, t, os.path.join(w, "ours_cuda.safetensors"), "cuda", "f32", tokens)

    model, info = MambaForCausalLM.from_pretrained(ck, output_loading_info=True)
    force_pure_pytorch(mm)
    model = model.float().eval()
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    bad = {k: v for k, v in (("missing", missing), ("unexpected", info["unexpected_keys"]),
                             ("mismatched", info["mismatched_keys"])) if v}
    if bad:
        raise SetupError(f"(a) transformers did not load every tensor of {ck}: {bad}")
    if not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight):
        raise SetupError("(a) transformers' lm_head is not tied to the embedding")
    check_loaded_bits(torch, model, ck, "(a)", table)
    print(f"(a) {ck}: transformers loaded every tensor; eps {model.config.layer_norm_epsilon}, "
          f"time_step_rank {model.config.time_step_rank}, intermediate {model.config.intermediate_size}")
    h_cpu, hl_cpu = hf_score(torch, model, tokens, b, t, "cpu")
    h_ctl, hl_ctl = hf_score(torch, model, altered(tokens, t, vocab), b, t, "cpu")

    table.compare("a", "ours cpu f32 vs HF cpu f32", o_cpu, h_cpu, l_cpu, hl_cpu)
    if not a.no_cuda:
        model = model.to("cuda")
        force_pure_pytorch(mm)
        h_gpu, hl_gpu = hf_score(torch, model, tokens, b, t, "cuda")
        table.compare("a", "ours cuda f32 vs HF cpu f32", o_gpu, h_cpu, l_gpu, hl_cpu)
        table.compare("a", "ours cuda f32 vs HF cuda f32", o_gpu, h_gpu, l_gpu, hl_gpu)
        table.compare("a", "HF cuda f32 vs HF cpu f32", h_gpu, h_cpu, hl_gpu, hl_cpu)
    table.compare("a", "ours cpu f32 vs HF, 1 token altered", o_cpu, h_ctl, l_cpu, hl_ctl, kind="control")
    table.compare("a", "ours cpu f32 vs ours f64", o_cpu, o_f64, l_cpu, l_f64, kind="info")
    table.compare("a", "HF cpu f32 vs ours f64", h_cpu, o_f64, hl_cpu, l_f64, kind="info")
    if not a.no_cuda:
        table.compare("a", "ours cuda f32 vs ours f64", o_gpu, o_f64, l_gpu, l_f64, kind="info")
        table.compare("a", "HF cuda f32 vs ours f64", h_gpu, o_f64, hl_gpu, l_f64, kind="info")
    if a.py_ref:
        cfgj, weights = read_hf_dir(ck)
        p, pl = py_forward(cfgj, weights, tokens, b, t)
        table.compare("a", "ours f64 vs Python f64 (slow path)", o_f64, p, l_f64, pl, kind="info")
        table.compare("a", "HF cpu f32 vs Python f64", h_cpu, p, hl_cpu, pl, kind="info")


# The mixer tensors transformers initialises to constants, with the noise
# scale each gets, in the order they are drawn (so a loader that mixed them
# up could not pass).
MAMBA1_CONSTANTS = [("D", 0.1), ("conv1d.bias", 0.1), ("A_log", 0.05)]
MAMBA2_CONSTANTS = MAMBA1_CONSTANTS + [("dt_bias", 0.1), ("norm.weight", 0.1)]


def perturb_constants(torch, model, seed, mixer):
    """N(0, s) noise from one generator on every block's norm weight, the
    `mixer` tensors of every block, and the final norm."""
    g = torch.Generator().manual_seed(seed)

    def noise(p, s):
        p.add_(s * torch.randn(p.shape, generator=g, dtype=p.dtype))

    with torch.no_grad():
        for layer in model.backbone.layers:
            noise(layer.norm.weight, 0.1)
            for name, s in mixer:
                noise(layer.mixer.get_parameter(name), s)
        noise(model.backbone.norm_f.weight, 0.1)


def other_head_spelling(hf_dir, other_dir, what):
    """A copy of transformers' `save_pretrained` directory with the tied
    head spelled the other way (lm_head.weight stored if it was not, dropped
    if it was), which our loader must also take. Returns the copy and the
    config.json it read."""
    saved, meta = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    head_stored = "lm_head.weight" in saved
    print(f"{what} save_pretrained wrote {len(saved)} tensors to {hf_dir} "
          f"(lm_head.weight {'stored' if head_stored else 'not stored (tied)'}), metadata {meta}")
    os.makedirs(other_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    with open(os.path.join(other_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    other = {k: v for k, v in saved.items() if k != "lm_head.weight"}
    if not head_stored:
        other["lm_head.weight"] = saved["backbone.embeddings.weight"]
    write_safetensors(os.path.join(other_dir, "model.safetensors"), other, {"format": "pt"})
    return other_dir, hf_cfg


def score_saved(a, table, w, part, hf_dir, other_dir, vocab, rng):
    """Our CPU side of a part that scores transformers' saved directory:
    random tokens, hf_logits in f32 on both spellings of the tied head (which
    must give the same bits) and in f64. Returns (tokens, their file, f32
    logits, f32 loss, f64 logits, f64 loss)."""
    b, t = a.batch, a.seq_len
    tokens = random_tokens(rng, b * t, vocab)
    tok_path = os.path.join(w, "tokens.bin")
    write_tokens(tok_path, tokens)
    o_cpu, l_cpu, _ = ours(a.hf_logits, hf_dir, tok_path, b, t, os.path.join(w, "ours_cpu.safetensors"), "cpu", "f32", tokens)
    o_oth, l_oth, _ = ours(a.hf_logits, other_dir, tok_path, b, t, os.path.join(w, "ours_other.safetensors"), "cpu", "f32", tokens)
    o_f64, l_f64, _ = ours(a.hf_logits, hf_dir, tok_path, b, t, os.path.join(w, "ours_f64.safetensors"), "cpu", "f64", tokens)
    if o_oth != o_cpu or l_oth != l_cpu:
        table.failed.append(f"{part}: the directory with the other lm_head spelling gave different logits")
        print(f"({part}) FAIL: the two spellings of the tied head gave different results")
    else:
        print(f"({part}) both spellings of the tied head (stored / not stored) gave the same bits")
    return tokens, tok_path, o_cpu, l_cpu, o_f64, l_f64


def part_b(a, table, torch, mm):
    from transformers import MambaConfig, MambaForCausalLM

    w = os.path.join(a.work, "b")
    os.makedirs(w, exist_ok=True)
    cfg = MambaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                      conv_kernel=4, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                      layer_norm_epsilon=1e-5)
    torch.manual_seed(a.seed)
    model = MambaForCausalLM(cfg)
    force_pure_pytorch(mm)
    model = model.float().eval()
    if not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight):
        raise SetupError("(b) transformers did not tie lm_head to the embedding although tie_word_embeddings=True")
    perturb_constants(torch, model, a.seed + 1, MAMBA1_CONSTANTS)
    hf_dir = os.path.join(w, "hf")
    model.save_pretrained(hf_dir)
    other_dir, _ = other_head_spelling(hf_dir, os.path.join(w, "hf_other_head"), "(b)")

    vocab, b, t = cfg.vocab_size, a.batch, a.seq_len
    tokens, tok_path, o_cpu, l_cpu, o_f64, l_f64 = score_saved(a, table, w, "b", hf_dir, other_dir, vocab,
                                                               random.Random(a.seed + 2))

    h_cpu, hl_cpu = hf_score(torch, model, tokens, b, t, "cpu")
    h_ctl, hl_ctl = hf_score(torch, model, altered(tokens, t, vocab), b, t, "cpu")
    table.compare("b", "ours cpu f32 vs HF cpu f32", o_cpu, h_cpu, l_cpu, hl_cpu)
    if not a.no_cuda:
        o_gpu, l_gpu, _ = ours(a.hf_logits, hf_dir, tok_path, b, t, os.path.join(w, "ours_cuda.safetensors"), "cuda", "f32", tokens)
        model = model.to("cuda")
        force_pure_pytorch(mm)
        h_gpu, hl_gpu = hf_score(torch, model, tokens, b, t, "cuda")
        table.compare("b", "ours cuda f32 vs HF cpu f32", o_gpu, h_cpu, l_gpu, hl_cpu)
        table.compare("b", "ours cuda f32 vs HF cuda f32", o_gpu, h_gpu, l_gpu, hl_gpu)
        table.compare("b", "HF cuda f32 vs HF cpu f32", h_gpu, h_cpu, hl_gpu, hl_cpu)
    table.compare("b", "ours cpu f32 vs HF, 1 token altered", o_cpu, h_ctl, l_cpu, hl_ctl, kind="control")
    table.compare("b", "ours cpu f32 vs ours f64", o_cpu, o_f64, l_cpu, l_f64, kind="info")
    table.compare("b", "HF cpu f32 vs ours f64", h_cpu, o_f64, hl_cpu, l_f64, kind="info")
    if a.py_ref:
        cfgj, weights = read_hf_dir(hf_dir)
        p, pl = py_forward(cfgj, weights, tokens, b, t)
        table.compare("b", "ours f64 vs Python f64 (slow path)", o_f64, p, l_f64, pl, kind="info")


def check_loaded_bits(torch, model, ck, what, table):
    """Every tensor of `ck`'s model.safetensors must be in the loaded model
    bit for bit: from_pretrained must neither skip nor re-initialise one.
    A difference fails the run naming the tensors (the logits would only
    say that something differs)."""
    saved, _ = read_safetensors(os.path.join(ck, "model.safetensors"))
    held = model.state_dict()
    differ = []
    for name, (dtype, shape, data) in sorted(saved.items()):
        if name not in held:
            differ.append(f"{name} (not in the model)")
            continue
        got = held[name].detach().float().cpu().reshape(-1)
        want = torch.frombuffer(bytearray(array.array("f", data).tobytes()), dtype=torch.float32)
        if list(held[name].shape) != shape or not torch.equal(got, want):
            d = (got - want).abs().max().item() if got.numel() == want.numel() else float("nan")
            differ.append(f"{name} (max |d| {d:.3g})")
    if differ:
        table.failed.append(f"{what} transformers holds other values than the file for: " + ", ".join(differ))
        print(f"{what} FAIL: after from_pretrained, {len(differ)} of {len(saved)} tensors differ from "
              f"{ck}/model.safetensors: {', '.join(differ)}")
    else:
        print(f"{what} every one of the {len(saved)} tensors in the file is in the loaded model bit for bit")


def load_mamba2(ck, what):
    """transformers' Mamba2ForCausalLM from `ck`, every key loaded, head tied."""
    import torch
    from transformers import Mamba2ForCausalLM
    from transformers.models.mamba2 import modeling_mamba2

    model, info = Mamba2ForCausalLM.from_pretrained(ck, output_loading_info=True)
    force_pure_pytorch(modeling_mamba2)
    model = model.float().eval()
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    bad = {k: v for k, v in (("missing", missing), ("unexpected", info["unexpected_keys"]),
                             ("mismatched", info["mismatched_keys"])) if v}
    if bad:
        raise SetupError(f"{what} transformers did not load every tensor of {ck}: {bad}")
    if not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight):
        raise SetupError(f"{what} transformers' lm_head is not tied to the embedding")
    return model


def hf_rows(a, table, torch, part, model, tokens, b, t, vocab, o_cpu, l_cpu, o_f64, l_f64, ck, tok_path, w):
    """The comparison rows of a Mamba-2 part: ours on the CPU and (unless
    --no-cuda) on CUDA (`ck` scored from `tok_path`, files into `w`) against
    transformers on the CPU and the GPU, transformers' two devices against
    each other, the one-token control and the f64 info rows."""
    from transformers.models.mamba2 import modeling_mamba2

    h_cpu, hl_cpu = hf_score(torch, model, tokens, b, t, "cpu")
    h_ctl, hl_ctl = hf_score(torch, model, altered(tokens, t, vocab), b, t, "cpu")
    table.compare(part, "ours cpu f32 vs HF cpu f32", o_cpu, h_cpu, l_cpu, hl_cpu)
    if not a.no_cuda:
        o_gpu, l_gpu, _ = ours(a.hf_logits, ck, tok_path, b, t, os.path.join(w, "ours_cuda.safetensors"), "cuda", "f32", tokens)
        model = model.to("cuda")
        force_pure_pytorch(modeling_mamba2)
        h_gpu, hl_gpu = hf_score(torch, model, tokens, b, t, "cuda")
        table.compare(part, "ours cpu f32 vs HF cuda f32", o_cpu, h_gpu, l_cpu, hl_gpu)
        table.compare(part, "ours cuda f32 vs HF cpu f32", o_gpu, h_cpu, l_gpu, hl_cpu)
        table.compare(part, "ours cuda f32 vs HF cuda f32", o_gpu, h_gpu, l_gpu, hl_gpu)
        table.compare(part, "HF cuda f32 vs HF cpu f32", h_gpu, h_cpu, hl_gpu, hl_cpu)
        table.compare(part, "ours cuda f32 vs ours f64", o_gpu, o_f64, l_gpu, l_f64, kind="info")
        table.compare(part, "HF cuda f32 vs ours f64", h_gpu, o_f64, hl_gpu, l_f64, kind="info")
    table.compare(part, "ours cpu f32 vs HF, 1 token altered", o_cpu, h_ctl, l_cpu, hl_ctl, kind="control")
    table.compare(part, "ours cpu f32 vs ours f64", o_cpu, o_f64, l_cpu, l_f64, kind="info")
    table.compare(part, "HF cpu f32 vs ours f64", h_cpu, o_f64, hl_cpu, l_f64, kind="info")


def part_c(a, table, torch):
    """(c) ours -> HF, Mamba-2: our CLI trains `--arch mamba2`, transformers'
    Mamba2ForCausalLM loads the checkpoint and scores the same tokens."""
    w = os.path.join(a.work, "c")
    os.makedirs(w, exist_ok=True)
    ck = train_ours(a.mamba_train, os.path.join(w, "run"), a.steps, 64, 62, a.seed, MAMBA2_FLAGS)
    cfg, _ = read_hf_dir(ck)
    if cfg.get("model_type") != "mamba2":
        raise SetupError(f"(c) {ck}: config.json model_type is {cfg.get('model_type')!r}, expected 'mamba2'")
    vocab, b, t = cfg["vocab_size"], a.batch, a.seq_len
    tokens = random_tokens(random.Random(a.seed + 3), b * t, vocab)
    tok_path = os.path.join(w, "tokens.bin")
    write_tokens(tok_path, tokens)
    o_cpu, l_cpu, _ = ours(a.hf_logits, ck, tok_path, b, t, os.path.join(w, "ours_cpu.safetensors"), "cpu", "f32", tokens)
    o_f64, l_f64, _ = ours(a.hf_logits, ck, tok_path, b, t, os.path.join(w, "ours_f64.safetensors"), "cpu", "f64", tokens)
    model = load_mamba2(ck, "(c)")
    check_loaded_bits(torch, model, ck, "(c)", table)
    c = model.config
    print(f"(c) {ck}: transformers loaded every tensor; {c.num_heads} heads x {c.head_dim}, "
          f"{c.n_groups} groups, state {c.state_size}, chunk {c.chunk_size}, "
          f"time_step_limit {tuple(c.time_step_limit)}")
    hf_rows(a, table, torch, "c", model, tokens, b, t, vocab, o_cpu, l_cpu, o_f64, l_f64, ck, tok_path, w)
    if a.py_ref:
        cfgj, weights = read_hf_dir(ck)
        p, pl = py_forward_mamba2(cfgj, weights, tokens, b, t)
        table.compare("c", "ours f64 vs Python f64 (recurrence)", o_f64, p, l_f64, pl, kind="info")


def part_d(a, table, torch):
    """(d) HF -> ours, Mamba-2: a random Mamba2ForCausalLM (its constant-
    initialised tensors perturbed) written by save_pretrained, scored by our
    hf_logits; the other spelling of the tied head must give the same bits."""
    from transformers import Mamba2Config, Mamba2ForCausalLM
    from transformers.models.mamba2 import modeling_mamba2

    w = os.path.join(a.work, "d")
    os.makedirs(w, exist_ok=True)
    cfg = Mamba2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                       conv_kernel=4, head_dim=16, num_heads=8, n_groups=2, chunk_size=32, use_bias=False,
                       use_conv_bias=True, tie_word_embeddings=True, layer_norm_epsilon=1e-5,
                       rms_norm=True, norm_before_gate=False)
    torch.manual_seed(a.seed)
    model = Mamba2ForCausalLM(cfg)
    force_pure_pytorch(modeling_mamba2)
    model = model.float().eval()
    perturb_constants(torch, model, a.seed + 1, MAMBA2_CONSTANTS)
    hf_dir = os.path.join(w, "hf")
    model.save_pretrained(hf_dir)
    other_dir, hf_cfg = other_head_spelling(hf_dir, os.path.join(w, "hf_other_head"), "(d)")
    print(f"(d) time_step_limit in config.json: {hf_cfg.get('time_step_limit')!r}")

    vocab, b, t = cfg.vocab_size, a.batch, a.seq_len
    tokens, tok_path, o_cpu, l_cpu, o_f64, l_f64 = score_saved(a, table, w, "d", hf_dir, other_dir, vocab,
                                                               random.Random(a.seed + 4))
    hf_rows(a, table, torch, "d", model, tokens, b, t, vocab, o_cpu, l_cpu, o_f64, l_f64, hf_dir, tok_path, w)
    if a.py_ref:
        cfgj, weights = read_hf_dir(hf_dir)
        p, pl = py_forward_mamba2(cfgj, weights, tokens, b, t)
        table.compare("d", "ours f64 vs Python f64 (recurrence)", o_f64, p, l_f64, pl, kind="info")


# ----------------------------------------------------------------------------
# --self-test-format: our side only, against the pure-Python reference
# ----------------------------------------------------------------------------


def f32_draws(rng):
    """u(n, s): n draws from U(-s, s); nrm(n, mean, s): n from N(mean, s);
    each rounded to f32."""
    def u(n, s):
        return [f32(rng.uniform(-s, s)) for _ in range(n)]

    def nrm(n, mean, s):
        return [f32(rng.gauss(mean, s)) for _ in range(n)]

    return u, nrm


def write_hf_style_dir(d, cfg, tensors, rng):
    """config.json and model.safetensors (tensors in shuffled order, the
    `format: pt` metadata transformers writes) in directory d."""
    names = list(tensors)
    rng.shuffle(names)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_safetensors(os.path.join(d, "model.safetensors"), {k: tensors[k] for k in names}, {"format": "pt"})


def synthetic_hf_dir(d, rng, store_head=True, eps=1e-5, head_noise=False):
    """A transformers-style directory with random f32 weights: non-default
    conv_kernel 3 and time_step_rank 3, tensors in shuffled order, the tied
    head stored (optionally not equal to the embedding)."""
    D, L, N, K, R, V, expand = 24, 2, 8, 3, 3, 20, 2
    E = expand * D
    cfg = {
        "architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": V, "hidden_size": D,
        "state_size": N, "num_hidden_layers": L, "layer_norm_epsilon": eps, "expand": expand,
        "conv_kernel": K, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
        "initializer_range": 0.1, "residual_in_fp32": True, "time_step_rank": R, "time_step_scale": 1.0,
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_init_scheme": "random",
        "time_step_floor": 0.0001, "rescale_prenorm_residual": False, "use_cache": True, "use_mambapy": False,
        "intermediate_size": E, "tie_word_embeddings": True, "dtype": "float32",
        "transformers_version": "5.17.0 (imitated by hf_crosscheck.py)", "bos_token_id": 0, "eos_token_id": 0,
        "pad_token_id": 0,
    }

    u, nrm = f32_draws(rng)

    t = {"backbone.embeddings.weight": ("F32", [V, D], nrm(V * D, 0.0, 0.5))}
    for i in range(L):
        p = f"backbone.layers.{i}."
        dt = [math.exp(rng.uniform(math.log(1e-3), math.log(1e-1))) for _ in range(E)]
        t.update({
            p + "norm.weight": ("F32", [D], nrm(D, 1.0, 0.1)),
            p + "mixer.in_proj.weight": ("F32", [2 * E, D], u(2 * E * D, D ** -0.5)),
            p + "mixer.conv1d.weight": ("F32", [E, 1, K], u(E * K, 0.5)),
            p + "mixer.conv1d.bias": ("F32", [E], nrm(E, 0.0, 0.1)),
            p + "mixer.x_proj.weight": ("F32", [R + 2 * N, E], u((R + 2 * N) * E, E ** -0.5)),
            p + "mixer.dt_proj.weight": ("F32", [E, R], u(E * R, R ** -0.5)),
            p + "mixer.dt_proj.bias": ("F32", [E], [f32(x + math.log(-math.expm1(-x))) for x in dt]),
            p + "mixer.A_log": ("F32", [E, N], [f32(math.log(n + 1) + rng.gauss(0, 0.05)) for _ in range(E) for n in range(N)]),
            p + "mixer.D": ("F32", [E], nrm(E, 1.0, 0.1)),
            p + "mixer.out_proj.weight": ("F32", [D, E], u(D * E, E ** -0.5)),
        })
    t["backbone.norm_f.weight"] = ("F32", [D], nrm(D, 1.0, 0.1))
    if store_head:
        emb = list(t["backbone.embeddings.weight"][2])
        if head_noise:
            emb[0] = f32(emb[0] + 0.25)
        t["lm_head.weight"] = ("F32", [V, D], emb)
    write_hf_style_dir(d, cfg, t, rng)
    return V


def synthetic_hf_dir_mamba2(d, rng):
    """A transformers-style Mamba-2 directory with random f32 weights: 3
    heads of 8 channels in 3 groups, d_state 4, conv_kernel 3, chunks of 8
    (so a sequence of 21 ends in a partial chunk), the default
    time_step_limit written as Python's json writes it (a bare Infinity),
    tensors in shuffled order, the tied head stored."""
    D, L, N, K, V, expand, P, G, Q = 12, 2, 4, 3, 17, 2, 8, 3, 8
    E = expand * D
    H = E // P
    cfg = {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "vocab_size": V, "hidden_size": D,
        "state_size": N, "num_hidden_layers": L, "layer_norm_epsilon": 1e-5, "expand": expand,
        "conv_kernel": K, "num_heads": H, "head_dim": P, "n_groups": G, "chunk_size": Q,
        "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "rms_norm": True,
        "norm_before_gate": False, "residual_in_fp32": True, "time_step_rank": "auto",
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 0.0001,
        "time_step_limit": [0.0, float("inf")], "initializer_range": 0.1, "rescale_prenorm_residual": False,
        "tie_word_embeddings": True, "use_cache": True, "dtype": "float32",
        "transformers_version": "5.17.0 (imitated by hf_crosscheck.py)", "bos_token_id": 0, "eos_token_id": 0,
        "pad_token_id": 0,
    }

    u, nrm = f32_draws(rng)

    CI = E + 2 * G * N
    t = {"backbone.embeddings.weight": ("F32", [V, D], nrm(V * D, 0.0, 0.5))}
    for i in range(L):
        p = f"backbone.layers.{i}."
        dt = [math.exp(rng.uniform(math.log(1e-3), math.log(1e-1))) for _ in range(H)]
        t.update({
            p + "norm.weight": ("F32", [D], nrm(D, 1.0, 0.1)),
            p + "mixer.in_proj.weight": ("F32", [2 * E + 2 * G * N + H, D], u((2 * E + 2 * G * N + H) * D, D ** -0.5)),
            p + "mixer.conv1d.weight": ("F32", [CI, 1, K], u(CI * K, 0.5)),
            p + "mixer.conv1d.bias": ("F32", [CI], nrm(CI, 0.0, 0.1)),
            p + "mixer.dt_bias": ("F32", [H], [f32(x + math.log(-math.expm1(-x))) for x in dt]),
            p + "mixer.A_log": ("F32", [H], [f32(math.log(h + 1) + rng.gauss(0, 0.05)) for h in range(H)]),
            p + "mixer.D": ("F32", [H], nrm(H, 1.0, 0.1)),
            p + "mixer.norm.weight": ("F32", [E], nrm(E, 1.0, 0.1)),
            p + "mixer.out_proj.weight": ("F32", [D, E], u(D * E, E ** -0.5)),
        })
    t["backbone.norm_f.weight"] = ("F32", [D], nrm(D, 1.0, 0.1))
    t["lm_head.weight"] = ("F32", [V, D], list(t["backbone.embeddings.weight"][2]))
    write_hf_style_dir(d, cfg, t, rng)
    return V


def expect_refusal(cmd, needle, what):
    p = run_cmd(cmd, what, expect_ok=False)
    msg = p.stdout + p.stderr
    if p.returncode == 0 or needle not in msg:
        raise SetupError(f"{what}: expected a failure mentioning {needle!r}, got exit {p.returncode}:\n{msg[-2000:]}")
    print(f"  refused as expected: {msg.strip().splitlines()[-1]}")


def self_check_trained(a, table, w, rng, b, t, label, extra=()):
    """Ours -> reference: a checkpoint our CLI trains (`extra` flags pick the
    architecture), scored by hf_logits in f32 and f64 against the Python f64
    reference of its architecture, with a one-token negative control. Rows
    are named `{label}trained: ...`."""
    tag = label.strip().replace(" ", "_")
    ck = train_ours(a.mamba_train, os.path.join(w, f"run{tag}"), 5, 16, 6, a.seed, extra)
    cfg, weights = read_hf_dir(ck)
    tokens = random_tokens(rng, b * t, cfg["vocab_size"])
    tok = os.path.join(w, f"tokens_run{tag}.bin")
    write_tokens(tok, tokens)
    o, lo, _ = ours(a.hf_logits, ck, tok, b, t, os.path.join(w, f"run{tag}_cpu.safetensors"), "cpu", "f32", tokens)
    o64, lo64, _ = ours(a.hf_logits, ck, tok, b, t, os.path.join(w, f"run{tag}_f64.safetensors"), "cpu", "f64", tokens)
    p, pl = py_reference(cfg, weights, tokens, b, t)
    table.compare("self", f"{label}trained: ours cpu f32 vs Python f64", o, p, lo, pl)
    table.compare("self", f"{label}trained: ours f64 vs Python f64", o64, p, lo64, pl)
    pa, pla = py_reference(cfg, weights, altered(tokens, t, cfg["vocab_size"]), b, t)
    table.compare("self", f"{label}trained: ours vs Python, 1 token altered", o, pa, lo, pla, kind="control")


def self_check_hf_dir(a, table, w, rng, b, t, label, make):
    """Reference -> ours: a transformers-style directory `make` writes,
    scored by hf_logits against the Python f64 reference. Returns the
    directory and its token file (for the refusals)."""
    tag = label.strip().replace(" ", "_")
    hf = os.path.join(w, f"hf{tag}")
    vocab = make(hf, rng)
    cfg, weights = read_hf_dir(hf)
    tokens = random_tokens(rng, b * t, vocab)
    tok = os.path.join(w, f"tokens_hf{tag}.bin")
    write_tokens(tok, tokens)
    o, lo, v = ours(a.hf_logits, hf, tok, b, t, os.path.join(w, f"hf{tag}_cpu.safetensors"), "cpu", "f32", tokens)
    if v != vocab:
        raise SetupError(f"hf_logits reported vocabulary {v}, the directory has {vocab}")
    p, pl = py_reference(cfg, weights, tokens, b, t)
    table.compare("self", f"{label}HF-style dir: ours cpu f32 vs Python f64", o, p, lo, pl)
    return hf, tok


def self_test(a, table):
    w = os.path.join(a.work, "selftest")
    os.makedirs(w, exist_ok=True)
    rng = random.Random(a.seed)
    b, t = 2, 21  # T not a multiple of the CUDA scan's chunk of 16

    # Ours -> reference and reference -> ours, Mamba-1 (transformers' slow
    # path) and Mamba-2 (the plain recurrence, no chunks).
    self_check_trained(a, table, w, rng, b, t, "")
    hf, tok = self_check_hf_dir(a, table, w, rng, b, t, "", synthetic_hf_dir)
    self_check_trained(a, table, w, rng, b, t, "mamba2 ",
                       ["--arch", "mamba2", "--head-dim", 8, "--n-groups", 2, "--chunk-size", 8, "--d-state", 4])
    self_check_hf_dir(a, table, w, rng, b, t, "mamba2 ", synthetic_hf_dir_mamba2)

    # Refusals.
    bad_head = os.path.join(w, "hf_bad_head")
    synthetic_hf_dir(bad_head, random.Random(1), head_noise=True)
    expect_refusal([a.hf_logits, "--checkpoint", bad_head, "--tokens", tok, "--batch", b, "--seq-len", t,
                    "--out", os.path.join(w, "x.safetensors")], "lm_head.weight differs", "untied lm_head")
    bad_eps = os.path.join(w, "hf_bad_eps")
    synthetic_hf_dir(bad_eps, random.Random(1), eps=1e-6)
    expect_refusal([a.hf_logits, "--checkpoint", bad_eps, "--tokens", tok, "--batch", b, "--seq-len", t,
                    "--out", os.path.join(w, "x.safetensors")], "layer_norm_epsilon", "layer_norm_epsilon 1e-6")
    expect_refusal([a.hf_logits, "--checkpoint", hf, "--tokens", tok, "--batch", b + 1, "--seq-len", t,
                    "--out", os.path.join(w, "x.safetensors")], "expected", "token file of the wrong length")

    # The reader against a file this script wrote (every dtype it handles).
    rt = os.path.join(w, "roundtrip.safetensors")
    want = {"a": ("F32", [2, 3], [f32(x / 7) for x in range(6)]), "s": ("F64", [], [math.pi]),
            "u": ("U32", [4], [0, 1, 2 ** 32 - 1, 7])}
    write_safetensors(rt, want, {"k": "v"})
    got, meta = read_safetensors(rt)
    if meta != {"k": "v"} or any(got[k][0] != want[k][0] or got[k][1] != want[k][1] or list(got[k][2]) != want[k][2]
                                 for k in want):
        raise SetupError("safetensors round trip of this script's own reader/writer failed")
    print("safetensors reader/writer round trip: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_logits", help="our hf_logits binary (bundle: bin/hf_logits)")
    ap.add_argument("mamba_train", help="our mamba-train binary (bundle: bin/mamba-train)")
    ap.add_argument("work", help="work directory (created)")
    ap.add_argument("--self-test-format", action="store_true",
                    help="check our side against a pure-Python f64 reference; needs no torch")
    ap.add_argument("--parts", default="a,b,c,d",
                    help="main mode: a (ours -> HF), b (HF -> ours), c and d (the same for Mamba-2)")
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=50, help="(a) training steps of our model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--loss-tol", type=float, default=1e-5)
    ap.add_argument("--no-cuda", action="store_true", help="skip every CUDA run (ours and transformers')")
    ap.add_argument("--py-ref", action="store_true",
                    help="main mode: also compare against the pure-Python f64 forward (slow: tens of seconds)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    table = Table(a.atol, a.rtol, a.loss_tol)
    try:
        if a.self_test_format:
            self_test(a, table)
        else:
            torch, transformers, mm = load_torch()
            cuda = torch.cuda.is_available()
            print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
                  f"CUDA {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available'}")
            if not cuda and not a.no_cuda:
                raise SetupError("torch sees no CUDA device; run on the GPU host or pass --no-cuda")
            parts = {p.strip() for p in a.parts.split(",") if p.strip()}
            if "a" in parts:
                part_a(a, table, torch, mm)
            if "b" in parts:
                part_b(a, table, torch, mm)
            if "c" in parts:
                part_c(a, table, torch)
            if "d" in parts:
                part_d(a, table, torch)
    except SetupError as e:
        table.print()
        print(f"hf_crosscheck: SETUP ERROR: {e}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as e:
        table.print()
        print(f"hf_crosscheck: SETUP ERROR: timed out: {e}", file=sys.stderr)
        return 2
    table.print()
    if table.failed:
        print("hf_crosscheck: FAILED: " + "; ".join(table.failed))
        return 1
    checks = sum(1 for r in table.rows if r[2] != "info")
    print(f"hf_crosscheck: all {checks} checks and controls passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
