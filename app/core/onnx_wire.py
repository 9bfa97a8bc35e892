"""Read an ONNX ``ModelProto`` from a file in bounded pieces, never holding the whole file as bytes.

``onnx.load`` reads the file into one ``bytes`` object and parses it, so a 436 MB upload holds the bytes
and the parsed message (about as large) at once: twice the file. Protocol buffers define parsing the
concatenation of two serialisations as merging the two messages (repeated fields append, singular
messages merge, the last scalar wins: https://protobuf.dev/programming-guides/encoding/#optional), so a
message can be parsed from consecutive *whole field records* one slice at a time. :func:`read_model`
walks the wire format of the file's top-level fields and of the ``graph`` field (``ModelProto.graph``,
field 7) inside it, and merges slices of at most :data:`CHUNK_BYTES` (or one record, when a single
record, e.g. a large initializer, is longer) into the message: peak memory is the parsed message plus
one slice.
"""

from __future__ import annotations

from typing import IO

import onnx

CHUNK_BYTES = 8 * 2**20
"""Bytes of field records merged per ``MergeFromString`` call (a single longer record goes alone)."""

_GRAPH_FIELD = 7  # ModelProto.graph (onnx/onnx.proto)
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


class WireError(ValueError):
    """The bytes are not a protocol-buffers serialisation (bad wire type, truncated record)."""


def _varint(head: bytes, pos: int) -> tuple[int, int]:
    """The base-128 varint at ``head[pos:]`` and the position after it."""
    value = shift = 0
    while pos < len(head):
        byte = head[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            break
    raise WireError("truncated or overlong varint")


def _record(f: IO[bytes], pos: int, end: int) -> tuple[int, int, int, int]:
    """The field record at file offset ``pos``: ``(field number, wire type, payload start, record end)``."""
    f.seek(pos)
    head = f.read(20)  # a tag and a length varint take at most 10 bytes each
    key, at = _varint(head, 0)
    field, wire = key >> 3, key & 7
    if wire == _LENGTH_DELIMITED:
        length, at = _varint(head, at)
        stop = pos + at + length
    elif wire == _VARINT:
        stop = pos + _varint(head, at)[1]
    elif wire == _FIXED64:
        stop = pos + at + 8
    elif wire == _FIXED32:
        stop = pos + at + 4
    else:  # groups (3, 4) are not used by onnx.proto; 6 and 7 do not exist
        raise WireError(f"unsupported wire type {wire}")
    if field == 0 or stop > end:
        raise WireError("field number 0 or record past the end")
    return field, wire, pos + at, stop


def _merge(f: IO[bytes], message: object, start: int, end: int) -> None:
    """Merge the whole field records in ``[start, end)`` of ``f`` into ``message``, a slice at a time;
    the graph field of a ``ModelProto`` is walked in turn."""
    pending = pos = start

    def flush(upto: int) -> None:
        if upto > pending:
            f.seek(pending)
            message.MergeFromString(f.read(upto - pending))  # type: ignore[attr-defined]

    while pos < end:
        field, wire, payload, stop = _record(f, pos, end)
        if isinstance(message, onnx.ModelProto) and field == _GRAPH_FIELD and wire == _LENGTH_DELIMITED:
            flush(pos)
            _merge(f, message.graph, payload, stop)
            pending = stop
        elif stop - pending > CHUNK_BYTES and pos > pending:
            flush(pos)
            pending = pos
        pos = stop
    flush(end)


def read_model(f: IO[bytes]) -> onnx.ModelProto:
    """Parse the ``ModelProto`` serialised in the seekable binary file ``f`` from its current position to
    its end, holding at most one slice (:data:`CHUNK_BYTES`, or one longer record) as bytes at a time.

    The same message as ``onnx.load_model_from_string(f.read())``. Raises :class:`WireError` for bytes
    that are not a protocol-buffers serialisation and protobuf's ``DecodeError`` for records that do not
    parse as the fields of ``ModelProto``; external-data references stay references (nothing is opened).
    """
    start = f.tell()
    end = f.seek(0, 2)
    model = onnx.ModelProto()
    _merge(f, model, start, end)
    f.seek(end)
    return model
