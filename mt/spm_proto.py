"""What a serialized SentencePiece model says about how it was trained, read without protobuf.

``sentencepiece``'s Python API encodes and decodes but does not show a model's TrainerSpec or
NormalizerSpec, and its generated protobuf module needs the ``protobuf`` package, which mt does
not require. The two fields mt checks (``mt.tokenizer.check_spelling``) are read straight from the
protobuf wire format instead (https://protobuf.dev/programming-guides/encoding/).
"""

from __future__ import annotations

from collections.abc import Iterator


def trained_with(proto: bytes) -> dict[str, bool | str]:
    """``byte_fallback`` and ``normalization`` as the SentencePiece model ``proto`` holds them
    (TrainerSpec.byte_fallback, field 35; NormalizerSpec.name, field 1).

    They are read from the model, not from ``tokenizer.json``: a directory written before mt had
    these keys, or put together by hand, is judged by what its model does.
    """
    model = dict(_fields(proto))  # ModelProto: trainer_spec = 2, normalizer_spec = 3
    trainer, normalizer = dict(_fields(model.get(2, b""))), dict(_fields(model.get(3, b"")))
    return {"byte_fallback": bool(trainer.get(35, 0)),
            "normalization": bytes(normalizer.get(1, b"")).decode()}


def _fields(message: bytes | memoryview) -> Iterator[tuple[int, int | memoryview | None]]:
    """(number, value) of each field of a serialized protobuf message: an int for a varint, the
    bytes of a length-delimited field, None for a fixed-size one (SentencePiece's floats)."""
    buf, i = memoryview(message), 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = buf[i]
            i += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    while i < len(buf):
        key = varint()
        kind = key & 7
        if kind == 0:
            yield key >> 3, varint()
        elif kind == 2:
            size = varint()
            yield key >> 3, buf[i : i + size]
            i += size
        elif kind in (1, 5):
            yield key >> 3, None
            i += 8 if kind == 1 else 4
        else:
            raise ValueError(f"not a SentencePiece model (protobuf wire type {kind})")
