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

--self-test-format (no torch needed; runs on the development machines):
checks our side of the plumbing against an independent pure-Python f64
Mamba forward written from transformers' slow path: a checkpoint trained by
our CLI, and a transformers-style directory written here (config.json with
non-default conv_kernel and time_step_rank, shuffled tensor order, a stored
tied lm_head.weight), both scored by hf_logits and compared in the same
table; plus the refusals: an lm_head that differs from the embedding, a
layer_norm_epsilon that is not 1e-5, a token file of the wrong length.

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


def train_ours(mamba_train, run_dir, steps, d_model, alphabet, seed):
    """A small selective-copy model trained on the CPU; returns the checkpoint dir."""
    run_cmd([mamba_train, "train", "--device", "cpu", "--steps", steps, "--d-model", d_model, "--layers", 2,
             "--batch", 8, "--seq-len", 48, "--memorize", 8, "--alphabet", alphabet, "--seed", seed,
             "--eval-batches", 1, "--out", run_dir], "mamba-train train")
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
        _, shape, a = weights[name]
        if math.prod(shape) != n_rows * n_cols:
            raise SetupError(f"tensor {name} has shape {shape}, expected {n_rows} x {n_cols} elements")
        return [list(a[i * n_cols : (i + 1) * n_cols]) for i in range(n_rows)]

    def vec(name, n):
        return rows(name, 1, n)[0]

    def matvec(m, x):
        return [sum(w * v for w, v in zip(row, x)) for row in m]

    def rms(x, w):
        s = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
        return [wi * v * s for wi, v in zip(w, x)]

    def silu(x):
        return x / (1.0 + math.exp(-x)) if x > -700 else 0.0

    def softplus(x):
        return x if x > 20.0 else math.log1p(math.exp(x))

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
        for s in range(t):
            lg = matvec(emb, rms(xs[s], norm_f))
            logits.extend(lg)
            if s + 1 < t:
                m = max(lg)
                total += m + math.log(sum(math.exp(v - m) for v in lg)) - lg[toks[s + 1]]
                count += 1
    return logits, (total / count if count else 0.0)


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
    g = torch.Generator().manual_seed(a.seed + 1)

    def noise(p, s):
        p.add_(s * torch.randn(p.shape, generator=g, dtype=p.dtype))

    with torch.no_grad():
        for layer in model.backbone.layers:
            noise(layer.norm.weight, 0.1)
            noise(layer.mixer.D, 0.1)
            noise(layer.mixer.conv1d.bias, 0.1)
            noise(layer.mixer.A_log, 0.05)
        noise(model.backbone.norm_f.weight, 0.1)
    hf_dir = os.path.join(w, "hf")
    model.save_pretrained(hf_dir)
    saved, meta = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    head_stored = "lm_head.weight" in saved
    print(f"(b) save_pretrained wrote {len(saved)} tensors to {hf_dir} "
          f"(lm_head.weight {'stored' if head_stored else 'not stored (tied)'}), metadata {meta}")
    # The other spelling of a tied head, which our loader must also take.
    other_dir = os.path.join(w, "hf_other_head")
    os.makedirs(other_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    with open(os.path.join(other_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    other = {k: v for k, v in saved.items() if k != "lm_head.weight"}
    if not head_stored:
        other["lm_head.weight"] = saved["backbone.embeddings.weight"]
    write_safetensors(os.path.join(other_dir, "model.safetensors"), other, {"format": "pt"})

    vocab, b, t = cfg.vocab_size, a.batch, a.seq_len
    rng = random.Random(a.seed + 2)
    tokens = random_tokens(rng, b * t, vocab)
    tok_path = os.path.join(w, "tokens.bin")
    write_tokens(tok_path, tokens)
    o_cpu, l_cpu, _ = ours(a.hf_logits, hf_dir, tok_path, b, t, os.path.join(w, "ours_cpu.safetensors"), "cpu", "f32", tokens)
    o_oth, l_oth, _ = ours(a.hf_logits, other_dir, tok_path, b, t, os.path.join(w, "ours_other.safetensors"), "cpu", "f32", tokens)
    o_f64, l_f64, _ = ours(a.hf_logits, hf_dir, tok_path, b, t, os.path.join(w, "ours_f64.safetensors"), "cpu", "f64", tokens)
    if o_oth != o_cpu or l_oth != l_cpu:
        table.failed.append("b: the directory with the other lm_head spelling gave different logits")
        print("(b) FAIL: the two spellings of the tied head gave different results")
    else:
        print("(b) both spellings of the tied head (stored / not stored) gave the same bits")

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


# ----------------------------------------------------------------------------
# --self-test-format: our side only, against the pure-Python reference
# ----------------------------------------------------------------------------


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

    def u(n, s):
        return [f32(rng.uniform(-s, s)) for _ in range(n)]

    def nrm(n, mean, s):
        return [f32(rng.gauss(mean, s)) for _ in range(n)]

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
    names = list(t)
    rng.shuffle(names)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_safetensors(os.path.join(d, "model.safetensors"), {k: t[k] for k in names}, {"format": "pt"})
    return V


def expect_refusal(cmd, needle, what):
    p = run_cmd(cmd, what, expect_ok=False)
    msg = p.stdout + p.stderr
    if p.returncode == 0 or needle not in msg:
        raise SetupError(f"{what}: expected a failure mentioning {needle!r}, got exit {p.returncode}:\n{msg[-2000:]}")
    print(f"  refused as expected: {msg.strip().splitlines()[-1]}")


def self_test(a, table):
    w = os.path.join(a.work, "selftest")
    os.makedirs(w, exist_ok=True)
    rng = random.Random(a.seed)
    b, t = 2, 21  # T not a multiple of the CUDA scan's chunk of 16

    # Ours -> reference: a checkpoint trained by the CLI.
    ck = train_ours(a.mamba_train, os.path.join(w, "run"), 5, 16, 6, a.seed)
    cfg, weights = read_hf_dir(ck)
    tokens = random_tokens(rng, b * t, cfg["vocab_size"])
    tok = os.path.join(w, "tokens_run.bin")
    write_tokens(tok, tokens)
    o, lo, _ = ours(a.hf_logits, ck, tok, b, t, os.path.join(w, "run_cpu.safetensors"), "cpu", "f32", tokens)
    o64, lo64, _ = ours(a.hf_logits, ck, tok, b, t, os.path.join(w, "run_f64.safetensors"), "cpu", "f64", tokens)
    p, pl = py_forward(cfg, weights, tokens, b, t)
    table.compare("self", "trained: ours cpu f32 vs Python f64", o, p, lo, pl)
    table.compare("self", "trained: ours f64 vs Python f64", o64, p, lo64, pl)
    pa, pla = py_forward(cfg, weights, altered(tokens, t, cfg["vocab_size"]), b, t)
    table.compare("self", "trained: ours vs Python, 1 token altered", o, pa, lo, pla, kind="control")

    # Reference -> ours: a transformers-style directory written here.
    hf = os.path.join(w, "hf")
    vocab = synthetic_hf_dir(hf, rng)
    cfg, weights = read_hf_dir(hf)
    tokens = random_tokens(rng, b * t, vocab)
    tok = os.path.join(w, "tokens_hf.bin")
    write_tokens(tok, tokens)
    o, lo, v = ours(a.hf_logits, hf, tok, b, t, os.path.join(w, "hf_cpu.safetensors"), "cpu", "f32", tokens)
    if v != vocab:
        raise SetupError(f"hf_logits reported vocabulary {v}, the directory has {vocab}")
    p, pl = py_forward(cfg, weights, tokens, b, t)
    table.compare("self", "HF-style dir: ours cpu f32 vs Python f64", o, p, lo, pl)

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
    ap.add_argument("--parts", default="a,b", help="main mode: a (ours -> HF), b (HF -> ours)")
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
