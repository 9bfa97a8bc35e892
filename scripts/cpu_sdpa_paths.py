"""What PyTorch eager runs on this CPU for ``scaled_dot_product_attention``, and how fast against its parts.

Usage: ``python scripts/cpu_sdpa_paths.py [--threads 1]`` (needs the ``train`` extra and transformers; about
a minute). The evidence behind ``app.core.fusion.rules_for_stack`` keeping the attention core unfused on a
CPU (docs/physics_and_fusion.md, "Fusion"):

1. ``torch.profiler`` of one forward + backward of SDPA per setting (training, ``requires_grad`` inputs:
   dropout 0 or 0.1, with or without a mask, causal): the SDPA implementation op it dispatched to
   (``_scaled_dot_product_flash_attention_for_cpu`` or ``_scaled_dot_product_attention_math`` with its
   ``bmm``/``_softmax``/``bernoulli_`` ops);
2. the attention implementation and dropout of the ``transformers`` models of the e2e set
   (:data:`app.profiler.e2e.ARCHITECTURES`) and the SDPA ops one training step of each dispatches to;
3. medians of 10 timings (after 3 warm-ups) of SDPA against the same chain written as separate ops
   (``q @ kᵀ · scale → softmax → dropout → @ v``), forward + backward in training and forward only in
   inference, at the e2e models' shapes.

Prints plain text; nothing is written.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

SDPA_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")


def _ops(fn: Callable[[], None]) -> dict[str, int]:
    """aten op name -> call count of one ``fn()`` under ``torch.profiler`` (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return {e.key: e.count for e in p.key_averages() if e.key.startswith("aten::")}


def _median_ms(fn: Callable[[], None], reps: int = 10) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3


def dispatch_table() -> None:
    import torch
    import torch.nn.functional as F

    print("1. SDPA dispatch in training (B, H, L, D) = (2, 4, 128, 64), forward + backward")
    for dropout in (0.0, 0.1):
        for mask, causal in ((False, False), (True, False), (False, True)):
            q, k, v = (torch.randn(2, 4, 128, 64, requires_grad=True) for _ in range(3))
            m = torch.zeros(2, 1, 128, 128) if mask else None

            def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, m: torch.Tensor | None = m,
                     dropout: float = dropout, causal: bool = causal) -> None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, is_causal=causal)
                out.sum().backward()

            ops = _ops(step)
            impl = [o for o in SDPA_OPS if f"aten::{o}" in ops]
            parts = {o: ops[f"aten::{o}"] for o in ("bmm", "_softmax", "bernoulli_") if f"aten::{o}" in ops}
            print(f"   dropout={dropout} mask={mask!s:5} causal={causal!s:5}: {impl} {parts}")


def e2e_models() -> None:
    import torch

    from app.profiler.e2e import ARCHITECTURES, build

    print("2. the e2e set's transformers models, one training step")
    for arch in ARCHITECTURES:
        if arch.builder not in ("build_bert", "build_gpt2", "build_vit"):
            continue
        b = build(arch)
        cfg = b.module.train().config
        drop = {k: getattr(cfg, k) for k in ("attention_probs_dropout_prob", "attn_pdrop") if hasattr(cfg, k)}
        data = b.make_batch(arch.batches[0])
        with torch.enable_grad():
            ops = _ops(lambda b=b, data=data: b.loss(data).backward())
        impl = {o: ops[f"aten::{o}"] for o in SDPA_OPS if f"aten::{o}" in ops}
        print(f"   {arch.name}: attn_implementation={getattr(cfg, '_attn_implementation', None)} {drop} -> {impl}")


def _timing_row(shape: tuple[int, ...]) -> dict[str, float]:
    """Median ms of SDPA and of its parts at ``shape`` ``(B, H, L, D)``: training (forward + backward, dropout
    0 and 0.1) and inference (forward, no grad)."""
    import torch
    import torch.nn.functional as F

    scale = shape[-1] ** -0.5
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    g = torch.randn(*shape)

    def sdpa(p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)

    def parts(p: float) -> torch.Tensor:
        return F.dropout(((q @ k.transpose(-1, -2)) * scale).softmax(-1), p, training=p > 0) @ v

    row: dict[str, float] = {}
    for p in (0.0, 0.1):
        for name, fn in (("sdpa", sdpa), ("parts", parts)):
            row[f"train p={p} {name}"] = _median_ms(lambda fn=fn, p=p: fn(p).backward(g))
    with torch.no_grad():
        for name, fn in (("sdpa", sdpa), ("parts", parts)):
            row[f"inference {name}"] = _median_ms(lambda fn=fn: fn(0.0))
    return row


def timings() -> None:
    print("3. SDPA against its parts (median ms; a loaded machine makes single rows noisy)")
    for shape in ((2, 4, 128, 64), (8, 4, 128, 64), (16, 4, 128, 64), (8, 6, 65, 64), (1, 12, 512, 64)):
        row = _timing_row(shape)
        print(f"   {shape}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
              + f"; sdpa/parts train p=0 {row['train p=0.0 sdpa'] / row['train p=0.0 parts']:.2f}, "
              f"inference {row['inference sdpa'] / row['inference parts']:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}")
    dispatch_table()
    e2e_models()
    timings()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
