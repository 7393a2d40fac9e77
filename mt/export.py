"""Export an mt model to Hugging Face Marian or to CTranslate2 (the ``mt-export`` CLI is in
``mt.interop``).

- ``export_hf``: a ``transformers`` Marian directory (``MarianMTModel`` and ``MarianTokenizer``
  load it). Marian is a post-norm Transformer with sinusoidal positions, so only models of that
  shape can go there; any other option is named in the error. mt's special ids (pad=0, unk=1,
  bos=2, eos=3) are kept: vocab.json lists the SentencePiece pieces in id order, and decoding
  starts from BOS (``decoder_start_token_id=2``).
- ``export_ctranslate2``: a CTranslate2 model directory for any mt model (pre- or post-norm,
  sinusoidal or learned positions), built with CTranslate2's own ``TransformerSpec``, with the
  SentencePiece model(s) beside it.

Both are a renaming of tensors; no weight is changed. mt fuses self-attention q/k/v into
``qkv_proj`` (3D, D) and cross-attention k/v into ``kv_proj`` (2D, D), rows in that order; Marian
keeps them apart, CTranslate2 fuses them the same way.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ModelConfig
from mt.model import Transformer
from mt.tokenizer import Tokenizer

SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu"}
# A target-language code, which MarianTokenizer cuts off the start of a source: '>>' to the first
# '<<'. mt's piece for it is '▁' + the code (mt.import_hf.remap_spm).
LANGUAGE_CODE = re.compile(r">>[^\s<]+<<")


# ---------------------------------------------------------------------------------- tensor names

def marian_names(cfg: ModelConfig) -> Iterator[tuple[str, list[str]]]:
    """(mt module, [Marian modules]) for every per-layer Linear/LayerNorm; a fused mt matrix maps to
    several Marian ones, whose rows it stacks in this order."""
    for i in range(cfg.encoder_layers):
        yield from _layer_names(f"encoder_layers.{i}.", f"model.encoder.layers.{i}.", "attn_sub")
    for i in range(cfg.decoder_layers):
        yield from _layer_names(f"decoder_layers.{i}.", f"model.decoder.layers.{i}.", "self_sub",
                                cross=True)


def _layer_names(mt: str, hf: str, self_norm: str,
                 cross: bool = False) -> Iterator[tuple[str, list[str]]]:
    yield mt + "self_attn.qkv_proj", [hf + f"self_attn.{p}_proj" for p in "qkv"]
    yield mt + "self_attn.out_proj", [hf + "self_attn.out_proj"]
    yield mt + self_norm + ".norm", [hf + "self_attn_layer_norm"]
    if cross:
        yield mt + "cross_attn.q_proj", [hf + "encoder_attn.q_proj"]
        yield mt + "cross_attn.kv_proj", [hf + "encoder_attn.k_proj", hf + "encoder_attn.v_proj"]
        yield mt + "cross_attn.out_proj", [hf + "encoder_attn.out_proj"]
        yield mt + "cross_sub.norm", [hf + "encoder_attn_layer_norm"]
    yield mt + "ffn.fc1", [hf + "fc1"]
    yield mt + "ffn.fc2", [hf + "fc2"]
    yield mt + "ffn_sub.norm", [hf + "final_layer_norm"]


def check_marian(cfg: ModelConfig) -> None:
    """Raises a ValueError naming every option of ``cfg`` that Marian cannot express."""
    problems = marian_incompatibilities(cfg)
    if problems:
        raise ValueError("cannot export to Hugging Face Marian: " + "; ".join(problems)
                         + " (--format ctranslate2 takes any mt model)")


def marian_incompatibilities(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` that Hugging Face's MarianMTModel cannot express (empty: none)."""
    problems = []
    if cfg.norm != "post":
        problems.append(f"model.norm={cfg.norm} cannot be expressed by Marian (post-norm only)")
    if cfg.positions != "sinusoidal":
        problems.append(f"model.positions={cfg.positions} cannot be expressed by Marian "
                        "(sinusoidal only)")
    if cfg.activation not in HF_ACTIVATIONS:
        problems.append(f"model.activation={cfg.activation} has no Marian equivalent")
    return problems


# ------------------------------------------------------------------------------- export: HF Marian

def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """mt weights under MarianMTModel's names (fused projections split); tied weights repeated."""
    cfg, sd = model.cfg, model.state_dict()
    out = {}
    for mt_name, hf_names in marian_names(cfg):
        for kind in ("weight", "bias"):
            for hf_name, part in zip(hf_names, sd[f"{mt_name}.{kind}"].chunk(len(hf_names), dim=0),
                                     strict=True):
                out[f"{hf_name}.{kind}"] = part
    out["model.encoder.embed_tokens.weight"] = sd["src_embed.weight"]
    out["model.decoder.embed_tokens.weight"] = sd["tgt_embed.weight"]
    if cfg.tie_embeddings == "all":
        out["model.shared.weight"] = sd["src_embed.weight"]
    out["lm_head.weight"] = sd["output_proj.weight"]
    bias = sd.get("final_logits_bias", torch.zeros(cfg.tgt_vocab_size))
    out["final_logits_bias"] = bias.view(1, -1)
    return {k: v.detach().clone().float().contiguous() for k, v in out.items()}


def hf_config(cfg: ModelConfig) -> dict:
    """MarianConfig keyword arguments for ``cfg`` (mt's special ids; decoding starts with BOS)."""
    return dict(
        vocab_size=cfg.src_vocab_size, decoder_vocab_size=cfg.tgt_vocab_size,
        max_position_embeddings=cfg.max_positions, d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers,
        encoder_ffn_dim=cfg.ffn_dim, decoder_ffn_dim=cfg.ffn_dim,
        encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads,
        activation_function=HF_ACTIVATIONS[cfg.activation], dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        scale_embedding=cfg.scale_embeddings,
        share_encoder_decoder_embeddings=cfg.tie_embeddings == "all",
        tie_word_embeddings=cfg.tie_embeddings != "none",
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID,
    )


def hf_model(model: Transformer):
    """A ``transformers.MarianMTModel`` holding ``model``'s weights (its own default generation
    settings; ``export_hf`` replaces them with mt's search defaults).

    Raises:
        ValueError: naming every model option Marian cannot express.
    """
    check_marian(model.cfg)
    from transformers import MarianConfig, MarianMTModel

    hf = MarianMTModel(MarianConfig(**hf_config(model.cfg)))
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [k for k in missing if not k.endswith("embed_positions.weight")]
    if missing or unexpected:  # a mapping bug, not a user error
        raise RuntimeError(f"Marian weight names do not match: missing {missing}, "
                           f"unexpected {unexpected}")
    return hf


def placeholder_vocabulary(size: int) -> list[str]:
    """Token strings for a model without a tokenizer (benchmarks on random weights): mt's special
    pieces at their ids, then ``t4``, ``t5``, ... so that id i is entry i."""
    return [SPECIAL_PIECES[i] for i in range(len(SPECIAL_PIECES))] + [
        f"t{i}" for i in range(len(SPECIAL_PIECES), size)]


def _vocab(proto: bytes) -> dict[str, int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    return {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}


def _source_vocab(proto: bytes) -> dict[str, int]:
    """vocab.json: a code's piece ``▁>>fra<<`` is listed as ``>>fra<<``, the name under which
    MarianTokenizer looks up the code it cuts off a source (else it reads ``<unk>``)."""
    vocab = _vocab(proto)

    def name(piece: str) -> str:
        code = piece.removeprefix("\u2581")
        taken = code == piece or code in vocab
        return code if not taken and LANGUAGE_CODE.fullmatch(code) else piece

    return {name(piece): i for piece, i in vocab.items()}


def export_hf(model: Transformer, tokenizer: Tokenizer, out_dir: str | os.PathLike,
              languages: dict | None = None) -> Path:
    """Writes a directory that ``MarianMTModel`` / ``MarianTokenizer.from_pretrained`` load.

    Files: config.json, generation_config.json, model.safetensors, source.spm / target.spm (the
    same model twice for a joint vocabulary), vocab.json (piece -> id, in SentencePiece order, so
    the ids are mt's; a target-language code under its Marian name), target_vocab.json for
    separate vocabularies (where the target names an id otherwise), tokenizer_config.json.
    ``languages``: the checkpoint's ``data`` config; its ``src_lang`` / ``tgt_lang`` go into
    tokenizer_config.json as ``source_lang`` / ``target_lang`` (as OPUS-MT's), where
    ``mt-import`` reads them back: BLEU is tokenized by the target language.

    Raises:
        ValueError: naming every model option Marian cannot express.
    """
    from transformers import GenerationConfig

    cfg = model.cfg
    hf = hf_model(model)
    # What mt's search does: never PAD or BOS, EOS at the length limit, its default beam.
    hf.generation_config = GenerationConfig(
        decoder_start_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        forced_eos_token_id=EOS_ID, bad_words_ids=[[PAD_ID], [BOS_ID]], num_beams=5,
        max_length=min(512, cfg.max_positions),
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    (out / "source.spm").write_bytes(tokenizer.src_proto)
    (out / "target.spm").write_bytes(tokenizer.tgt_proto or tokenizer.src_proto)
    # Separate vocabularies are separate names for the ids, not two SentencePiece models: an
    # imported multilingual model (one vocab.json) has two models that differ only in how a code
    # is held (▁>>fra<< or an UNUSED >>fra<<), and came back with two vocabulary files.
    vocab = _source_vocab(tokenizer.src_proto)
    tgt_vocab = vocab if tokenizer.joint else _vocab(tokenizer.tgt_proto)
    separate = tgt_vocab != vocab
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    if separate:
        (out / "target_vocab.json").write_text(json.dumps(tgt_vocab, ensure_ascii=False))
    tok_config = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": separate,
                  "model_max_length": cfg.max_positions, "unk_token": "<unk>",
                  "eos_token": "</s>", "pad_token": "<pad>"}
    if separate:
        tok_config["target_vocab_file"] = "target_vocab.json"
    for key, name in (("src_lang", "source_lang"), ("tgt_lang", "target_lang")):
        if isinstance((languages or {}).get(key), str):
            tok_config[name] = languages[key]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


# ------------------------------------------------------------------------------ export: CTranslate2

def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer | None = None):
    """A ``ctranslate2.specs.TransformerSpec`` holding the model's weights (any norm/positions).

    The vocabularies are the tokenizer's pieces in id order, or ``placeholder_vocabulary`` of the
    model's sizes without a tokenizer. The weights are copies: CTranslate2 edits arrays in place.
    """
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "silu": common_spec.Activation.SWISH}[cfg.activation]
    pre = cfg.norm == "pre"
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.heads, pre_norm=pre, activation=activation)
    sd = {k: v.detach().float().cpu().numpy().copy() for k, v in model.state_dict().items()}

    def linear(s, name: str) -> None:
        s.weight, s.bias = sd[name + ".weight"], sd[name + ".bias"]

    def norm(s, name: str) -> None:
        s.gamma, s.beta = sd[name + ".weight"], sd[name + ".bias"]

    def ffn(s, prefix: str) -> None:
        linear(s.linear_0, prefix + "ffn.fc1")
        linear(s.linear_1, prefix + "ffn.fc2")
        norm(s.layer_norm, prefix + "ffn_sub.norm")

    for stack, table, positions in ((spec.encoder, "src_embed", "src_positions"),
                                    (spec.decoder, "tgt_embed", "tgt_positions")):
        embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        embeddings.weight = sd[table + ".weight"]
        stack.scale_embeddings = model.embed_scale
        pos = getattr(model, positions)
        stack.position_encodings.encodings = (
            pos.table.weight if pos.learned else pos.table).detach().float().cpu().numpy().copy()
    if pre:
        norm(spec.encoder.layer_norm, "encoder_norm")
        norm(spec.decoder.layer_norm, "decoder_norm")
    for i, s in enumerate(spec.encoder.layer):
        p = f"encoder_layers.{i}."
        linear(s.self_attention.linear[0], p + "self_attn.qkv_proj")
        linear(s.self_attention.linear[1], p + "self_attn.out_proj")
        norm(s.self_attention.layer_norm, p + "attn_sub.norm")
        ffn(s.ffn, p)
    for i, s in enumerate(spec.decoder.layer):
        p = f"decoder_layers.{i}."
        linear(s.self_attention.linear[0], p + "self_attn.qkv_proj")
        linear(s.self_attention.linear[1], p + "self_attn.out_proj")
        norm(s.self_attention.layer_norm, p + "self_sub.norm")
        linear(s.attention.linear[0], p + "cross_attn.q_proj")
        linear(s.attention.linear[1], p + "cross_attn.kv_proj")
        linear(s.attention.linear[2], p + "cross_attn.out_proj")
        norm(s.attention.layer_norm, p + "cross_sub.norm")
        ffn(s.ffn, p)
    spec.decoder.projection.weight = sd["output_proj.weight"]
    if "final_logits_bias" in sd:
        spec.decoder.projection.bias = sd["final_logits_bias"]
    spec.config.layer_norm_epsilon = 1e-5  # torch's LayerNorm default
    spec.config.add_source_eos = True  # mt's sources end with EOS; users pass the pieces alone
    spec.config.unk_token = SPECIAL_PIECES[UNK_ID]
    spec.config.bos_token = spec.config.decoder_start_token = SPECIAL_PIECES[BOS_ID]
    spec.config.eos_token = SPECIAL_PIECES[EOS_ID]
    if tokenizer is None:
        src_vocab = placeholder_vocabulary(cfg.src_vocab_size)
        tgt_vocab = placeholder_vocabulary(cfg.tgt_vocab_size)
    else:
        src_vocab = list(_vocab(tokenizer.src_proto))
        tgt_vocab = src_vocab if tokenizer.joint else list(_vocab(tokenizer.tgt_proto))
    spec.register_source_vocabulary(src_vocab)
    spec.register_target_vocabulary(tgt_vocab)
    return spec


def export_ctranslate2(model: Transformer, tokenizer: Tokenizer | None,
                       out_dir: str | os.PathLike, quantization: str | None = None,
                       shortlist=None) -> Path:
    """Writes a CTranslate2 model directory plus ``spm.model`` (or ``src.model``/``tgt.model``),
    replacing ``out_dir`` if it exists.

    Args:
        tokenizer: None writes no SentencePiece model and names tokens by
            ``placeholder_vocabulary`` (benchmarks on random weights).
        quantization: CTranslate2's weight type (int8, int8_float32, float16, ...); None keeps fp32.
        shortlist: an ``mt.shortlist.Shortlist`` for this model, written into the export as
            CTranslate2's vocabulary map (``vmap.txt``, for ``use_vmap``).
    """
    from ctranslate2.converters.converter import Converter

    class _SpecConverter(Converter):
        def _load(self):
            return ctranslate2_spec(model, tokenizer)

    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        vmap = None
        if shortlist is not None:
            vmap = str(Path(tmp) / "vmap.txt")
            shortlist.write_vmap(tokenizer, vmap)
        _SpecConverter().convert(str(out), vmap=vmap, quantization=quantization, force=True)
    if tokenizer is not None and tokenizer.joint:
        (out / "spm.model").write_bytes(tokenizer.src_proto)
    elif tokenizer is not None:
        (out / "src.model").write_bytes(tokenizer.src_proto)
        (out / "tgt.model").write_bytes(tokenizer.tgt_proto)
    return out


if __name__ == "__main__":  # python -m mt.export exited 0 without a word and wrote nothing
    from mt.interop import export_main

    export_main()
