"""How a tokenizer was made, as its SentencePiece models say it: ``data.tokenizer``'s keys read
from the models' own bytes (the ``TrainerSpec`` and ``NormalizerSpec`` of
sentencepiece_model.proto).

A run that starts from a checkpoint (``init_from``: an ``mt-import``'ed model, another run's)
or takes a model put in ``data.tokenizer.path`` by hand uses a tokenizer that no setting of the
run made: ``data.tokenizer`` would otherwise record the run's defaults (one joint vocabulary of
8000, nmt_nfkc) for a tokenizer of two vocabularies of 58,000 that folds case, and code that
reads the config (the case-folding tag check of ``data.tagged``) would act on them.

The protobuf wire format is read by hand: the ``protobuf`` package that
``sentencepiece_model_pb2`` needs is a dependency of ``mt[export]`` only, not of mt-train.
"""

from __future__ import annotations

import struct

# sentencepiece_model.proto: ModelProto.pieces, .trainer_spec, .normalizer_spec
PIECES, TRAINER, NORMALIZER = 1, 2, 3
# TrainerSpec.model_type, .character_coverage, .byte_fallback; NormalizerSpec.name
MODEL_TYPE, COVERAGE, BYTE_FALLBACK, NAME = 3, 10, 35, 1
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}  # TrainerSpec.ModelType


def _fields(data: memoryview) -> tuple[dict[int, int | memoryview], int]:
    """One protobuf message's fields, the last value of each (a varint as an int, a fixed32 or
    length-delimited field as its bytes; fixed64 fields skipped), and how many pieces (field 1
    of a ModelProto) it holds."""
    fields: dict[int, int | memoryview] = {}
    i, pieces = 0, 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    try:
        while i < len(data):
            key = varint()
            number, kind = key >> 3, key & 7
            if kind == 0:
                fields[number] = varint()
            elif kind in (1, 2, 5):
                size = 8 if kind == 1 else 4 if kind == 5 else varint()
                if i + size > len(data):
                    raise IndexError
                fields[number], i = data[i:i + size], i + size
            else:
                raise ValueError(f"protobuf wire type {kind}")
            pieces += number == PIECES
    except IndexError:
        raise ValueError("cut short") from None
    return fields, pieces


def model_settings(proto: bytes) -> dict:
    """The ``data.tokenizer`` keys of one SentencePiece model (proto2 defaults where unset); its
    model_type for ``mt.subwords``' message too."""
    try:
        model, pieces = _fields(memoryview(proto))
        trainer = _fields(model.get(TRAINER, memoryview(b"")))[0]
        name = bytes(_fields(model.get(NORMALIZER, memoryview(b"")))[0].get(NAME, b"nmt_nfkc"))
    except ValueError as err:  # Tokenizer() parsed it already: not reached for a real model
        raise ValueError(f"not a SentencePiece model ({err})") from None
    coverage = trainer.get(COVERAGE)
    # a float32: 0.9995 is kept as 0.99949997..., the value asked is its shortest spelling
    coverage = float(f"{struct.unpack('<f', coverage)[0]:.7g}") if coverage is not None else 0.9995
    return {"model_type": MODEL_TYPES.get(trainer.get(MODEL_TYPE, 1), "unigram"),
            "vocab_size": pieces, "character_coverage": coverage,
            "byte_fallback": bool(trainer.get(BYTE_FALLBACK, 0)),
            "normalization": name.decode("utf-8", "replace")}


def tokenizer_settings(state: dict) -> dict:
    """The ``data.tokenizer`` settings a tokenizer has (of ``Tokenizer.to_state()``): joint or
    not, and its source model's type, vocabulary size, character coverage, byte fallback and
    normalization rule (SentencePiece's name for it: ``user_defined`` for a rule of its own).
    Of two models, ``vocab_size`` is the larger one's pieces, the most a side was asked for;
    ``input_sentence_size`` and ``user_symbols`` are no part of a model and are not given."""
    settings = model_settings(state["src"])
    if state.get("tgt") is not None:
        tgt = model_settings(state["tgt"])
        settings["vocab_size"] = max(settings["vocab_size"], tgt["vocab_size"])
    return {**settings, "joint": state.get("tgt") is None}
