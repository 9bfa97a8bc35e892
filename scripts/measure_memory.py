"""Measure real CPU training memory with torch and compare it with layercast's analytical footprint.

Usage: ``python scripts/measure_memory.py [--out docs/memory_validation.md]`` (needs the ``train`` extra and
transformers for the BERT case; ~1 minute on 2 cores).

Method. For each model: one warm-up Adam step (so the optimizer state exists), ``zero_grad(set_to_none=
True)``, then one profiled step (forward, ``loss.backward()``, ``optimizer.step()``) under
``torch.profiler.profile(profile_memory=True)``. The profiler records every allocation and free of torch's
CPU allocator and attributes it to the op it happened in (``self_cpu_memory_usage``); ordered by op start,
their running sum is the live-bytes curve of the step (a temporary allocated and freed inside one op nets
out, so transient peaks inside a single kernel are missed).

* weights, optimizer state: exact ``nbytes`` of the parameter and state tensors (alive before the step);
* gradients: ``nbytes`` of every ``.grad`` after the step;
* activations: the live bytes at the end of the forward pass (what autograd holds for backward, plus the
  model output, which is alive at that point: 20 MiB of logits for the LSTM LM);
* peak: weights + optimizer state + the maximum of the live-bytes curve.

Limits, stated honestly: only torch tensor memory is seen (not the Python heap, oneDNN scratch buffers
allocated outside c10, or RSS/fragmentation), the fused CPU LSTM kernel's internal workspace counts as
activations, and the measurement is for fp32 on CPU: GPU kernels (cuDNN workspaces, flash attention)
save different intermediates. The estimate is layercast's ``footprint(analyze(import_onnx(...)),
mode="training", optimizer="adam")`` on a TRAINING-mode ONNX export of the same module and shapes.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.core.analysis import analyze  # noqa: E402
from app.core.memory import footprint  # noqa: E402
from app.core.onnx_import import import_onnx  # noqa: E402


def _models():
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    yield "small CNN (2 conv+BN, batch 32, 64x64)", cnn, torch.randn(32, 3, 64, 64), {}
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048),
                              torch.nn.GELU(), torch.nn.Linear(2048, 10))
    yield "MLP 1024-2048-2048-10 (batch 256)", mlp, torch.randn(256, 1024), {}

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5000, 256)
            self.rnn = torch.nn.LSTM(256, 512, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(512, 5000)

        def forward(self, x):
            return self.head(self.rnn(self.emb(x))[0])

    yield "LSTM LM (2x512, seq 64, batch 16)", LM(), torch.randint(0, 5000, (16, 64)), {"seq": 64}
    try:
        import transformers as tf
    except ImportError:
        return
    bert = tf.BertModel(tf.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024, attn_implementation="eager"), add_pooling_layer=False)

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = bert

        def forward(self, x):
            return self.m(input_ids=x, attention_mask=torch.ones_like(x), return_dict=False)[0]

    yield "BERT-mini (4x256, seq 128, batch 8)", Wrap(), torch.randint(0, 1000, (8, 128)), {"seq": 128}


def measure(model: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    model.train()
    opt = torch.optim.Adam(model.parameters())
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    weights = sum(p.nbytes for p in model.parameters())
    state = sum(t.nbytes for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("layercast_forward"):
            loss = model(x).float().sum()  # sum() saves nothing for backward
        loss.backward()
        opt.step()
    events = list(prof.events())
    fwd_end = max(e.time_range.end for e in events if e.name == "layercast_forward")
    # the profiler attributes each allocation (+) and free (−) to the op it happened in ("self" memory;
    # unattributed ones are "[memory]" events): ordered by op start, their running sum is the live curve
    mem = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in events if e.self_cpu_memory_usage)
    live = peak = at_fwd_end = 0
    for t, delta in mem:
        live += delta
        peak = max(peak, live)
        if t <= fwd_end:
            at_fwd_end = live
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return {"weights": weights, "gradients": grads, "optimizer_state": state, "activations": at_fwd_end,
            "peak": weights + state + peak}


def estimate(model: torch.nn.Module, x: torch.Tensor, dims: dict[str, int]):
    buf = io.BytesIO()
    model.train()
    dyn = {0: "batch", 1: "seq"} if dims else {0: "batch"}
    torch.onnx.export(model, (x,), buf, input_names=["x"], dynamic_axes={"x": dyn}, dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    a = analyze(import_onnx(buf.getvalue(), batch_size=x.shape[0], dims=dims))
    return footprint(a, mode="training", optimizer="adam")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "memory_validation.md"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    mib = 2**20
    rows = []
    for name, model, x, dims in _models():
        fp = estimate(model, x, dims)
        m = measure(model, x)
        est_total = fp.total_bytes
        rows.append((name, fp, m, est_total))
        print(name, f"estimate {est_total / mib:.1f} MiB, measured peak {m['peak'] / mib:.1f} MiB", flush=True)
    lines = [
        "# Training memory: layercast estimate vs torch on CPU",
        "",
        "Generated by `python scripts/measure_memory.py` (fp32, Adam, one training step, torch "
        f"{torch.__version__}, CPU). Method and limits: see the script's docstring and the notes below.",
        "",
        "| model | component | estimate (MiB) | measured (MiB) | estimate / measured |",
        "|---|---|---:|---:|---:|",
    ]
    for name, fp, m, est_total in rows:
        comps = [("weights", fp.weights_bytes, m["weights"]), ("gradients", fp.gradients_bytes, m["gradients"]),
                 ("optimizer state", fp.optimizer_state_bytes, m["optimizer_state"]),
                 ("activations (saved for backward)", fp.activations_bytes, m["activations"]),
                 ("**total vs measured peak**", est_total, m["peak"])]
        for comp, est, meas in comps:
            ratio = f"{est / meas:.2f}" if meas else "n/a"
            lines.append(f"| {name} | {comp} | {est / mib:.2f} | {meas / mib:.2f} | {ratio} |")
    lines += [
        "",
        "Notes:",
        "- Weights, gradients and optimizer state are exact by construction (same parameter count).",
        "- Measured activations are the live tensor bytes at the end of the forward pass; the peak is reached",
        "  during backward, when saved activations, output gradients and weight gradients coexist, which the",
        "  estimate's sum of components approximates but does not model step by step.",
        "- Where the estimate is high (BERT-mini ~1.8x on activations), it is the ONNX decomposition: every",
        "  Add/Mul/Div/Erf of the exported GELU, residuals and attention scaling is costed as saving its",
        "  input, while torch's autograd saves nothing for Add and one tensor for a fused GELU. Where it is",
        "  low (LSTM activations), the fused CPU LSTM kernel keeps a workspace beyond the gates and states.",
        "  The estimate errs high for transformers, which is the safe side for `fits`.",
        "- Only torch's CPU allocator is observed (profiler per-op self memory); RSS, Python objects, oneDNN",
        "  scratch space and allocator fragmentation are not. `fits` keeps a 10 % headroom for such terms.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
