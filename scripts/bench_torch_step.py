#!/usr/bin/env python3
"""Reference for bench_cuda_step: the same training step through Hugging Face
transformers' MambaForCausalLM on its pure-PyTorch path, f32, TF32 off, on
one GPU; and the side-by-side report of the two.

    python3 bench_torch_step.py [--sizes small,130m,long] [--steps 5]
        [--warmup 1] [--batch B] [--seq-len T] [--budget-s 60] [--no-shrink]
        [--json FILE]
    python3 bench_torch_step.py --report OURS.jsonl TORCH.jsonl

--report reads bench_cuda_step's rows (one per size and precision; the
bench train commands run f32, tf32 and bf16) and puts each beside this
script's f32 row of the same size, then prints the precision issue's goals
at the 130m shape.

The step is bench_cuda_step's: forward, mean next-token cross-entropy over
the B x (T - 1) positions with a successor (labels = input_ids), backward,
global-norm clipping at 1.0, AdamW (beta 0.9 / 0.95, eps 1e-8, weight decay
0.1 on matrices and the embedding, none on norms, biases, A_log and D, as
ours), zeroing the gradients. Timed with CUDA events after warm-up; the
median of the timed steps. Sizes match bench_cuda_step.rs (vocabulary
50280): small = d 256 x 4 layers, batch 8 x 1024; 130m = d 768 x 24 layers,
batch 8 x 1024; long = the 130m shape, batch 1 x 8192.

The pure-PyTorch path: without the mamba-ssm / causal-conv1d kernels (none
are installed on the GPU hosts, and this script clears and blocks them), a
MambaMixer runs slow_forward, a Python loop over the T positions that keeps
the (B, d_inner, T, d_state) discretised tensors for backward. Two
consequences, both reported in the output: a step takes seconds, so after
warm-up the number of timed steps is cut to fit --budget-s per size (at
least one); and it needs far more memory than ours, so a size that runs out
of memory is retried with half the batch (down to 1) unless --no-shrink. A
shrunk row has another batch than ours; compare tokens/s then (--report
does).

--report prints the side-by-side table (plain and markdown) from
bench_cuda_step's --json and this script's --json: step time, tokens/s and
peak memory of each, the tokens/s ratio ours / PyTorch, and ours over its
floor. It needs no GPU. `cargo xtask bench train` runs all three.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import force_pure_pytorch, strict_f32  # noqa: E402

SIZES = {
    "small": (256, 4, 8, 1024),
    "130m": (768, 24, 8, 1024),
    "long": (768, 24, 1, 8192),
}
VOCAB = 50280


def no_decay(name):
    """Parameters ours never decays (mamba_train::params::ParamKind::NoDecay)."""
    return name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".bias") \
        or name.endswith("A_log") or name.endswith(".D")


def measure(torch, mm, name, d, layers, b, t, a):
    """One size at batch b; returns the result row or raises torch.OutOfMemoryError."""
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=d, num_hidden_layers=layers, state_size=16,
                      expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
                      layer_norm_epsilon=1e-5, tie_word_embeddings=True, use_mambapy=False)
    # Peak memory counts from here, model and optimizer state included, as
    # bench_cuda_step's high-water mark does.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = MambaForCausalLM(cfg)
    fast = force_pure_pytorch(mm)
    model = model.cuda().float().train()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.1},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    ids = torch.randint(0, VOCAB, (b, t), device="cuda")
    params = [p for _, p in named]

    def step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    try:
        t0 = time.time()
        for _ in range(max(1, a.warmup)):
            step()
        torch.cuda.synchronize()
        per = (time.time() - t0) / max(1, a.warmup)
        n = max(1, min(a.steps, int(a.budget_s / max(per, 1e-9))))
        times = []
        loss = None
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            loss = step()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        ms = statistics.median(times)
        return {
            "size": name, "d_model": d, "n_layer": layers, "vocab": VOCAB, "batch": b, "seq_len": t,
            "step_ms": ms, "tokens_per_s": b * t / (ms / 1e3), "timed_steps": n,
            "peak_bytes": torch.cuda.max_memory_allocated() - base, "loss": float(loss),
            "fast_kernels_present": any(fast.values()), "path": "transformers slow_forward (pure PyTorch)",
        }
    finally:
        del model, opt, ids, params, named, groups


def bench(a):
    import torch
    from transformers.models.mamba import modeling_mamba as mm

    f32 = strict_f32(torch)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {torch.cuda.get_device_name(0)}; "
          f"f32 ({f32}), pure-PyTorch path (fast kernels blocked)", flush=True)
    rows = []
    for name in [s.strip() for s in a.sizes.split(",") if s.strip()]:
        if name not in SIZES:
            print(f"unknown size {name!r}; expected one of {', '.join(SIZES)}", file=sys.stderr)
            return 2
        d, layers, b0, t0 = SIZES[name]
        b, t = a.batch or b0, a.seq_len or t0
        row = None
        while row is None:
            oom = None
            try:
                row = measure(torch, mm, name, d, layers, b, t, a)
            except torch.OutOfMemoryError as err:
                oom = str(err).splitlines()[0]
            torch.cuda.empty_cache()
            if oom is None:
                break
            if a.no_shrink or b == 1:
                row = {"size": name, "d_model": d, "n_layer": layers, "vocab": VOCAB, "batch": b, "seq_len": t,
                       "error": f"out of memory at batch {b}: {oom}"}
                print(f"{name:>5}: batch {b} x {t}: out of memory", flush=True)
                break
            print(f"{name:>5}: batch {b} x {t}: out of memory; retrying with batch {b // 2}", flush=True)
            b //= 2
        if "error" not in row:
            row["requested_batch"] = a.batch or b0
            print(f"{name:>5}: d {d} x {layers} layers, batch {b} x {t}: step {row['step_ms']:.1f} ms "
                  f"(median of {row['timed_steps']}), {row['tokens_per_s']:.0f} tokens/s, "
                  f"peak {row['peak_bytes'] / 2**30:.2f} GiB, loss {row['loss']:.4f}", flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def failure(row):
    e = row.get("error", "failed")
    return "out of memory" if "out of memory" in e else e[:30]


def precision(row):
    """A row's precision (rows from before --precision were f32)."""
    return row.get("precision", "f32")


def variant(row):
    """What tells apart our rows of one size: the precision, and whether
    the run recomputed its activations (--recompute)."""
    return precision(row) + (" recompute" if row.get("recompute") else "")


def report_rows(ours, torch_rows):
    """Side-by-side rows: each of ours (a size in one precision) beside
    PyTorch's f32 run of that size, in ours' order, then sizes only PyTorch
    ran."""
    by = {r["size"]: r for r in torch_rows}
    order = [(r["size"], variant(r)) for r in ours]
    order += [(r["size"], None) for r in torch_rows if r["size"] not in {o["size"] for o in ours}]
    mine = {(r["size"], variant(r)): r for r in ours}
    out = []
    for s, prec in order:
        o, p = mine.get((s, prec)), by.get(s)
        gib = lambda r: f"{r['peak_bytes'] / 2**30:.2f}" if r and "peak_bytes" in r else "-"
        shape = lambda r: f"{r['batch']}x{r['seq_len']}" if r else "-"
        ok_o = o is not None and "step_ms" in o
        ok_p = p is not None and "step_ms" in p
        ratio = f"{o['tokens_per_s'] / p['tokens_per_s']:.1f}x" if ok_o and ok_p else "-"
        same = ok_o and ok_p and o["batch"] == p["batch"] and o["seq_len"] == p["seq_len"]
        out.append([
            s, prec or "-",
            shape(o), f"{o['step_ms']:.2f}" if ok_o else "-", f"{o['tokens_per_s']:.0f}" if ok_o else "-",
            f"{o['step_over_floor']:.2f}" if ok_o and "step_over_floor" in o else "-", gib(o),
            shape(p), f"{p['step_ms']:.1f}" if ok_p else (failure(p) if p else "not run"),
            f"{p['tokens_per_s']:.0f}" if ok_p else "-", gib(p),
            ratio + ("" if same or ratio == "-" else " (tokens/s; batches differ)"),
        ])
    return out


HEADER = ["size", "ours run", "ours BxT", "ours ms", "ours tok/s", "ours/floor", "ours GiB",
          "torch f32 BxT", "torch ms", "torch tok/s", "torch GiB", "speedup (tok/s)"]

# The precision issue's goals at the 130m shape (batch 8 x 1024, one H200):
# step time per precision, each within 2.5x of its floor, memory <= 8 GiB.
STEP_GOAL_MS = {"bf16": 30.0, "tf32": 60.0, "f32": 180.0}
FLOOR_GOAL = 2.5
MEMORY_GOAL_GIB = 8.0


def goals(ours, torch_rows):
    """The goals, where the rows allow a verdict."""
    by = {r["size"]: r for r in torch_rows if "tokens_per_s" in r}
    lines = []
    verdict = lambda ok: "meets" if ok else "misses"
    for o in ours:
        if "step_over_floor" not in o:
            continue
        name, prec, f = o["size"], precision(o), o["step_over_floor"]
        line = f"{name} {prec}: step/floor {f:.2f} ({verdict(f <= FLOOR_GOAL)} <= {FLOOR_GOAL})"
        if name == "130m" and o.get("batch") == 8 and o.get("seq_len") == 1024:
            if prec in STEP_GOAL_MS:
                g = STEP_GOAL_MS[prec]
                line += f"; step {o['step_ms']:.1f} ms ({verdict(o['step_ms'] <= g)} <= {g:.0f} ms)"
            if "peak_bytes" in o:
                gib = o["peak_bytes"] / 2**30
                extra = ", with --recompute" if o.get("recompute") else ""
                line += f"; memory {gib:.2f} GiB{extra} ({verdict(gib <= MEMORY_GOAL_GIB)} <= {MEMORY_GOAL_GIB:.0f} GiB)"
        lines.append(line)
    for o in ours:
        if o["size"] == "130m" and "tokens_per_s" in o and "130m" in by:
            x = o["tokens_per_s"] / by["130m"]["tokens_per_s"]
            lines.append(f"130m {precision(o)}: ours / PyTorch f32 {x:.1f}x in tokens/s")
    return lines


def print_report(rows):
    w = [max(len(str(r[i])) for r in rows + [HEADER]) for i in range(len(HEADER))]
    print("  ".join(h.ljust(n) for h, n in zip(HEADER, w)))
    for r in rows:
        print("  ".join(str(c).ljust(n) for c, n in zip(r, w)))
    print()
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="small,130m,long")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (at most; see --budget-s)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="seconds of timed steps per size; fewer steps when one is slow (at least 1)")
    ap.add_argument("--no-shrink", action="store_true", help="report out of memory instead of halving the batch")
    ap.add_argument("--json")
    ap.add_argument("--report", nargs=2, metavar=("OURS_JSONL", "TORCH_JSONL"),
                    help="print the side-by-side table of bench_cuda_step --json and this script's --json")
    a = ap.parse_args()
    if a.report:
        ours, torch_rows = read_jsonl(a.report[0]), read_jsonl(a.report[1])
        print_report(report_rows(ours, torch_rows))
        print()
        for line in goals(ours, torch_rows):
            print(line)
        return 0
    return bench(a)


if __name__ == "__main__":
    sys.exit(main())
