#!/usr/bin/env python3
"""PyTorch's GPT-2 124M training step on the same GPU as ZeroTrain's, so that the ratio issue 28
asks for (ZeroTrain / torch.compile, --tf32 / PyTorch tf32) is measured in one run on one chip.

The model and step are ZeroTrain's `train --model gpt2-124m --train-seq-len 1024 --batch-size 16`
(scripts/gpu-check.sh step 4): 12 layers, 12 heads, width 768, T 1024, B 16, pre-LayerNorm blocks,
tanh GELU, LM head tied to wte, AdamW (betas 0.9/0.95, eps 1e-8, no weight decay), global gradient
norm clipped to 1.0. PyTorch runs it the way its users make it fast: bf16 autocast with fp32
parameters, F.scaled_dot_product_attention (flash attention), fused AdamW, the vocabulary padded to
50,304 rows as nanoGPT does (ZeroTrain pads its LM head the same way), torch.compile for the
"compile" mode. Each mode runs in its own process (a compile failure or an out-of-memory leaves
the other modes' numbers). tokens/s is the median of the steps after the first two, ZeroTrain's
rule (scripts/gpt2_table.py); each step is timed between two device synchronizations.

    python3 bench/peer_gpt2_torch.py [--modes bf16:compile,bf16:eager,tf32:eager] [--steps 10]
                                     [--out peer-torch.jsonl] [--device cuda]

Modes are PRECISION:MODE, PRECISION one of bf16 (autocast), tf32 (fp32 with TF32 matmuls and
convolutions allowed), fp32 (TF32 off); MODE eager or compile. The modes run in the order given
(torch.compile first by default: its cold compile takes a minute or more and its number is the one
issue 28 names, so a cut ends an eager mode instead). Prints one JSON line per mode (also appended
to --out) and a table. --tiny (2 layers, width 64, T 64, B 4) with --device cpu is
the smoke check tests/scripts/test_gpu_check_pack.sh runs where PyTorch is installed (Debian's
1.13 has neither torch.compile nor scaled_dot_product_attention: compile modes report
"unavailable", attention falls back to a masked softmax).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

GPT2 = dict(layers=12, heads=12, width=768, seq=1024, batch=16, vocab=50304)
TINY = dict(layers=2, heads=2, width=64, seq=64, batch=4, vocab=512)
PRECISIONS = ("bf16", "tf32", "fp32")
MODES = ("eager", "compile")
WARMUP = 2  # steps left out of the median, as ZeroTrain's summary and gpu-check do


def parse_mode(text):
    precision, _, mode = text.partition(":")
    if precision not in PRECISIONS or mode not in MODES:
        raise argparse.ArgumentTypeError(
            f"mode '{text}' is not PRECISION:MODE with PRECISION in {PRECISIONS} and MODE in {MODES}")
    return precision, mode


def build_model(torch, cfg):
    nn, F = torch.nn, torch.nn.functional
    sdpa = getattr(F, "scaled_dot_product_attention", None)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(cfg["width"], 3 * cfg["width"])
            self.c_proj = nn.Linear(cfg["width"], cfg["width"])

        def forward(self, x):
            B, T, C = x.shape
            nh = cfg["heads"]
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
            if sdpa is not None:
                y = sdpa(q, k, v, is_causal=True)
            else:  # PyTorch < 2.0: the same causal attention, unfused
                s = (q @ k.transpose(-2, -1)) / math.sqrt(C // nh)
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                y = s.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            w = cfg["width"]
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(w), Attention(), nn.LayerNorm(w)
            self.c_fc, self.gelu, self.c_proj = nn.Linear(w, 4 * w), nn.GELU(approximate="tanh"), nn.Linear(4 * w, w)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg["vocab"], cfg["width"])
            self.wpe = nn.Embedding(cfg["seq"], cfg["width"])
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.ln_f = nn.LayerNorm(cfg["width"])
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
                    if isinstance(m, nn.Linear):
                        nn.init.zeros_(m.bias)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # the LM head tied to wte
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    return GPT()


def run_one(precision, mode, cfg, steps, device):
    """One mode in this process: a dict with the per-step times and the median tokens/s."""
    import torch
    torch.manual_seed(0)
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
    elif precision == "tf32":
        return {"status": "unavailable", "why": "TF32 is a GPU mode"}
    if mode == "compile" and not hasattr(torch, "compile"):
        return {"status": "unavailable", "why": f"torch {torch.__version__} has no torch.compile"}
    model = build_model(torch, cfg).to(device)
    params = list(model.parameters())
    try:
        opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=on_cuda)
        fused = on_cuda
    except (TypeError, RuntimeError):  # an older PyTorch without fused AdamW
        opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        fused = False
    step_model = torch.compile(model) if mode == "compile" else model
    g = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randint(0, min(cfg["vocab"], 50257), (cfg["batch"], cfg["seq"] + 1), generator=g)
    x, y = idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    times, losses = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        if precision == "bf16":
            with torch.autocast(device_type="cuda" if on_cuda else "cpu", dtype=torch.bfloat16):
                loss = step_model(x, y)
        else:
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    tokens = cfg["batch"] * cfg["seq"]
    timed = times[WARMUP:] or times
    med = statistics.median(timed)
    out = {"status": "ok", "tokens_per_s": tokens / med, "step_ms": 1e3 * med, "first_step_s": times[0],
           "steps": steps, "warmup_steps": min(WARMUP, steps - 1) if steps > 1 else 0, "losses": losses,
           "fused_adamw": fused, "torch": torch.__version__}
    if on_cuda:
        out["gpu"] = torch.cuda.get_device_name()
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="bf16:compile,bf16:eager,tf32:eager",
                    help="comma-separated PRECISION:MODE list (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="steps per mode, the first 2 left out (default 10)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model at T 64, B 4 (smoke check)")
    ap.add_argument("--out", help="append one JSON line per mode to this file")
    ap.add_argument("--mode-timeout", type=float, default=240, help="seconds per mode (default 240)")
    ap.add_argument("--one", type=parse_mode, help=argparse.SUPPRESS)  # internal: run one mode here
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    try:
        modes = [parse_mode(m) for m in args.modes.split(",") if m]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    cfg = TINY if args.tiny else GPT2

    if args.one:  # the child: one mode, one JSON line on stdout
        print(json.dumps(run_one(*args.one, cfg, args.steps, args.device)))
        return 0

    try:
        import torch  # noqa: F401  (only to fail early with one sentence)
    except ImportError:
        print("peer_gpt2_torch.py: PyTorch is not installed for this Python "
              f"({sys.executable}); nothing to compare against", file=sys.stderr)
        return 3
    results = []
    for precision, mode in modes:
        rec = {"peer": "pytorch", "precision": precision, "mode": mode, "device": args.device,
               "model": "tiny" if args.tiny else "gpt2-124m", **{k: cfg[k] for k in ("batch", "seq", "vocab")}}
        cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{precision}:{mode}", "--steps", str(args.steps),
               "--device", args.device] + (["--tiny"] if args.tiny else [])
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.mode_timeout)
            lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
            if p.returncode == 0 and lines:
                rec.update(json.loads(lines[-1]))
            else:
                tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
                rec.update(status="failed", why=f"exit {p.returncode}: {tail[:300]}")
        except subprocess.TimeoutExpired:
            rec.update(status="failed", why=f"timed out after {args.mode_timeout:.0f} s")
        rec["wall_s"] = round(time.time() - t0, 1)
        results.append(rec)
        print(json.dumps(rec), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    print(f"\n| PyTorch {cfg['batch']}x{cfg['seq']} | tokens/s | step ms | first step s | status |")
    print("|---|---|---|---|---|")
    for r in results:
        ok = r.get("status") == "ok"
        print(f"| {r['precision']} {r['mode']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['first_step_s']:.1f} | ok |"
              if ok else f"| {r['precision']} {r['mode']} | - | - | - | {r.get('status')}: {r.get('why', '')} |")
    return 0 if all(r.get("status") in ("ok", "unavailable") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
