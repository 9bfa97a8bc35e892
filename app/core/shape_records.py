"""IR layers of the importers' shape records: measured work the JSON layer vocabulary does not express.

Pure (no I/O, no torch). A shape record is a measurement ``config`` of the form ``{"layer": {"op": ...}}``
without ``input_shape`` (``app.measurements.importers`` module doc):

* ``matmul`` with ``a``/``b`` (NeuSight's batched matmul, ``a @ b`` with broadcast-equal batch axes) or with
  ``m``/``n``/``k`` and optional ``a_trans``/``b_trans`` (DeepBench's bare GEMM, ``C[m x n] = op(A) op(B)``);
* ``elementwise`` with ``shape``, ``fn`` (``add``, ``mul``, ``pow``, ``div``, ``sub``; ``silu_and_mul``: SiLU of
  the first half times the second, ``[T, 2F] -> [T, F]``), ``operands`` (tensor operands, at least 2) and
  ``operand: scalar`` (a tensor and a scalar), Vidur's element-wise ops;
* ``rope`` with ``q_shape``, ``k_shape`` and optional ``rotary_dim`` (Vidur's rotary embedding, in place on q
  and k, with each token's position and cos/sin row);
* ``allreduce`` / ``send_recv`` with positive ``size_bytes`` and ``n_ranks`` (collectives: no layer).

Both the trainer (:mod:`app.training.dataset`, which featurises them) and the measurements' row checks
(:mod:`app.measurements.validation`, which refuses a record no layer can be and gives the others a physics
floor) build them here, so one definition says what a record means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.ir import GemmAttrs, Layer, OpKind, Tensor

#: ``elementwise`` records' ``fn`` -> ONNX op type.
ELEMENTWISE_OPS = {"add": "Add", "mul": "Mul", "pow": "Pow", "div": "Div", "sub": "Sub"}
#: Collective records (no layer; ``size_bytes`` and ``n_ranks`` required).
COLLECTIVE_OPS = frozenset({"allreduce", "send_recv"})


def _dims(value: Any, what: str) -> tuple[int, ...]:
    dims = tuple(_positive(v, what) for v in value)
    if not dims:
        raise ValueError(f"{what} needs at least one axis")
    return dims


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must hold positive integers, got {value!r}")
    return value


def shape_record_layer(op: Mapping[str, Any], dtype: str) -> Layer | None:
    """IR layer of shape record ``op`` (the config's ``layer``; module docstring) with ``dtype`` tensors, or None
    for an op that is no shape record with a layer (a collective, another op, an ``elementwise`` ``fn`` this
    module does not know). Raises ``ValueError``/``KeyError``/``TypeError`` for a record whose fields are missing,
    not positive integers, or do not chain (``a @ b`` with mismatched axes)."""
    name = str(op["op"])
    if name == "matmul" and "a" in op:
        a, b = _dims(op["a"], "matmul a"), _dims(op["b"], "matmul b")
        if len(a) < 2 or a[:-2] != b[:-2] or a[-1] != b[-2]:
            raise ValueError(f"matmul shapes do not chain: {a} @ {b}")
        out = (*a[:-1], b[-1])
        return Layer("matmul", "MatMul", OpKind.MATMUL, (Tensor("a", a, dtype), Tensor("b", b, dtype)),
                     (Tensor("y", out, dtype),), attrs=GemmAttrs(m=a[-2], n=b[-1], k=a[-1], batch=a[:-2]))
    if name == "matmul" and "m" in op:  # DeepBench: C[m×n] = op(A)[m×k]·op(B)[k×n], both operands inputs
        m, n, k = (_positive(op[key], f"matmul {key}") for key in ("m", "n", "k"))
        a_shape = (k, m) if op.get("a_trans") else (m, k)
        b_shape = (n, k) if op.get("b_trans") else (k, n)
        return Layer("gemm", "MatMul", OpKind.MATMUL, (Tensor("a", a_shape, dtype), Tensor("b", b_shape, dtype)),
                     (Tensor("y", (m, n), dtype),), attrs=GemmAttrs(m=m, n=n, k=k))
    if name == "matmul":
        raise KeyError("a matmul record needs 'a' and 'b' shapes or 'm', 'n' and 'k'")
    if name == "elementwise":
        shape = _dims(op["shape"], "elementwise shape")
        x = Tensor("x", shape, dtype)
        fn = str(op["fn"])
        if fn == "silu_and_mul":  # SiLU(gate) * up, [T, 2F] -> [T, F] (FLOPs: costs.FUSED_ELEMENTWISE_FLOPS_PER_OUTPUT)
            if shape[-1] % 2:
                raise ValueError(f"silu_and_mul halves its last axis, got {shape[-1]}")
            out = (*shape[:-1], shape[-1] // 2)
            return Layer(fn, "SiluAndMul", OpKind.ELEMENTWISE, (x,), (Tensor("y", out, dtype),))
        if fn not in ELEMENTWISE_OPS:
            return None
        n_tensors = int(op.get("operands", 2))  # tensor operands of a chained op: a + b + c has 3 (2 FLOPs/output)
        if n_tensors < 2:
            raise ValueError(f"an element-wise op has at least 2 tensor operands, got {n_tensors}")
        others = tuple(Tensor(f"x{i}", shape, dtype) for i in range(2, n_tensors + 1))
        inputs = (x,) if op.get("operand") == "scalar" else (x, *others)
        return Layer(fn, ELEMENTWISE_OPS[fn], OpKind.ELEMENTWISE, inputs, (Tensor("y", shape, dtype),))
    if name == "rope":  # in place on q and k; with rotary_dim, each token's position (int64) and cos/sin row
        q_shape, k_shape = _dims(op["q_shape"], "rope q_shape"), _dims(op["k_shape"], "rope k_shape")
        aux: tuple[Tensor, ...] = ()
        if "rotary_dim" in op:
            tokens = q_shape[0]
            aux = (Tensor("positions", (tokens,), "int64"),
                   Tensor("cos_sin", (tokens, _positive(op["rotary_dim"], "rope rotary_dim")), dtype))
        return Layer("rope", "Rope", OpKind.ELEMENTWISE, (Tensor("q", q_shape, dtype), Tensor("k", k_shape, dtype),
                     *aux), (Tensor("q_out", q_shape, dtype), Tensor("k_out", k_shape, dtype)))  # fmt: skip
    if name in COLLECTIVE_OPS:
        _positive(op["size_bytes"], f"{name} size_bytes")
        _positive(op["n_ranks"], f"{name} n_ranks")
    return None
