#!/usr/bin/env python3
"""Reference for bench_cuda_step: the same training step through Hugging Face
transformers' MambaForCausalLM on its pure-PyTorch path (no mamba-ssm /
causal-conv1d kernels installed), f32, TF32 off, on one GPU.

    python3 mamba-train/examples/bench_torch_step.py [--sizes small,130m,long]
        [--steps 5] [--warmup 2] [--batch B] [--seq-len T] [--json FILE]

Step = forward + loss + backward + clip_grad_norm_(1.0) + AdamW(0.9, 0.95,
eps 1e-8, weight decay 0.1), timed with CUDA events, median of --steps.
Sizes match bench_cuda_step.rs (vocabulary 50280): small = d 256 x 4 layers,
batch 8 x 1024; 130m = d 768 x 24 layers, batch 8 x 1024; long = the 130m
shape, batch 1 x 8192. A size that runs out of memory is reported as such
(rerun it with a smaller --batch and compare tokens/s).
"""
import argparse
import json
import statistics
import sys

import torch

SIZES = {
    "small": (256, 4, 8, 1024),
    "130m": (768, 24, 8, 1024),
    "long": (768, 24, 1, 8192),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,130m,long")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--json")
    a = ap.parse_args()

    from transformers import MambaConfig, MambaForCausalLM
    from transformers.models.mamba import modeling_mamba

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fast = getattr(modeling_mamba, "is_fast_path_available", None)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, "
          f"transformers fast path available: {fast}")
    rows = []
    for name in [s.strip() for s in a.sizes.split(",") if s.strip()]:
        d, layers, b, t = SIZES[name]
        b = a.batch or b
        t = a.seq_len or t
        cfg = MambaConfig(vocab_size=50280, hidden_size=d, num_hidden_layers=layers, state_size=16,
                          expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
                          layer_norm_epsilon=1e-5, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = MambaForCausalLM(cfg).cuda().float().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")

        def step():
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out.loss

        row = {"size": name, "d_model": d, "n_layer": layers, "batch": b, "seq_len": t}
        try:
            torch.cuda.reset_peak_memory_stats()
            for _ in range(a.warmup):
                step()
            times = []
            for _ in range(a.steps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                loss = step()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            ms = statistics.median(times)
            row.update(step_ms=ms, tokens_per_s=b * t / (ms / 1e3),
                       peak_bytes=torch.cuda.max_memory_allocated(), loss=float(loss))
            print(f"{name:>5}: d {d} x {layers} layers, batch {b} x {t}: step {ms:.1f} ms, "
                  f"{row['tokens_per_s']:.0f} tokens/s, peak {row['peak_bytes'] / 2**30:.2f} GiB")
        except torch.OutOfMemoryError as err:
            row.update(error=f"out of memory: {err}".splitlines()[0])
            print(f"{name:>5}: batch {b} x {t}: out of memory (rerun with a smaller --batch)")
        rows.append(row)
        del model, opt
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
