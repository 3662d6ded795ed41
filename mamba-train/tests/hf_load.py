#!/usr/bin/env python3
"""Load a mamba-train checkpoint with Hugging Face transformers and re-score it.

Usage (on a machine with torch + transformers, e.g. the GPU host):

    python3 hf_load.py RUN_OR_CHECKPOINT_DIR [--expect-accuracy 0.917] [--eval-batches 8]

1. `MambaForCausalLM.from_pretrained(dir)` must load every tensor: no missing
   (other than the tied lm_head), unexpected or mismatched keys.
2. The held-out batches the CLI scores at the end (seed law, Domain::Eval,
   32 rows each) are regenerated here in Python, and the accuracy of the
   transformers model on the scored positions is printed; with
   --expect-accuracy it must be within 1 percentage point of the CLI's.
"""

import argparse
import json
import os
import sys

M64 = (1 << 64) - 1
DOMAIN_EVAL = 0x1A17_0000_0000_0003
EVAL_ROWS = 32
IGNORE = -100


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def derive(master, domain, path):
    h = splitmix64(master ^ domain)
    for p in path:
        h = splitmix64(h ^ splitmix64((p + 0x632BE59BD9B4E019) & M64))
    return h


class Rng:
    def __init__(self, seed):
        self.state = seed

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def below(self, n):
        zone = M64 - (M64 % n)
        while True:
            v = self.next_u64()
            if v < zone:
                return v % n


def selective_copy_row(task, rng):
    t, k, alphabet = task["seq_len"], task["n_memorize"], task["alphabet"]
    content = t - k
    tokens, targets = [0] * t, [IGNORE] * t
    pos = list(range(content))
    for i in range(k):
        j = i + rng.below(content - i)
        pos[i], pos[j] = pos[j], pos[i]
    for j, p in enumerate(sorted(pos[:k])):
        tok = 2 + rng.below(alphabet)
        tokens[p] = tok
        tokens[content + j] = 1
        targets[content + j] = tok
    return tokens, targets


def induction_row(task, rng):
    t, alphabet = task["seq_len"], task["alphabet"]
    tokens = [rng.below(alphabet) for _ in range(t)]
    targets = [IGNORE] * t
    p = rng.below(t - 2)
    tokens[p] = alphabet
    answer = tokens[p + 1]
    tokens[t - 1] = alphabet
    targets[t - 1] = answer
    return tokens, targets


def resolve(path):
    if os.path.isfile(os.path.join(path, "state.json")):
        return path
    for root in (os.path.join(path, "checkpoints"), path):
        latest = os.path.join(root, "LATEST")
        if os.path.isfile(latest):
            with open(latest) as f:
                return os.path.join(root, f.read().strip())
    sys.exit(f"no checkpoint in {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--expect-accuracy", type=float)
    args = ap.parse_args()

    import torch
    from transformers import MambaForCausalLM

    ck = resolve(args.path)
    with open(os.path.join(ck, "state.json")) as f:
        state = json.load(f)
    model, info = MambaForCausalLM.from_pretrained(ck, output_loading_info=True)
    model.eval()
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    bad = {"missing": missing, "unexpected": info["unexpected_keys"], "mismatched": info["mismatched_keys"]}
    if any(bad.values()):
        sys.exit(f"FAIL: transformers did not load every tensor: {bad}")
    emb = model.get_input_embeddings().weight
    if not torch.equal(model.lm_head.weight, emb):
        sys.exit("FAIL: lm_head is not tied to the embedding")
    print(f"loaded {ck}: {sum(p.numel() for p in model.parameters())} parameters, all keys matched")

    task = state["task"]
    row_fn = {"selective-copy": selective_copy_row, "induction": induction_row}.get(task["kind"])
    if row_fn is None:
        print(f"task {task['kind']}: no accuracy re-check (only synthetic tasks)")
        return
    correct = total = 0
    with torch.no_grad():
        for index in range(args.eval_batches):
            rows = [row_fn(task, Rng(derive(state["seed"], DOMAIN_EVAL, [index, r]))) for r in range(EVAL_ROWS)]
            tokens = torch.tensor([r[0] for r in rows])
            targets = torch.tensor([r[1] for r in rows])
            pred = model(input_ids=tokens).logits.argmax(-1)
            scored = targets != IGNORE
            correct += int((pred[scored] == targets[scored]).sum())
            total += int(scored.sum())
    acc = correct / total
    print(f"transformers accuracy: {100 * acc:.1f}% on {total} held-out positions")
    if args.expect_accuracy is not None and abs(acc - args.expect_accuracy) > 0.01:
        sys.exit(f"FAIL: expected {100 * args.expect_accuracy:.1f}% (the CLI's), got {100 * acc:.1f}%")


if __name__ == "__main__":
    main()
