"""Parsers of the Vidur profiling tables (``../shared/data/vidur/``): per-op LLM decoder times and NCCL collectives.

Source: microsoft/vidur @ 7d475133 (MIT), Agrawal et al., "Vidur: A Large-Scale Simulation Framework for
LLM Inference", MLSys 2024; see the folder's README. Every record has ``source`` ``vidur``, ``pass_``
``forward``, ``precision`` ``fp16`` (FP16 weights and activations, not autocast), ``software_stack``
``pytorch-eager`` and ``granularity`` ``kernel``: times are sums (compute) or medians (collectives) of GPU
kernel durations under Kineto, launch gaps excluded. ``time_ms_median``/``time_ms_std`` are Vidur's
median and std; ``context`` keeps ``time_ms_min``/``_max``/``_mean``.

``compute_mlp_{a100,a40}.csv.gz`` (:func:`iter_vidur_compute`): one row = one decoder block of one model at
``num_tokens`` T and a simulated tensor-parallel degree t (weights sharded as on t GPUs, no communication
timed); one record per op column ``time_stats.<op>.*`` (``context["source_column"]`` = op), ``batch_size``
T (tokens are the batch axis: prefill, all sequences flattened). With E = ``n_embd``, F =
``n_expanded_embd``, h = E / ``n_head``, q = ``n_head``·h / t, kv = ``n_kv_head``·h / t:

==========================  ==============  ================================================================
op                          ``op_kind``     ``config``
==========================  ==============  ================================================================
emb                         ``embedding``   ``{"input_shape": [1], "layer": {"op": "embedding", "num_embeddings":
                                            vocab / t, "embedding_dim": E}}`` (vocab-parallel shard)
input_layernorm,            ``norm``        ``{"input_shape": [E], "layer": {"op": "layernorm"}, "norm":
post_attention_layernorm                    "rmsnorm"|"layernorm"}`` (phi-2: LayerNorm, no post-attention norm)
attn_pre_proj               ``gemm``        linear E → q + 2·kv
attn_post_proj              ``gemm``        linear q → E
mlp_up_proj                 ``gemm``        linear E → k·F / t (k = 2 for a gated MLP: gate and up fused)
mlp_down_proj               ``gemm``        linear F / t → E
mlp_act (gated)            ``elementwise`` ``{"layer": {"op": "elementwise", "fn": "silu_and_mul", "shape": [T,2F/t]}}``
mlp_act (phi-2)            ``activation``  ``{"input_shape": [F/t], "layer": {"op": "gelu"}}``
attn_rope                   ``elementwise`` ``{"layer": {"op": "rope", "q_shape": [T, q], "k_shape": [T, kv],
                                            "rotary_dim": h}}`` (in place on q and k; each token also reads
                                            its int64 position and its h-wide cos/sin row of the cache)
add                         ``elementwise`` ``{"layer": {"op": "elementwise", "fn": "add", "shape": [T, E],
                                            "operand": "tensor", "operands": n}}`` (residual add: n = 2;
                                            phi-2, without a post-attention norm, times ``attn + mlp +
                                            residual`` in one range: n = 3)
==========================  ==============  ================================================================

Linear configs are ``{"input_shape": [in], "layer": {"op": "linear", "out_features": out, "bias": false}}``
(Vidur's CSV does not record biases; they are negligible next to the GEMM). Every config also has
``model``, ``tensor_parallel`` and the model's dimensions.

``network_{all_reduce,send_recv}.csv.gz`` (:func:`iter_vidur_network`): one record per row, ``op_kind``
``allreduce`` or ``send_recv``, ``config = {"layer": {"op": ..., "size_bytes": n, "n_ranks": workers,
"devices_per_node": d, "n_nodes": ceil(workers / d)}, "dtype": "float16"}``, ``batch_size`` 1.

Skips (counted per Vidur device name): a device without a catalog id, a missing or non-positive median.
Malformed files raise :class:`~app.measurements.importers.ImportFormatError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from app.core.vocab import Granularity, Pass, SoftwareStack
from app.hardware.catalog import load_catalog
from app.measurements.importers import (
    SOURCE_VIDUR,
    ImportFormatError,
    MeasurementRecord,
    RecordStream,
    _choice,
    _int,
    _optional_float,
    _rows,
    _stream,
    _time,
)

VIDUR_UPSTREAM = "microsoft/vidur@7d475133"
VIDUR_PRECISION = "fp16"
VIDUR_COMPUTE_REPEATS = 20  # the block is repeated 20 times inside one profiled forward (emb: 21 samples)
VIDUR_NETWORK_REPEATS = 3  # measurements of 11 back-to-back collectives each
VIDUR_COMPUTE_TIMING = "sum of GPU kernel durations inside the op's record_function range (Kineto), 20 repeats"
VIDUR_NETWORK_TIMING = "median duration of the nccl kernels of 11 back-to-back calls (Kineto), 3 measurements"

#: ``device_sku`` of the compute tables → catalog id. Vidur does not say which A100 80 GB form factor ran the
#: compute profiling; its network data name the Azure NC96ads_A100_v4 VM (PCIe) and a DGX (SXM4). The
#: compute rows map to the PCIe card, with a note on every record.
VIDUR_COMPUTE_HARDWARE_IDS: dict[str, str] = {"a100": "a100-pcie-80gb", "a40": "a40"}
VIDUR_COMPUTE_HARDWARE_NOTES: dict[str, str] = {
    "a100": "Vidur does not name the A100 80 GB form factor of its compute profiling; mapped to a100-pcie-80gb",
}
#: ``network_device`` → (catalog id, what Vidur says the system is).
VIDUR_NETWORK_DEVICES: dict[str, tuple[str, str]] = {
    "a100_dgx": ("a100-sxm4-80gb", "A100 DGX, 8x A100 80GB SXM4, all NVLink; 16 workers span 2 nodes"),
    "a100_pairwise_nvlink": ("a100-pcie-80gb",
                             "Azure Standard_NC96ads_A100_v4, 4x A100 80GB PCIe, NVLink in pairs"),
    "a40_pairwise_nvlink": ("a40", "8x A40, NVLink in pairs"),
}

#: Op columns of the compute tables, in file order.
VIDUR_COMPUTE_OPS: tuple[str, ...] = (
    "emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
    "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
#: Models whose block has LayerNorm (the others use RMSNorm) and no post-attention norm (Vidur model configs).
_LAYERNORM_MODELS = frozenset({"microsoft/phi-2"})
_NO_POST_NORM = frozenset({"microsoft/phi-2"})
_COMPUTE_COLUMNS = ("device_sku", "model", "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size",
                    "use_gated_mlp", "num_tokens", "num_tensor_parallel_workers", "source_file",
                    *(f"time_stats.{op}.median" for op in VIDUR_COMPUTE_OPS))
_BOOL = {"True": True, "False": False, "true": True, "false": False}


def _linear(d_in: int, d_out: int) -> dict[str, Any]:
    return {"input_shape": [d_in], "layer": {"op": "linear", "out_features": d_out, "bias": False}}


def _divide(total: int, tp: int, what: str, name: str, line: int) -> int:
    if total % tp:
        raise ImportFormatError(f"{name}: line {line}: {what} {total} is not divisible by TP degree {tp}")
    return total // tp


def vidur_op_config(op: str, dims: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(op_kind, config)`` of one Vidur compute op (see the module table) for one row's ``dims``.

    ``dims`` has ``tokens``, ``n_embd``, ``n_expanded_embd``, ``vocab_size``, ``q_dim``, ``kv_dim`` (per
    TP shard), ``head_dim``, ``tensor_parallel``, ``gated``, ``norm`` and ``add_operands`` (tensors summed in
    the timed ``add`` range: 2, or 3 for a block without a post-attention norm, whose ``add`` is Vidur's
    ``attn_outputs + feed_forward_hidden_states + residual``). Raises ``KeyError`` for an unknown op.
    """
    t, e, f, tp = dims["tokens"], dims["n_embd"], dims["n_expanded_embd"], dims["tensor_parallel"]
    q, kv = dims["q_dim"], dims["kv_dim"]
    if op == "emb":
        layer = {"op": "embedding", "num_embeddings": dims["vocab_size"] // tp, "embedding_dim": e}
        return "embedding", {"input_shape": [1], "layer": layer}
    if op in ("input_layernorm", "post_attention_layernorm"):
        return "norm", {"input_shape": [e], "layer": {"op": "layernorm"}, "norm": dims["norm"]}
    if op == "attn_pre_proj":
        return "gemm", _linear(e, q + 2 * kv)
    if op == "attn_post_proj":
        return "gemm", _linear(q, e)
    if op == "mlp_up_proj":
        return "gemm", _linear(e, (2 if dims["gated"] else 1) * f // tp)
    if op == "mlp_down_proj":
        return "gemm", _linear(f // tp, e)
    if op == "mlp_act":
        if dims["gated"]:
            return "elementwise", {"layer": {"op": "elementwise", "fn": "silu_and_mul", "shape": [t, 2 * f // tp]}}
        return "activation", {"input_shape": [f // tp], "layer": {"op": "gelu"}}
    if op == "attn_rope":  # Vidur builds get_rope(head_dim, rotary_dim=head_dim, ...)
        return "elementwise", {"layer": {"op": "rope", "q_shape": [t, q], "k_shape": [t, kv],
                                         "rotary_dim": dims["head_dim"]}}  # fmt: skip
    if op == "add":
        layer = {"op": "elementwise", "fn": "add", "shape": [t, e], "operand": "tensor",
                 "operands": dims["add_operands"]}
        return "elementwise", {"layer": layer}
    raise KeyError(f"unknown Vidur op {op!r}")


def _dims(row: Mapping[str, str], name: str, line: int) -> dict[str, Any]:
    heads, kv_heads = _int(row, "n_head", name, line), _int(row, "n_kv_head", name, line)
    e, f = _int(row, "n_embd", name, line), _int(row, "n_expanded_embd", name, line)
    tp = _int(row, "num_tensor_parallel_workers", name, line)
    if e % heads:
        raise ImportFormatError(f"{name}: line {line}: n_embd {e} is not divisible by n_head {heads}")
    head_dim = e // heads
    model = row["model"].strip()
    return {
        "tokens": _int(row, "num_tokens", name, line),
        "n_embd": e,
        "n_expanded_embd": _divide(f, tp, "n_expanded_embd", name, line) * tp,  # checked: F divisible by t
        "vocab_size": _int(row, "vocab_size", name, line),
        "n_head": heads,
        "n_kv_head": kv_heads,
        "q_dim": _divide(heads, tp, "n_head", name, line) * head_dim,
        "kv_dim": max(kv_heads // tp, 1) * head_dim,  # KV heads are replicated when TP > n_kv_head
        "tensor_parallel": tp,
        "gated": _choice(row, "use_gated_mlp", _BOOL, name, line),
        "head_dim": head_dim,
        "norm": "layernorm" if model in _LAYERNORM_MODELS else "rmsnorm",
        "add_operands": 3 if model in _NO_POST_NORM else 2,
    }


def _stats(row: Mapping[str, str], prefix: str) -> dict[str, float | None]:
    return {f"time_ms_{s}": _optional_float(row, f"{prefix}.{s}") for s in ("min", "max", "mean")}


def iter_vidur_compute(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of ``compute_mlp_{a100,a40}.csv.gz``: up to 10 per row, one per op (see module docstring).

    ``rows_read`` counts CSV rows; phi-2's absent post-attention norm is not expected (neither a record
    nor a skip). Raises ``FileNotFoundError``; :class:`ImportFormatError` while iterating.
    """

    def parse(stream: RecordStream) -> Iterator[MeasurementRecord]:
        catalog = set(load_catalog())
        name = stream.source_file
        for index, line, row in _rows(stream, _COMPUTE_COLUMNS, limit):
            dims = _dims(row, name, line)
            sku, model = row["device_sku"].strip(), row["model"].strip()
            ops = [op for op in VIDUR_COMPUTE_OPS if not (op == "post_attention_layernorm" and model in _NO_POST_NORM)]
            hardware_id = stream.in_catalog(sku, VIDUR_COMPUTE_HARDWARE_IDS.get(sku), catalog, len(ops))
            if hardware_id is None:
                continue
            shared = {"model": model, "tensor_parallel": dims["tensor_parallel"], "num_tokens": dims["tokens"],
                      **{k: dims[k] for k in ("n_embd", "n_expanded_embd", "n_head", "n_kv_head", "vocab_size")},
                      "gated_mlp": dims["gated"]}
            for op in ops:
                prefix = f"time_stats.{op}"
                time = _time(row, f"{prefix}.median", name, line)
                if isinstance(time, str):
                    stream.skip(sku, time)
                    continue
                op_kind, config = vidur_op_config(op, dims)
                std = _optional_float(row, f"{prefix}.std")
                context: dict[str, Any] = {
                    "source_file": name,
                    "source_row": index,
                    "source_column": op,
                    "upstream": VIDUR_UPSTREAM,
                    "upstream_file": row["source_file"],
                    "device_name": sku,
                    "framework": "PyTorch",
                    "framework_version": None,  # not recorded by Vidur
                    "timing": VIDUR_COMPUTE_TIMING,
                    "precision": "FP16 weights and activations (torch.inference_mode)",
                    "tensor_parallel_note": "TP simulated on one GPU: sharded weights, no communication timed",
                    **_stats(row, prefix),
                }
                if sku in VIDUR_COMPUTE_HARDWARE_NOTES:
                    context["hardware_note"] = VIDUR_COMPUTE_HARDWARE_NOTES[sku]
                yield MeasurementRecord(
                    hardware_id=hardware_id,
                    source=SOURCE_VIDUR,
                    op_kind=op_kind,
                    pass_=Pass.FORWARD.value,
                    optimizer="none",
                    precision=VIDUR_PRECISION,
                    software_stack=SoftwareStack.PYTORCH_EAGER,
                    granularity=Granularity.KERNEL,
                    batch_size=dims["tokens"],
                    config={**config, **shared},
                    time_ms_median=time,
                    time_ms_std=std if std is not None and std >= 0 else None,
                    repetitions=VIDUR_COMPUTE_REPEATS + (op == "emb"),
                    context=context,
                )

    return _stream(SOURCE_VIDUR, path, parse)


_NETWORK_OPS = {"all_reduce": ("allreduce", "allreduce"), "send_recv": ("send_recv", "send_recv")}


def iter_vidur_network(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of ``network_all_reduce.csv.gz`` or ``network_send_recv.csv.gz``: one per row (module docstring).

    Raises ``FileNotFoundError``; :class:`ImportFormatError` while iterating (also for a file whose name
    is not one of the two).
    """
    p = Path(path)
    collective = p.name.removeprefix("network_").split(".", 1)[0]
    if collective not in _NETWORK_OPS:
        raise ImportFormatError(f"{p.name}: a Vidur network file is network_all_reduce or network_send_recv")
    op_kind, layer_op = _NETWORK_OPS[collective]
    prefix = f"time_stats.{collective}"
    columns = ("network_device", "num_workers", "size", "collective", "devices_per_node", "max_devices_per_node",
               "source_file", f"{prefix}.median")

    def parse(stream: RecordStream) -> Iterator[MeasurementRecord]:
        catalog = set(load_catalog())
        name = stream.source_file
        for index, line, row in _rows(stream, columns, limit):
            if row["collective"].strip() != collective:
                raise ImportFormatError(f"{name}: line {line}: collective {row['collective']!r} in a {collective} file")
            device = row["network_device"].strip()
            workers = _int(row, "num_workers", name, line)
            per_node = _int(row, "devices_per_node", name, line)
            size = _int(row, "size", name, line)
            known = VIDUR_NETWORK_DEVICES.get(device)
            if stream.in_catalog(device, known[0] if known else None, catalog) is None or known is None:
                continue
            time = _time(row, f"{prefix}.median", name, line)
            if isinstance(time, str):
                stream.skip(device, time)
                continue
            layer = {"op": layer_op, "size_bytes": size, "n_ranks": workers, "devices_per_node": per_node,
                     "n_nodes": math.ceil(workers / per_node)}
            std = _optional_float(row, f"{prefix}.std")
            context: dict[str, Any] = {
                "source_file": name,
                "source_row": index,
                "upstream": VIDUR_UPSTREAM,
                "upstream_file": row["source_file"],
                "device_name": device,
                "system": known[1],
                "max_devices_per_node": _int(row, "max_devices_per_node", name, line),
                "framework": "PyTorch (torch.distributed, NCCL)",
                "framework_version": None,  # not recorded by Vidur
                "timing": VIDUR_NETWORK_TIMING,
                "precision": "FP16 buffer",
                **_stats(row, prefix),
            }
            yield MeasurementRecord(
                hardware_id=known[0],
                source=SOURCE_VIDUR,
                op_kind=op_kind,
                pass_=Pass.FORWARD.value,
                optimizer="none",
                precision=VIDUR_PRECISION,
                software_stack=SoftwareStack.PYTORCH_EAGER,
                granularity=Granularity.KERNEL,
                batch_size=1,
                config={"layer": layer, "dtype": "float16"},
                time_ms_median=time,
                time_ms_std=std if std is not None and std >= 0 else None,
                repetitions=VIDUR_NETWORK_REPEATS,
                context=context,
            )

    return _stream(SOURCE_VIDUR, p, parse)


def vidur_files(data_dir: str | Path) -> list[tuple[Path, Any]]:
    """``(path, parser)`` of every Vidur table in ``data_dir``: compute tables, then network tables.

    Raises ``FileNotFoundError`` when there are none.
    """
    d = Path(data_dir)
    pairs: list[tuple[Path, Any]] = [(p, iter_vidur_compute) for p in sorted(d.glob("compute_mlp_*.csv.gz"))]
    pairs += [(p, iter_vidur_network) for p in sorted(d.glob("network_*.csv.gz"))]
    if not pairs:
        raise FileNotFoundError(f"no Vidur tables (compute_mlp_*.csv.gz, network_*.csv.gz) under {d}")
    return pairs
