"""Import a Hugging Face Marian model (an OPUS-MT download) as an mt model and tokenizer (the
``mt-import`` CLI is in ``mt.interop``). Needs neither ``transformers`` nor a network; rewriting
the SentencePiece models needs ``protobuf``.

Vocabulary ids. mt fixes pad=0, unk=1, bos=2, eos=3 and uses the SentencePiece id as the
embedding row. A Marian directory maps SentencePiece *pieces* to rows through ``vocab.json``, in
its own order (OPUS-MT: eos=0, unk=1, pad=last, and the decoder starts from the pad row). Import
therefore reorders the embedding rows into mt's order and writes SentencePiece models whose pieces
are in that same order, so that the SentencePiece id *is* the row again: mt's pad <- Marian's pad
(a new zero row when the pad row is also the decoder start), unk <- unk, bos <- the decoder start
row, eos <- eos, then every other row in Marian's order. A piece of a joint vocabulary that one
side's SentencePiece model lacks is kept there as an UNUSED piece (SentencePiece never produces it
when encoding, as Marian's tokenizer never would, and decodes it as its text), so the source and
target models keep the same size and the embeddings stay tied. A new row gets a final-logit bias
of ``NEVER``: it takes no probability mass, and the log-probabilities equal Marian's.

Target-language codes. A multilingual OPUS-MT model reads the target language from a code at the
start of the source (``>>fra<< Hello``): a row of ``vocab.json``, not a SentencePiece piece.
``MarianTokenizer`` cuts the code off the text, maps it to that row and encodes the rest alone.
The rewritten source model gets the same from SentencePiece itself, so that ``translate`` and
``mt-eval`` need nothing of their own: each code becomes the user-defined piece ``▁>>fra<<``
(see ``remap_spm``). On the target side a code stays an UNUSED piece that decodes as its text, as
``MarianTokenizer`` decodes it (it is not one of its special tokens).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ModelConfig
from mt.export import HF_ACTIVATIONS, LANGUAGE_CODE, SPECIAL_PIECES, marian_names
from mt.model import Transformer, build_model
from mt.textio import json_object
from mt.tokenizer import Tokenizer

log = logging.getLogger(__name__)

NEVER = -1e4  # final-logit bias of a row that must take no probability (exp(-1e4) == 0 in fp32)


# --------------------------------------------------------------------------- import: HF Marian

class _Entries(dict):
    """A dict read from ``source`` whose missing key is a ValueError naming the file and key
    (a bare KeyError printed only the key: "mt-import: 'encoder_ffn_dim'")."""

    def __init__(self, items: dict, source: Path, hint: str = "") -> None:
        super().__init__(items)
        self.source, self.hint = source, hint

    def __missing__(self, key: str):
        raise ValueError(f"{self.source}: no {key!r}{self.hint}")


def _read_json(path: Path) -> _Entries:
    return _Entries(json_object(path), path)


def _read_hf_weights(directory: Path) -> _Entries:
    path = directory / "model.safetensors"
    if not path.exists():
        path = directory / "pytorch_model.bin"
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no model.safetensors or pytorch_model.bin")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(path)
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True)
    except ImportError:
        raise
    except Exception as err:  # each reader fails in its own words (safetensors', pickle's)
        said = str(err).strip().splitlines() or [type(err).__name__]
        raise ValueError(f"{path}: cannot read the weights ({said[0]})") from None
    return _Entries(weights, path, "; config.json's layers do not match the weights")


def _first(weights: dict[str, Tensor], names: list[str], directory: Path) -> Tensor:
    for name in names:
        if name in weights:
            return weights[name]
    raise ValueError(f"{directory}: the weights have none of {names}")


def remap_spm(proto: bytes, pieces: list[str], language_codes: bool = False) -> bytes:
    """A SentencePiece model whose piece ``i`` is ``pieces[i]`` (i >= 4) after mt's specials.

    Scores and types come from ``proto``; a piece it does not have becomes UNUSED (never produced
    by encoding, decoded as its text).

    Args:
        proto: the serialized SentencePiece model (source.spm or target.spm).
        pieces: the piece of each mt id.
        language_codes: a source model: each target-language code (``>>fra<<``) becomes the
            user-defined piece ``▁>>fra<<``. SentencePiece cuts a user-defined piece out whole,
            and puts ``▁`` before every word, so ``>>fra<< Hello`` (normalized ``▁>>fra<<▁Hello``)
            encodes as the code, then what ``Hello`` alone encodes as: what ``MarianTokenizer``
            gives. Defined without the ``▁`` it would come out as ``▁``, ``>>fra<<``.

    On either side, a code whose ``proto`` has ``▁>>fra<<`` and not ``>>fra<<`` is that piece:
    mt's export lists ``▁>>fra<<`` in vocab.json as ``>>fra<<`` (``mt.export._source_vocab``).
    Read as a piece of its own, a joint model's target side got an UNUSED ``>>fra<<`` and the
    tokenizer came back as two models.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    Piece = pb.ModelProto.SentencePiece
    old = pb.ModelProto()
    old.ParseFromString(proto)
    known = {p.piece: p for p in old.pieces
             if p.type in (Piece.NORMAL, Piece.USER_DEFINED, Piece.BYTE, Piece.UNUSED)}
    new = pb.ModelProto()
    new.CopyFrom(old)
    del new.pieces[:]
    names = set(pieces)
    for i, piece in enumerate(pieces):
        p = new.pieces.add()
        p.piece = piece
        code = "\u2581" + piece  # a code's piece; not if taken by another row: pieces are unique
        is_code = LANGUAGE_CODE.fullmatch(piece) and code not in names
        if i in SPECIAL_PIECES:
            p.type, p.score = (Piece.UNKNOWN if i == UNK_ID else Piece.CONTROL), 0.0
        elif is_code and (language_codes or (code in known and piece not in known)):
            p.piece, p.type, p.score = code, Piece.USER_DEFINED, 0.0
        elif piece in known:
            p.type, p.score = known[piece].type, known[piece].score
        else:
            p.type, p.score = Piece.UNUSED, 0.0
    # a piece kept under a code's name (vocab.json's >>fra<< for the model's ▁>>fra<<) is not lost
    dropped = len(set(known) - {p.piece for p in new.pieces} - names)
    if dropped:
        log.warning("%d SentencePiece pieces have no row in the model's vocabulary; they are left "
                    "out (Marian maps them to <unk>)", dropped)
    ts = new.trainer_spec
    ts.pad_id, ts.unk_id, ts.bos_id, ts.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    ts.pad_piece, ts.unk_piece = SPECIAL_PIECES[PAD_ID], SPECIAL_PIECES[UNK_ID]
    ts.bos_piece, ts.eos_piece = SPECIAL_PIECES[BOS_ID], SPECIAL_PIECES[EOS_ID]
    ts.vocab_size = len(pieces)
    return new.SerializeToString()


def marian_rows(vocab: dict[str, int], rows: int, pad: int | None, bos: int | None,
                eos: int) -> list[int | None]:
    """For each mt id, the Marian row it takes (None: a new zero row).

    Args:
        vocab: piece -> Marian row (vocab.json).
        rows: the embedding's number of rows.
        pad, bos, eos: the Marian rows that become mt's PAD, BOS (the decoder start; None on a
            source side of its own) and EOS. A pad that is also the decoder start goes to BOS, and
            PAD gets a new row.
    Returns:
        mt's pad, unk, bos, eos, then every other row in Marian's order, except rows without a
        piece or whose piece is one of mt's special names (unreachable from text).
    """
    if "<unk>" not in vocab:
        raise ValueError("vocab.json has no <unk> entry; is this a Marian model directory?")
    order: list[int | None] = [None if pad == bos else pad, vocab["<unk>"], bos, eos]
    taken = set(order)
    piece_of = {i: p for p, i in vocab.items()}
    skipped = 0
    for row in range(rows):
        if row in taken:
            continue
        piece = piece_of.get(row)
        if piece is None or piece in SPECIAL_PIECES.values():
            # a source side has no decoder start: its <s> row (mt's own exports have one) is
            # unused, not lost
            skipped += not (bos is None and piece == SPECIAL_PIECES[BOS_ID])
            continue
        order.append(row)
    if skipped:
        log.warning("%d vocabulary rows have no piece or reuse a special name; left out", skipped)
    return order


def _pieces(order: list[int | None], vocab: dict[str, int]) -> list[str]:
    piece_of = {i: p for p, i in vocab.items()}
    return [SPECIAL_PIECES[i] if i in SPECIAL_PIECES else piece_of[row]
            for i, row in enumerate(order)]


def _take(table: Tensor, order: list[int | None], fill: float = 0.0) -> Tensor:
    """Rows ``order`` of ``table`` (V, ...) -> (len(order), ...); None gives a row of ``fill``."""
    out = table.new_full((len(order),) + table.shape[1:], fill)
    have = [i for i, row in enumerate(order) if row is not None]
    out[have] = table[[order[i] for i in have]]
    return out


# The files of a Marian directory that import_hf reads (those present): what mt-import must not
# overwrite, even with --force.
READS = ("config.json", "model.safetensors", "pytorch_model.bin", "source.spm", "target.spm",
         "vocab.json", "target_vocab.json", "tokenizer_config.json")

# config.json's sizes and ids, each an integer of at least this (a string or an id past the
# vocabulary failed as a traceback deep in the import)
_COUNTS = {"encoder_layers": 1, "decoder_layers": 1, "d_model": 1, "encoder_ffn_dim": 1,
           "decoder_ffn_dim": 1, "encoder_attention_heads": 1, "decoder_attention_heads": 1,
           "max_position_embeddings": 2, "pad_token_id": 0, "eos_token_id": 0,
           "decoder_start_token_id": 0}


def _check_config(config: _Entries, path: Path) -> None:
    """Raises ValueError naming config.json and the first key whose value is not an integer of
    its range; optional keys may be missing (or null: a null decoder start is the pad, as
    Marian's default)."""
    for key, least in _COUNTS.items():
        value = config.get(key) if key in ("max_position_embeddings", "decoder_start_token_id") \
            else config[key]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{path}: {key}={value!r} is not an integer of at least {least}")


def _setting(config: _Entries, key: str, default: float | int) -> float | int:
    """An optional setting of config.json: ``default`` where it is missing or null (a null went
    on into the model config: ``max_position_embeddings`` and the dropouts were a TypeError
    traceback in build_model); a dropout must be a number of [0, 1) (a string was imported and
    failed later)."""
    value = config.get(key)
    if value is None:
        return default
    if key.endswith("dropout") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                    or not 0 <= value < 1):
        raise ValueError(f"{config.source}: {key}={value!r} is not a number of [0, 1)")
    return value


def _target_vocab(d: Path, share: bool, src_vocab: _Entries) -> _Entries:
    """The target side's vocabulary: target_vocab.json where tokenizer_config.json says the
    vocabularies are separate (as MarianTokenizer reads it), or where the embeddings are not
    shared and the file is there; else vocab.json. A separate one that is missing is an error:
    read from vocab.json, every target row got a source piece, and the model wrote source words."""
    tok_config = d / "tokenizer_config.json"
    separate = bool(_read_json(tok_config).get("separate_vocabs")) if tok_config.exists() else False
    target = d / "target_vocab.json"
    if separate and not target.exists():
        raise ValueError(f"{tok_config}: separate_vocabs is true, but {target} is missing")
    return _read_json(target) if separate or (not share and target.exists()) else src_vocab


def marian_languages(directory: str | os.PathLike,
                     wanted: tuple[str, ...] = ("src_lang", "tgt_lang")) -> dict[str, str]:
    """The source and target languages tokenizer_config.json names (``source_lang`` and
    ``target_lang``, as Hugging Face's OPUS-MT conversion writes them: ``en`` and ``zh`` for
    opus-mt-en-zh, a group such as ``ROMANCE`` for a multilingual model), as ``src_lang`` and
    ``tgt_lang``; those it does not name are left out. Recorded in the imported checkpoint as
    ``data.src_lang`` / ``data.tgt_lang``: BLEU is tokenized by the target language (zh, ja, ko
    have their own tokenizers; without one a Chinese target was scored with 13a, BLEU near 0).
    ``wanted``: those to read (one given on the command line is not read, nor refused).

    Raises:
        ValueError: naming the file and key of a value that is not a language code.
    """
    path = Path(directory) / "tokenizer_config.json"
    if not path.exists():
        return {}
    config, found = _read_json(path), {}
    for key, name in (("source_lang", "src_lang"), ("target_lang", "tgt_lang")):
        value = config.get(key)
        if value in (None, "") or name not in wanted:  # "" names none (transformers loads it so)
            continue
        if not isinstance(value, str) or not re.fullmatch(r"\S+", value):
            raise ValueError(f"{path}: {key}={value!r} is not a language code (such as 'zh'); "
                             f"give mt-import --{name.replace('_', '-')}")
        found[name] = value
    return found


def _unused_weights(weights: dict[str, Tensor], used: set[str], path: Path) -> None:
    """Raises ValueError naming weights that config.json's model does not have (layers past
    ``decoder_layers``: left out, the model translated nonsense); embedding tables, positions
    (mt computes them) and a tied output layer are not layers and may be spare."""
    spare = {"model.shared.weight", "model.encoder.embed_tokens.weight", "lm_head.weight",
             "model.decoder.embed_tokens.weight", "final_logits_bias"}
    unused = sorted(k for k in weights if k not in used and k not in spare
                    and not k.endswith("embed_positions.weight"))
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ValueError(f"{path}: {', '.join(unused[:3])}{more} are weights that config.json's "
                         "layers do not use; check its encoder_layers and decoder_layers")


def import_hf(directory: str | os.PathLike) -> tuple[Transformer, Tokenizer]:
    """Reads a Hugging Face Marian directory (config.json, weights, *.spm, vocab.json) into an mt
    model and tokenizer with mt's special ids. Needs neither ``transformers`` nor a network."""
    d = Path(directory)
    config = _read_json(d / "config.json")
    if config.get("model_type") != "marian":
        raise ValueError(f"{d / 'config.json'}: model_type={config.get('model_type')!r}; "
                         "only Marian models (model_type=marian, e.g. OPUS-MT) can be imported")
    for a, b in (("encoder_ffn_dim", "decoder_ffn_dim"),
                 ("encoder_attention_heads", "decoder_attention_heads")):
        if config[a] != config[b]:
            raise ValueError(f"{d / 'config.json'}: {a}={config[a]} differs from {b}={config[b]};"
                             " mt uses one value for both stacks")
    activation = config.get("activation_function", "gelu")
    if activation not in HF_ACTIVATIONS:
        raise ValueError(f"{d / 'config.json'}: activation_function={activation!r} is not one of "
                         f"{sorted(HF_ACTIVATIONS)}")
    _check_config(config, d / "config.json")
    weights = _read_hf_weights(d)
    share = config.get("share_encoder_decoder_embeddings", True)
    tie_out = config.get("tie_word_embeddings", True)
    src_vocab = _read_json(d / "vocab.json")
    tgt_vocab = _target_vocab(d, share, src_vocab)
    src_table = _first(weights, ["model.encoder.embed_tokens.weight", "model.shared.weight"], d)
    tgt_table = _first(weights, ["model.decoder.embed_tokens.weight", "model.shared.weight"], d)
    out_table = tgt_table if tie_out else _first(weights, ["lm_head.weight"], d)
    bias = weights.get("final_logits_bias", torch.zeros(1, out_table.size(0))).view(-1)
    start = config.get("decoder_start_token_id")
    if start is None:  # missing or null: Marian starts from the pad
        start = config["pad_token_id"]
    for key, row in (("pad_token_id", config["pad_token_id"]), ("eos_token_id",
                     config["eos_token_id"]), ("decoder_start_token_id", start)):
        if row >= out_table.size(0):
            raise ValueError(f"{d / 'config.json'}: {key}={row} is past the {out_table.size(0)} "
                             "rows of the target vocabulary")
    tgt_order = marian_rows(tgt_vocab, out_table.size(0), tgt_vocab.get("<pad>"), start,
                            config["eos_token_id"])
    # A shared table needs one order; a source of its own never holds the decoder start.
    src_order = tgt_order if share else marian_rows(
        src_vocab, src_table.size(0), src_vocab.get("<pad>"), None, src_vocab["</s>"])

    if share and tie_out:
        tie = "all"
    elif not share and tie_out:
        tie = "decoder"
    else:
        tie = "none"
    cfg = ModelConfig(
        name=f"marian:{d.name}", encoder_layers=config["encoder_layers"],
        decoder_layers=config["decoder_layers"], d_model=config["d_model"],
        ffn_dim=config["encoder_ffn_dim"], heads=config["encoder_attention_heads"],
        dropout=_setting(config, "dropout", 0.1),
        attention_dropout=_setting(config, "attention_dropout", 0.0),
        activation_dropout=_setting(config, "activation_dropout", 0.0),
        activation=HF_ACTIVATIONS[activation], norm="post", positions="sinusoidal",
        max_positions=_setting(config, "max_position_embeddings", 1024), tie_embeddings=tie,
        scale_embeddings=config.get("scale_embedding", False), final_logits_bias=True,
        src_vocab_size=len(src_order), tgt_vocab_size=len(tgt_order),
    )
    model = build_model(cfg)
    sd, used = {}, set()
    for mt_name, hf_names in marian_names(cfg):
        for kind in ("weight", "bias"):
            names = [f"{n}.{kind}" for n in hf_names]
            sd[f"{mt_name}.{kind}"] = torch.cat([weights[n] for n in names], dim=0)
            used.update(names)
    _unused_weights(weights, used, weights.source)
    sd["src_embed.weight"] = _take(src_table, src_order)
    sd["tgt_embed.weight"] = _take(tgt_table, tgt_order)
    sd["output_proj.weight"] = _take(out_table, tgt_order)
    sd["final_logits_bias"] = _take(bias, tgt_order, fill=NEVER)
    try:
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    except RuntimeError as err:  # "size mismatch for ...", one line per tensor
        raise ValueError(f"{d}: the weights do not have config.json's sizes ("
                         f"{str(err).splitlines()[1].strip()})") from None
    model.eval()

    src_spm, tgt_spm = (d / "source.spm").read_bytes(), (d / "target.spm").read_bytes()
    src_pieces = _pieces(src_order, src_vocab)
    codes = [p for p in src_pieces if LANGUAGE_CODE.fullmatch(p)]
    if codes:
        log.info("%d target-language codes (%s%s): start each source line with one, as in '%s "
                 "Hello'", len(codes), " ".join(codes[:5]), " ..." * (len(codes) > 5), codes[0])
    src_proto = _remap_file(d / "source.spm", src_spm, src_pieces, language_codes=True)
    tgt_proto = _remap_file(d / "target.spm", tgt_spm, _pieces(tgt_order, tgt_vocab))
    return model, Tokenizer(src_proto, None if tgt_proto == src_proto else tgt_proto)


def _remap_file(path: Path, proto: bytes, pieces: list[str], language_codes: bool = False
                ) -> bytes:
    """``remap_spm`` of the model read from ``path``, whose parse error names the file."""
    from google.protobuf.message import DecodeError

    if not proto:  # parses, as a model of no pieces: every line one piece, or <unk>
        raise ValueError(f"{path}: not a SentencePiece model (no pieces; an empty file?)")
    try:
        return remap_spm(proto, pieces, language_codes)
    except DecodeError as err:
        raise ValueError(f"{path}: not a SentencePiece model ({err})") from None


if __name__ == "__main__":  # python -m mt.import_hf exited 0 without a word and wrote nothing
    from mt.interop import import_main

    import_main()
