"""Round trips between mt, Hugging Face Marian and CTranslate2 on tiny random models.

Each test converts a model and checks that the other toolkit computes the same function: the same
token ids from the same text, the same logits (to 1e-4), the same greedy and beam outputs token for
token. Nothing is downloaded; the "OPUS-MT" model is made here, with OPUS-MT's special ids
(eos=0, unk=1, pad=last, decoding from pad) and a vocab.json whose order is not SentencePiece's.

Beam search is compared with length penalty 0: mt normalises by GNMT's ((5+len)/6)^alpha and
Hugging Face by len^alpha, so only alpha=0 means the same ranking in both.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from mt.checkpoint import load_model, model_state, save_atomic
from mt.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from mt.data import read_lines
from mt.interop import export_main, import_main
from mt.model import build_model
from mt.search import beam_search, greedy_search
from mt.tokenizer import Tokenizer
from mt.translate import main as translate_main

# MarianTokenizer's advice (Moses punctuation normalisation) is not used by its encoding anyway
pytestmark = pytest.mark.filterwarnings("ignore:Recommended.*sacremoses")

MAX_LEN = 24  # output budget, EOS included, for both toolkits
BEAM = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, above all on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def separate_tokenizer(corpus_dir) -> Tokenizer:
    """Two SentencePiece models (English, demo language), mt's special ids."""
    from mt.config import TokenizerConfig
    from mt.tokenizer import train_tokenizer

    return train_tokenizer(read_lines(corpus_dir / "train.en"), read_lines(corpus_dir / "train.zz"),
                           TokenizerConfig(vocab_size=150, joint=False), seed=1)


def _texts(corpus_dir, n: int = 6) -> list[str]:
    lines = read_lines(corpus_dir / "test.en")[:n]
    return lines + ["", "zzqx unseen ✓"]  # an empty line and characters the vocabulary lacks


def _pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, L) and the attention mask (B, L), 1 = a real token."""
    out = torch.full((len(seqs), max(map(len, seqs))), pad, dtype=torch.long)
    mask = torch.zeros_like(out)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return out, mask


def _perturb(module: torch.nn.Module, seed: int, scale: float) -> None:
    """Noise on every parameter (biases and LayerNorms included), so a misplaced tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:  # not HF's frozen sinusoids
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _mt_model(tokenizer: Tokenizer, src: torch.Tensor | None = None, seed: int = 0, **kw):
    """A random mt model whose greedy outputs on ``src`` (B, S), if given, differ in length.

    A random Transformer tends to repeat one token until the budget, whatever the source; its
    sublayers are made to outweigh the residual stream (more dependence on the source and the
    position), and the EOS bias is raised until the outputs are a mix of lengths.
    """
    torch.manual_seed(seed)
    cfg = dict(encoder_layers=2, decoder_layers=2, d_model=32, ffn_dim=64, heads=4, dropout=0.0,
               max_positions=64, final_logits_bias=True, src_vocab_size=tokenizer.src_vocab_size,
               tgt_vocab_size=tokenizer.tgt_vocab_size)
    cfg.update(kw)
    model = build_model(ModelConfig(**cfg)).eval()
    _perturb(model, seed, 0.1)
    with torch.no_grad():
        for layer in model.decoder_layers:
            layer.ffn.fc2.weight.mul_(3.0)
            layer.cross_attn.out_proj.weight.mul_(3.0)
        model.output_proj.weight.mul_(3.0)  # sharp distributions: no near-ties in the arg-max
        for _ in range(40 if src is not None else 0):
            lengths = [len(h.tokens) for h in greedy_search(model, src, max_len_a=0,
                                                            max_len_b=MAX_LEN)]
            if len(set(lengths)) > 1 and max(lengths) > 0:
                break
            model.final_logits_bias[EOS_ID] += 0.5
    return model


def _hf_outputs(sequences: torch.Tensor, eos: int) -> list[list[int]]:
    """generate()'s (B, 1 + T) rows -> tokens after the start token, up to EOS."""
    out = []
    for row in sequences[:, 1:].tolist():
        out.append(row[: row.index(eos)] if eos in row else row)
    return out


def _generate(hf, ids, mask, beams: int, bad: list[int], eos: int) -> list[list[int]]:
    """Hugging Face's greedy / beam search, set up as mt's: no length penalty, stop at ``beams``
    finished hypotheses, never the ``bad`` tokens, EOS forced at the budget.

    Hugging Face's own ``forced_eos_token_id`` gives the forced EOS probability 1 where mt keeps
    the model's probability for it (mt.search: a score is always the model's); a beam ranks such
    hypotheses differently, so mt's rule is passed as a logits processor here.
    """
    from transformers import LogitsProcessor, LogitsProcessorList

    class ForceEosAtBudget(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.size(-1) == MAX_LEN:  # the start token + MAX_LEN - 1 generated
                kept = scores[:, eos].clone()
                scores = torch.full_like(scores, -torch.inf)
                scores[:, eos] = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))
            return scores

    with torch.no_grad():
        seq = hf.generate(input_ids=ids, attention_mask=mask, num_beams=beams, do_sample=False,
                          max_length=MAX_LEN + 1, length_penalty=0.0, early_stopping=True,
                          bad_words_ids=[[t] for t in bad], forced_eos_token_id=None,
                          logits_processor=LogitsProcessorList([ForceEosAtBudget()]),
                          num_return_sequences=1)
    return _hf_outputs(seq, eos)


def _mt_outputs(model, src: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    greedy = [h.tokens for h in greedy_search(model, src, max_len_a=0, max_len_b=MAX_LEN)]
    beam = [h[0].tokens for h in beam_search(model, src, beam_size=BEAM, lenpen=0.0,
                                             max_len_a=0, max_len_b=MAX_LEN)]
    return greedy, beam


def _save(model, tokenizer, path) -> str:
    save_atomic(model_state(model, tokenizer, None), path)
    return str(path)


# ------------------------------------------------------------------------------------ mt -> HF

@pytest.mark.parametrize("tie, activation, scale, joint", [("all", "relu", True, True),
                                                           ("decoder", "gelu", False, True),
                                                           ("none", "silu", True, True),
                                                           ("decoder", "relu", True, False)])
def test_export_hf_matches_mt(tmp_path, tokenizer_dir, separate_tokenizer, corpus_dir, tie,
                              activation, scale, joint, caplog):
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.load(tokenizer_dir) if joint else separate_tokenizer
    texts = _texts(corpus_dir)
    ids = tok.encode_src(texts)
    src, mask = _pad(ids, PAD_ID)
    model = _mt_model(tok, src, tie_embeddings=tie, activation=activation,
                      scale_embeddings=scale)
    export_main(["-m", _save(model, tok, tmp_path / "m.pt"), "--format", "hf",
                 "--out", str(tmp_path / "hf")])
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    hf_tok = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(texts)["input_ids"] == ids  # the same ids from the same text
    mask_bits = os.umask(0o022)
    os.umask(mask_bits)  # every file readable as any new file is (transformers wrote 0600)
    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()} == {0o666 & ~mask_bits}

    tgt_in = torch.cat([torch.full((len(ids), 1), BOS_ID), src[:, :-1].clamp(min=4)], dim=1)
    tgt_in = tgt_in.clamp(max=tok.tgt_vocab_size - 1)
    with torch.no_grad():
        expected = model(src, tgt_in)
        got = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    greedy, beam = _mt_outputs(model, src)
    assert _generate(hf, src, mask, 1, [PAD_ID, BOS_ID], EOS_ID) == greedy
    assert _generate(hf, src, mask, BEAM, [PAD_ID, BOS_ID], EOS_ID) == beam
    assert len(set(map(len, greedy))) > 1  # a non-trivial comparison
    assert hf_tok.batch_decode(
        [t + [EOS_ID] for t in greedy], skip_special_tokens=True) == tok.decode_tgt(greedy)

    # and back: the same outputs, and no row said to be left out (an mt export's source <s> row
    # is unused there, not lost; it was warned about)
    pytest.importorskip("google.protobuf")
    with caplog.at_level("WARNING"):
        import_main(["--from", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back.pt")])
    assert "left out" not in caplog.text
    back, _, _ = load_model(tmp_path / "back.pt")
    assert _mt_outputs(back, src)[0] == greedy


def test_export_hf_names_what_marian_cannot_express(tmp_path, tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    model = _mt_model(tok, norm="pre", positions="learned")
    ckpt = _save(model, tok, tmp_path / "m.pt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as err:  # an existing directory needs --force
        export_main(["-m", ckpt, "--format", "hf", "--out", str(out)])
    assert "--force" in str(err.value)
    with pytest.raises(SystemExit) as err:
        export_main(["-m", ckpt, "--format", "hf", "--out", str(out), "--force"])
    assert "model.norm=pre" in str(err.value) and "model.positions=learned" in str(err.value)
    assert (out / "keep.txt").read_text() == "mine"  # a refused export deletes nothing


# ---------------------------------------------------------------------------- mt -> CTranslate2

@pytest.mark.parametrize("norm, positions", [("post", "sinusoidal"), ("pre", "learned")])
def test_export_ctranslate2_greedy_matches_mt(tmp_path, tokenizer_dir, corpus_dir, norm,
                                              positions):
    ctranslate2 = pytest.importorskip("ctranslate2")
    tok = Tokenizer.load(tokenizer_dir)
    texts = [t for t in _texts(corpus_dir) if t]  # CTranslate2 answers an empty input with nothing
    src, _ = _pad(tok.encode_src(texts), PAD_ID)
    model = _mt_model(tok, src, norm=norm, positions=positions, tie_embeddings="decoder")
    out = tmp_path / "ct2"
    export_main(["-m", _save(model, tok, tmp_path / "m.pt"), "--format", "ctranslate2",
                 "--out", str(out)])
    assert (out / "model.bin").exists() and (out / "spm.model").read_bytes() == tok.src_proto

    greedy, _ = _mt_outputs(model, src)
    assert len(set(map(len, greedy))) > 1
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    pieces = [tok.src.encode(t, out_type=str) for t in texts]  # CTranslate2 appends </s>
    results = translator.translate_batch(
        pieces, beam_size=1, max_decoding_length=MAX_LEN - 1, min_decoding_length=0,
        suppress_sequences=[["<pad>"], ["<s>"]])
    got = [[tok.tgt.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    assert got == greedy


def test_export_ctranslate2_int8(tmp_path, tokenizer_dir):
    ctranslate2 = pytest.importorskip("ctranslate2")
    tok = Tokenizer.load(tokenizer_dir)
    model = _mt_model(tok)
    out = tmp_path / "ct2"
    export_main(["-m", _save(model, tok, tmp_path / "m.pt"), "--format", "ctranslate2",
                 "--out", str(out), "--quantization", "int8"])
    fp32 = tmp_path / "ct2_fp32"
    export_main(["-m", str(tmp_path / "m.pt"), "--format", "ctranslate2", "--out", str(fp32)])
    assert (out / "model.bin").stat().st_size < 0.6 * (fp32 / "model.bin").stat().st_size
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="int8",
                                        intra_threads=1)
    assert len(translator.translate_batch([["▁a"]], max_decoding_length=5)) == 1
    # --force replaces an export only with a whole new one: a mistake keeps the old one, and
    # nothing else is left beside it.
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(SystemExit, match="mt-export: .*foo"):
        export_main(["-m", str(tmp_path / "m.pt"), "--format", "ctranslate2", "--out", str(out),
                     "--quantization", "foo", "--force"])
    assert sorted(p.name for p in out.iterdir()) == before
    export_main(["-m", str(tmp_path / "m.pt"), "--format", "ctranslate2", "--out", str(out),
                 "--force"])
    assert (out / "model.bin").stat().st_size == (fp32 / "model.bin").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "ct2_fp32", "m.pt"]
    # Through a symlink the directory it points to is replaced, and the link stays.
    (tmp_path / "link").symlink_to(out)
    export_main(["-m", str(tmp_path / "m.pt"), "--format", "ctranslate2", "--out",
                 str(tmp_path / "link"), "--quantization", "int8", "--force"])
    assert (tmp_path / "link").is_symlink() and (out / "model.bin").stat().st_size < (
        0.6 * (fp32 / "model.bin").stat().st_size)


def test_export_refuses_to_replace_the_working_directory_or_the_model(tmp_path, tokenizer_dir,
                                                                       monkeypatch):
    tok = Tokenizer.load(tokenizer_dir)
    (tmp_path / "run").mkdir()
    ckpt = _save(_mt_model(tok), tok, tmp_path / "run" / "m.pt")
    monkeypatch.chdir(tmp_path / "run")
    for out, message in ((".", "holds the working directory"), ("..", "holds the working"),
                         (str(tmp_path / "run"), "holds the working")):
        with pytest.raises(SystemExit, match=message):
            export_main(["-m", ckpt, "--format", "hf", "--out", out, "--force"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="holds the model"):
        export_main(["-m", ckpt, "--format", "hf", "--out", "run", "--force"])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["m.pt"]
    (tmp_path / "ct2").mkdir()
    (tmp_path / "ct2" / "list.pt").write_bytes(b"pieces")  # refused before it is read
    with pytest.raises(SystemExit, match="--out ct2 holds the shortlist .*list.pt; --force would"):
        export_main(["-m", ckpt, "--format", "ctranslate2", "--out", "ct2", "--force",
                     "--shortlist", "ct2/list.pt"])
    assert (tmp_path / "ct2" / "list.pt").read_bytes() == b"pieces"


def test_export_force_never_deletes_the_checkpoint_it_exports(tmp_path, tokenizer_dir):
    """-m names a run directory or a link: the checkpoint file it resolves to is what --force
    would delete, whether --out holds it, is it, or reaches it through a symlink."""
    tok = Tokenizer.load(tokenizer_dir)
    ckpts = tmp_path / "run" / "checkpoints"
    ckpt = _save(_mt_model(tok), tok, ckpts / "best.pt")
    (tmp_path / "to_ckpts").symlink_to(ckpts)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "m.pt").symlink_to(ckpt)
    cases = [("run", "run/checkpoints"),  # the run directory's best.pt is inside --out
             ("run", "run"),
             (ckpt, ckpt),  # --out is the model file itself
             ("run", "to_ckpts"),  # --out is a link to the folder that holds it
             ("elsewhere/m.pt", "run/checkpoints")]  # -m is a link into --out
    for model, out in cases:
        with pytest.raises(SystemExit, match="holds the model"):
            export_main(["-m", str(tmp_path / model), "--format", "ctranslate2",
                         "--out", str(tmp_path / out), "--force"])
    assert [p.name for p in ckpts.iterdir()] == ["best.pt"]
    assert load_model(ckpt)[0] is not None


@pytest.mark.parametrize("fmt", ["hf", "ctranslate2"])
def test_a_failed_export_write_is_one_line_and_keeps_the_old_export(tmp_path, tokenizer_dir, fmt):
    """A full disk was a traceback (safetensors' SafetensorError, CTranslate2's OSError); it is
    one line now, and the export that --force was replacing is still there, whole."""
    import subprocess
    import sys

    from conftest import REPO

    pytest.importorskip("ctranslate2" if fmt == "ctranslate2" else "transformers")
    tok = Tokenizer.load(tokenizer_dir)
    ckpt = _save(_mt_model(tok), tok, tmp_path / "m.pt")
    out = tmp_path / "out"
    export_main(["-m", ckpt, "--format", fmt, "--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    limit = max(p.stat().st_size for p in out.iterdir()) // 2  # the largest file cannot fit
    code = ("import resource, sys\nfrom mt.interop import export_main\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            f"export_main(['-m', {ckpt!r}, '--format', {fmt!r}, '--out', {str(out)!r}, "
            "'--force'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"mt-export: cannot write {out} (")
    assert result.stderr.strip().endswith("); nothing there was changed")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "out"]  # no temporary left


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_unwritable_export_names_out_not_its_temporary_folder(tmp_path, tokenizer_dir):
    """/proc takes no new folder: the error named the hidden temporary folder mt-export writes
    first (/proc/.x.w_jx6y7i), a name the user never gave."""
    tok = Tokenizer.load(tokenizer_dir)
    ckpt = _save(_mt_model(tok), tok, tmp_path / "m.pt")
    for out in ("/proc/mt-export-test", "/proc/mt-export-test/deeper"):
        with pytest.raises(SystemExit) as stop:
            export_main(["-m", ckpt, "--format", "hf", "--out", out])
        assert stop.value.code == (f"mt-export: cannot write {out} (No such file or directory); "
                                   "nothing there was changed")


def test_an_out_under_a_file_says_the_file_is_in_the_way(tmp_path, tokenizer_dir, capsys,
                                                          monkeypatch):
    """--out notes.txt/export: both commands said "cannot write ... (File exists)", which reads
    as if --out itself existed."""
    tok = Tokenizer.load(tokenizer_dir)
    ckpt = _save(_mt_model(tok), tok, tmp_path / "m.pt")
    (tmp_path / "notes.txt").write_text("mine\n")
    out = tmp_path / "notes.txt" / "deeper" / "export"
    with pytest.raises(SystemExit) as stop:
        export_main(["-m", ckpt, "--format", "hf", "--out", str(out)])
    assert stop.value.code == (f"mt-export: --out {out}: {tmp_path / 'notes.txt'} is a file, "
                               "not a directory")
    with pytest.raises(SystemExit) as stop:
        import_main(["--from", "hf", str(tmp_path), "--out", str(out / "m.pt")])
    assert stop.value.code == (f"mt-import: --out {out / 'm.pt'}: {tmp_path / 'notes.txt'} is a "
                               "file, not a directory")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    # an empty --out ("$UNSET") named the working directory: "mt-export:  exists; ..."
    with pytest.raises(SystemExit) as stop:
        import_main(["--from", "hf", str(tmp_path), "--out", ""])
    assert stop.value.code == "mt-import: --out is empty; name the checkpoint file to write"
    with pytest.raises(SystemExit):
        export_main(["-m", ckpt, "--format", "hf", "--out", ""])
    assert capsys.readouterr().err.endswith("error: --out is empty; name the directory to write\n")
    # a name of spaces is not empty: it is a legal name, said as what it is, with the way to it
    with pytest.raises(SystemExit) as stop:
        import_main(["--from", "hf", str(tmp_path), "--out", " "])
    assert stop.value.code == (
        "mt-import: --out ' ' is only whitespace (an unset shell variable between spaces?); name "
        "the checkpoint file to write, or give --out './ ' for one of that name")
    with pytest.raises(SystemExit):
        export_main(["-m", ckpt, "--format", "hf", "--out", "\t"])
    assert capsys.readouterr().err.endswith(
        "error: --out '\\t' is only whitespace (an unset shell variable between spaces?); name "
        "the directory to write, or give --out './\\t' for one of that name\n")
    monkeypatch.chdir(tmp_path)  # the way it gives writes a directory of that name
    export_main(["-m", ckpt, "--format", "hf", "--out", "./ "])
    assert (tmp_path / " " / "config.json").is_file()


def test_export_and_import_stopped_by_sigterm_leave_nothing_behind(tmp_path, tokenizer_dir,
                                                                   monkeypatch, capsys):
    """``timeout`` and ``kill`` send SIGTERM, which skipped the cleanup: a hidden temporary
    folder as large as the export stayed beside --out (mt-import: a temporary .pt beside its)."""
    import signal

    import mt.checkpoint
    import mt.export

    pytest.importorskip("transformers")
    tok = Tokenizer.load(tokenizer_dir)
    ckpt = _save(_mt_model(tok), tok, tmp_path / "m.pt")
    export_main(["-m", ckpt, "--format", "hf", "--out", str(tmp_path / "hf")])
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}

    def killed(*args, **kwargs):  # half written, then SIGTERM
        Path(args[-1]).mkdir(parents=True, exist_ok=True)
        (Path(args[-1]) / "config.json").write_text("{")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(mt.export, "export_hf", killed)
    with pytest.raises(SystemExit) as stop:
        export_main(["-m", ckpt, "--format", "hf", "--out", str(tmp_path / "hf"), "--force"])
    assert stop.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.endswith(f"mt-export: interrupted; {tmp_path / 'hf'} was not "
                                            "changed\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.pt"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back

    def saved_half(obj, path):
        Path(path).write_bytes(b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(mt.checkpoint.torch, "save", saved_half)
    with pytest.raises(SystemExit) as stop:
        import_main(["--from", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "x.pt")])
    assert stop.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.pt"]


# ----------------------------------------------------------------------------- HF (OPUS) -> mt

def _opus_like_dir(tmp_path, corpus_dir, transformers, separate: bool,
                   codes: tuple[str, ...] = ()) -> tuple:
    """A random Marian model with OPUS-MT's conventions, saved like an OPUS-MT download.

    Different source and target SentencePiece models (SentencePiece's default ids: unk=0, bos=1,
    eos=2, no pad) with vocabularies </s>=0, <unk>=1, pieces in a shuffled order, <pad>=last (the
    decoder start, a zero row): one vocab.json for the union of both sides' pieces, or
    (``separate``) vocab.json and target_vocab.json, one per side, of equal size (the smaller
    padded with pieces its SentencePiece model never produces), as Marian has one pad id.
    ``codes`` (``>>fra<<``): target-language rows of a multilingual model, in vocab.json only
    (neither SentencePiece model has them); their embeddings are made larger, so that, as in a
    trained model, the code changes the translation.
    """
    import sentencepiece as spm

    def train(lines: list[str]) -> tuple[bytes, set[str]]:
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                       vocab_size=120, hard_vocab_limit=False, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
        return model.getvalue(), {sp.id_to_piece(i) for i in range(sp.get_piece_size())
                                  if not (sp.is_control(i) or sp.is_unknown(i))}

    def vocab(pieces: set[str], size: int, seed: int) -> dict[str, int]:
        order = sorted(pieces) + [f"▁filler{i}" for i in range(size - len(pieces))]
        random.Random(seed).shuffle(order)
        return {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(order)},
                "<pad>": len(order) + 2}

    src_spm, src_pieces = train(read_lines(corpus_dir / "train.en"))
    tgt_spm, tgt_pieces = train(read_lines(corpus_dir / "train.zz"))
    src_pieces |= set(codes)
    if separate:
        size = max(len(src_pieces), len(tgt_pieces))
        src_vocab, tgt_vocab = vocab(src_pieces, size, 0), vocab(tgt_pieces, size, 1)
    else:
        src_vocab = tgt_vocab = vocab(src_pieces | tgt_pieces, len(src_pieces | tgt_pieces), 0)
    pad = len(src_vocab) - 1
    config = transformers.MarianConfig(
        vocab_size=pad + 1, decoder_vocab_size=pad + 1,
        share_encoder_decoder_embeddings=not separate,
        decoder_start_token_id=pad, pad_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=64,
        scale_embedding=True, activation_function="swish", dropout=0.0)
    torch.manual_seed(0)
    hf = transformers.MarianMTModel(config).eval()
    _perturb(hf, 1, 0.3)
    with torch.no_grad():
        hf.get_decoder().embed_tokens.weight[pad].zero_()
        hf.final_logits_bias.copy_(torch.randn(hf.final_logits_bias.shape) * 0.5)
        for code in codes:
            hf.get_encoder().embed_tokens.weight[src_vocab[code]].mul_(6.0)
    d = tmp_path / "opus"
    d.mkdir()
    (d / "source.spm").write_bytes(src_spm)
    (d / "target.spm").write_bytes(tgt_spm)
    (d / "vocab.json").write_text(json.dumps(src_vocab, ensure_ascii=False))
    tok_config = {"separate_vocabs": separate}
    if separate:
        (d / "target_vocab.json").write_text(json.dumps(tgt_vocab, ensure_ascii=False))
        tok_config["target_vocab_file"] = "target_vocab.json"
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    hf_tok = transformers.MarianTokenizer.from_pretrained(d)
    # as _mt_model: raise the EOS bias until the greedy outputs have several lengths
    ids, mask = _pad(hf_tok(_texts(corpus_dir))["input_ids"], pad)
    for _ in range(40):
        lengths = [len(t) for t in _generate(hf, ids, mask, 1, [pad], 0)]
        if len(set(lengths)) > 1 and max(lengths) > 0:
            break
        with torch.no_grad():
            hf.final_logits_bias[0, 0] += 0.5
    hf.save_pretrained(d)
    return d, hf, hf_tok, src_vocab, tgt_vocab


@pytest.mark.parametrize("separate", [False, True])
def test_import_opus_like_marian_matches_hf(tmp_path, corpus_dir, separate):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    d, hf, hf_tok, src_vocab, tgt_vocab = _opus_like_dir(tmp_path, corpus_dir, transformers,
                                                          separate)
    import_main(["--from", "hf", str(d), "--out", str(tmp_path / "opus.pt")])
    with pytest.raises(SystemExit, match="opus.pt exists; choose another --out or pass --force"):
        import_main(["--from", "hf", str(d), "--out", str(tmp_path / "opus.pt")])
    import_main(["--from", "hf", str(d), "--out", str(tmp_path / "opus.pt"), "--force"])
    with pytest.raises(SystemExit, match="is a directory; name the checkpoint file"):
        import_main(["--from", "hf", str(d), "--out", str(tmp_path), "--force"])
    weights = next(f for f in d.iterdir() if f.suffix in (".safetensors", ".bin"))
    before = weights.read_bytes()
    with pytest.raises(SystemExit, match=f"--out .*{weights.name} is a file of .* that it "
                                         "imports; write it elsewhere"):  # even with --force
        import_main(["--from", "hf", str(d), "--out", str(weights), "--force"])
    assert weights.read_bytes() == before
    import_main(["--from", "hf", str(d), "--out", str(d / "opus.pt")])  # beside them: fine
    import_main(["--from", "hf", str(d), "--out", str(d / "opus.pt"), "--force"])
    model, tok, _ = load_model(tmp_path / "opus.pt")
    assert (model.cfg.activation, tok.joint) == ("silu", False)
    assert model.cfg.tie_embeddings == ("decoder" if separate else "all")

    # mt id -> Marian id, read off the pieces; mt's target BOS is Marian's decoder start (pad),
    # and mt's target PAD a row Marian does not have
    pad = hf.config.pad_token_id
    src_map = {i: src_vocab.get(tok.src.id_to_piece(i)) for i in range(tok.src_vocab_size)}
    to_hf = {i: tgt_vocab.get(tok.tgt.id_to_piece(i)) for i in range(tok.tgt_vocab_size)}
    to_hf.update({PAD_ID: None, BOS_ID: pad})

    texts = _texts(corpus_dir)
    ids = tok.encode_src(texts)
    hf_ids = hf_tok(texts)["input_ids"]
    assert [[src_map[i] for i in row] for row in ids] == hf_ids  # same segmentation, same rows

    src, _ = _pad(ids, PAD_ID)
    hf_src, hf_mask = _pad(hf_ids, pad)
    tgt_in = torch.cat([torch.full((len(ids), 1), BOS_ID), src[:, :-1].clamp(min=4)], dim=1)
    tgt_in = tgt_in.clamp(max=tok.tgt_vocab_size - 1)
    hf_tgt_in = tgt_in.clone().apply_(lambda i: to_hf[i])
    cols = [i for i in range(tok.tgt_vocab_size) if to_hf[i] is not None]
    with torch.no_grad():
        mt_logits = model(src, tgt_in)
        hf_logits = hf(input_ids=hf_src, attention_mask=hf_mask,
                       decoder_input_ids=hf_tgt_in).logits
    hf_cols = [to_hf[i] for i in cols]
    torch.testing.assert_close(mt_logits[..., cols], hf_logits[..., hf_cols], atol=1e-4,
                               rtol=1e-4)
    # the new pad row takes no probability: mt's log-probabilities are Marian's
    torch.testing.assert_close(mt_logits.log_softmax(-1)[..., cols],
                               hf_logits.log_softmax(-1)[..., hf_cols], atol=1e-4, rtol=1e-4)

    greedy, beam = _mt_outputs(model, src)
    assert len(set(map(len, greedy))) > 1
    for beams, expected in ((1, greedy), (BEAM, beam)):
        got = _generate(hf, hf_src, hf_mask, beams, [pad], 0)
        assert got == [[to_hf[i] for i in row] for row in expected]
    expected_text = hf_tok.batch_decode([[to_hf[i] for i in row] for row in greedy],
                                        skip_special_tokens=True)
    assert tok.decode_tgt(greedy) == expected_text

    # the `translate` CLI takes the imported checkpoint as it is
    assert _translate_greedy(tmp_path, tmp_path / "opus.pt", texts) == [
        e if t.strip() else "" for t, e in zip(texts, expected_text, strict=True)]


def _translate_greedy(tmp_path, model, texts: list[str]) -> list[str]:
    """What the `translate` CLI prints for ``texts`` (greedy, the tests' length budget)."""
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    translate_main(["-m", str(model), "-i", str(tmp_path / "in.txt"), "-o",
                    str(tmp_path / "out.txt"), "--beam", "1", "--max-len-a", "0",
                    "--max-len-b", str(MAX_LEN), "--quiet"])
    return (tmp_path / "out.txt").read_text().split("\n")[:-1]


def test_import_multilingual_opus_takes_language_codes_as_hf(tmp_path, corpus_dir):
    """A target-language code at the start of a source line (``>>fra<< ...``) is one token with
    Marian's row for it, as MarianTokenizer makes it, so the translations are Hugging Face's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    codes = (">>fra<<", ">>deu<<", ">>spa<<")
    d, hf, hf_tok, _, tgt_vocab = _opus_like_dir(tmp_path, corpus_dir, transformers, False, codes)
    import_main(["--from", "hf", str(d), "--out", str(tmp_path / "opus.pt")])
    model, tok, _ = load_model(tmp_path / "opus.pt")

    plain = _texts(corpus_dir, 2)[:2]
    texts = [f"{code} {text}" for text in plain for code in codes] + [
        ">>fra<< ...Do two maps remember?",  # punctuation first after the code
        ">>deu<<\t  Some parrots?",  # other whitespace after it
        ">>spa<<",  # the code alone
        *_texts(corpus_dir, 2)]  # no code: as before (an empty line, unseen characters)
    ids, hf_ids = tok.encode_src(texts), hf_tok(texts)["input_ids"]
    # the same embedding rows in the same order (random rows: equal vectors are the same row)
    hf_table = hf.get_encoder().embed_tokens.weight
    for text, mine, theirs in zip(texts, ids, hf_ids, strict=True):
        assert torch.equal(model.src_embed.weight[mine], hf_table[theirs]), text
    # the code is one token before the text's own
    assert all(len(ids[i]) == len(tok.encode_src([plain[0]])[0]) + 1 for i in range(len(codes)))
    # a code glued to the next word is still the code (the word's pieces differ from
    # MarianTokenizer's; docs/interop.md)
    assert tok.encode_src([">>deu<<Some parrots"])[0][0] == ids[1][0] != ids[0][0]

    # greedy and beam outputs are Hugging Face's, and the code changes them
    to_hf = {i: tgt_vocab.get(tok.tgt.id_to_piece(i)) for i in range(tok.tgt_vocab_size)}
    pad = hf.config.pad_token_id
    src, _ = _pad(ids, PAD_ID)
    hf_src, hf_mask = _pad(hf_ids, pad)
    greedy, beam = _mt_outputs(model, src)
    hf_greedy = _generate(hf, hf_src, hf_mask, 1, [pad], 0)
    assert hf_greedy == [[to_hf[i] for i in row] for row in greedy]
    assert _generate(hf, hf_src, hf_mask, BEAM, [pad], 0) == [[to_hf[i] for i in row]
                                                               for row in beam]
    assert len({tuple(row) for row in greedy[: len(codes)]}) > 1  # one text, other codes
    # this random model writes codes too: decoded as MarianTokenizer decodes them, below
    assert any(tok.tgt.id_to_piece(i) in codes for row in greedy for i in row)

    # `translate` prints what MarianTokenizer + generate give
    expected_text = hf_tok.batch_decode(hf_greedy, skip_special_tokens=True)
    assert _translate_greedy(tmp_path, tmp_path / "opus.pt", texts) == [
        e if t.strip() else "" for t, e in zip(texts, expected_text, strict=True)]

    # exported back to Hugging Face, MarianTokenizer finds the codes again
    export_main(["-m", str(tmp_path / "opus.pt"), "--format", "hf", "--out", str(tmp_path / "re")])
    again = transformers.MarianTokenizer.from_pretrained(tmp_path / "re")
    assert again(texts)["input_ids"] == ids


def _spm_pieces(proto: bytes) -> list[tuple[str, int, float]]:
    """(piece, type, score) of each id of a serialized SentencePiece model."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(proto)
    return [(p.piece, p.type, p.score) for p in m.pieces]


@pytest.mark.parametrize("origin", ["mt", "marian"])
def test_a_language_code_round_trip_keeps_the_tokenizer_and_warns_of_nothing(
        tmp_path, corpus_dir, origin, caplog):
    """Exported and imported again, a tokenizer with target-language codes is the one it was.
    The code's piece ``▁>>fra<<`` is listed in vocab.json as ``>>fra<<``: the import took the name
    for a piece of its own, warned that ``▁>>fra<<`` was "left out" (nothing was), and made the
    target side an UNUSED ``>>fra<<``, so a joint tokenizer came back as two models. An imported
    multilingual Marian model (one vocabulary) came back with two vocabulary files."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    from mt.config import TokenizerConfig
    from mt.tokenizer import train_tokenizer

    codes = (">>fra<<", ">>deu<<")
    texts = [f"{code} {text}" for text in _texts(corpus_dir, 3)[:3] for code in codes]
    if origin == "mt":  # mt's own multilingual model: the codes are user symbols, vocabulary joint
        tok = train_tokenizer(read_lines(corpus_dir / "train.en"),
                              read_lines(corpus_dir / "train.zz"),
                              TokenizerConfig(vocab_size=200, user_symbols=list(codes)), seed=1)
        assert tok.joint
        first = _save(_mt_model(tok, _pad(tok.encode_src(texts), PAD_ID)[0]), tok,
                      tmp_path / "first.pt")
    else:  # an OPUS-MT-like multilingual model, one vocab.json for both sides
        d = _opus_like_dir(tmp_path, corpus_dir, transformers, False, codes)[0]
        first = str(tmp_path / "first.pt")
        import_main(["--from", "hf", str(d), "--out", first])
    model, tok, _ = load_model(first)
    export_main(["-m", first, "--format", "hf", "--out", str(tmp_path / "hf")])
    caplog.clear()
    with caplog.at_level("WARNING"):
        import_main(["--from", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back.pt")])
    assert "left out" not in caplog.text
    back, back_tok, _ = load_model(tmp_path / "back.pt")
    assert back_tok.joint == tok.joint
    assert _spm_pieces(back_tok.src_proto) == _spm_pieces(tok.src_proto)
    assert _spm_pieces(back_tok.tgt.serialized_model_proto()) == _spm_pieces(
        tok.tgt.serialized_model_proto())
    # one vocabulary stays one (the target's names are the source's), and Hugging Face reads it
    assert not (tmp_path / "hf" / "target_vocab.json").exists()
    hf_tok = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")

    ids = tok.encode_src(texts)
    assert back_tok.encode_src(texts) == ids and ids[0][0] != ids[1][0]  # a code, one token
    assert hf_tok(texts)["input_ids"] == ids
    src, _ = _pad(ids, PAD_ID)
    tgt_in = torch.cat([torch.full((len(ids), 1), BOS_ID), src[:, :-1].clamp(min=4)], dim=1)
    tgt_in = tgt_in.clamp(max=tok.tgt_vocab_size - 1)
    with torch.no_grad():
        torch.testing.assert_close(back(src, tgt_in), model(src, tgt_in), atol=1e-5, rtol=1e-5)
    greedy = _mt_outputs(model, src)[0]
    assert _mt_outputs(back, src)[0] == greedy
    assert back_tok.decode_tgt(greedy) == tok.decode_tgt(greedy)
    if origin == "marian":  # (mt's own ▁>>fra<< decodes with a space before it, Marian's without)
        assert hf_tok.batch_decode([t + [EOS_ID] for t in greedy],
                                   skip_special_tokens=True) == tok.decode_tgt(greedy)


def test_a_damaged_marian_directory_is_one_line_naming_the_file(tmp_path, corpus_dir):
    """Each damage was a traceback (weights, a SentencePiece model, sizes that do not match) or
    a line naming no file ("mt-import: 'encoder_ffn_dim'")."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    good = _opus_like_dir(tmp_path, corpus_dir, transformers, False)[0]
    weights = next(p.name for p in good.iterdir() if p.name in ("model.safetensors",
                                                                 "pytorch_model.bin"))

    def config(**changes):
        def change(d):
            c = json.loads((d / "config.json").read_text())
            c.update(changes)
            for key in [k for k, v in changes.items() if v is None]:
                del c[key]
            (d / "config.json").write_text(json.dumps(c))
        return change

    def write(name, data):
        return lambda d: (d / name).write_bytes(data)

    for name, damage, said in [
        ("weights", write(weights, b"garbage"), f"{weights}: cannot read the weights ("),
        ("spm", write("source.spm", b"garbage"), "source.spm: not a SentencePiece model ("),
        ("json", write("config.json", b"{not json"), "config.json: not a JSON object ("),
        ("key", config(encoder_ffn_dim=None), "config.json: no 'encoder_ffn_dim'"),
        ("layers", config(encoder_layers=3), f"{weights}: no 'model.encoder.layers.2."),
        ("sizes", config(d_model=64), "the weights do not have config.json's sizes (size "
                                      "mismatch for "),
        # these imported without a word, into models that translated nonsense
        ("fewer", config(decoder_layers=1), f"{weights}: model.decoder.layers.1."),
        ("empty_target_spm", write("target.spm", b""), "target.spm: not a SentencePiece model "
                                                       "(no pieces; an empty file?)"),
        ("empty_source_spm", write("source.spm", b""), "source.spm: not a SentencePiece model "
                                                       "(no pieces; an empty file?)"),
        # and these were tracebacks
        ("eos", config(eos_token_id=5000), "config.json: eos_token_id=5000 is past the "),
        ("text", config(encoder_layers="2"), "config.json: encoder_layers='2' is not an integer "
                                             "of at least 1")]:
        d = tmp_path / name
        shutil.copytree(good, d)
        damage(d)
        with pytest.raises(SystemExit) as err:
            import_main(["--from", "hf", str(d), "--out", str(tmp_path / f"{name}.pt")])
        message = str(err.value)
        assert message.startswith(f"mt-import: {d}") and said in message, message
        assert "\n" not in message
    assert "are weights that config.json's layers do not use" in _import_error(
        tmp_path / "fewer", tmp_path / "x.pt")


def test_null_settings_in_a_marian_config_are_their_defaults(tmp_path, corpus_dir):
    """A null max_position_embeddings (let through by the check, as a null decoder start is) or
    dropout went on into the model config: a TypeError traceback; a dropout that is no number
    was imported, to fail later."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    good = _opus_like_dir(tmp_path, corpus_dir, transformers, False)[0]
    config = json.loads((good / "config.json").read_text())
    config.update(max_position_embeddings=None, dropout=None, attention_dropout=None)
    (good / "config.json").write_text(json.dumps(config))
    import_main(["--from", "hf", str(good), "--out", str(tmp_path / "m.pt")])
    from mt.checkpoint import load_model

    cfg = load_model(str(tmp_path / "m.pt"))[0].cfg
    assert (cfg.max_positions, cfg.dropout, cfg.attention_dropout) == (1024, 0.1, 0.0)
    config.update(activation_dropout="0.1")
    (good / "config.json").write_text(json.dumps(config))
    assert _import_error(good, tmp_path / "x.pt") == (
        f"mt-import: {good / 'config.json'}: activation_dropout='0.1' is not a number of [0, 1)")


def _import_error(d, out) -> str:
    with pytest.raises(SystemExit) as err:
        import_main(["--from", "hf", str(d), "--out", str(out)])
    return str(err.value)


def test_import_reads_the_target_vocabulary_where_the_tokenizer_config_says(tmp_path, corpus_dir):
    """Separate vocabularies without target_vocab.json were read from vocab.json: every target
    row got a source piece, and the model wrote source words. A null decoder start is the pad,
    as where the key is missing (it became a new, zero row)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    good = _opus_like_dir(tmp_path, corpus_dir, transformers, True)[0]
    lost = tmp_path / "lost"
    shutil.copytree(good, lost)
    (lost / "target_vocab.json").unlink()
    assert _import_error(lost, tmp_path / "lost.pt") == (
        f"mt-import: {lost / 'tokenizer_config.json'}: separate_vocabs is true, but "
        f"{lost / 'target_vocab.json'} is missing")
    null = tmp_path / "null"
    shutil.copytree(good, null)
    c = json.loads((null / "config.json").read_text())
    c["decoder_start_token_id"] = None
    (null / "config.json").write_text(json.dumps(c))
    for d in (good, null):
        import_main(["--from", "hf", str(d), "--out", str(tmp_path / f"{d.name}.pt")])
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=False)["model"] for n in ("opus", "null"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_import_of_a_file_or_a_hub_name_says_it_reads_a_folder(tmp_path):
    """A file was a NotADirectoryError traceback; a hub name (or a missing folder) said
    "No such file or directory: 'Helsinki-NLP/opus-mt-en-de/config.json'", a file never given."""
    (tmp_path / "train.en").write_text("a line\n")
    for given, said in [(str(tmp_path / "train.en"), "is a file, not a Marian model folder"),
                        ("Helsinki-NLP/opus-mt-en-de", "no such folder; mt-import reads a Marian "
                         "model folder on disk (a hub name: download it first, e.g. hf download "
                         "Helsinki-NLP/opus-mt-en-de --local-dir DIR)"),
                        (str(tmp_path / "a" / "b"), "no such folder; mt-import reads a Marian "
                         "model folder on disk")]:
        with pytest.raises(SystemExit) as err:
            import_main(["--from", "hf", given, "--out", str(tmp_path / "x.pt")])
        assert str(err.value) == f"mt-import: {given}: {said}"


def test_import_rejects_other_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bart"}))
    with pytest.raises(SystemExit) as err:
        import_main(["--from", "hf", str(tmp_path), "--out", str(tmp_path / "x.pt")])
    assert "model_type='bart'" in str(err.value)


def test_import_records_the_languages_that_bleu_is_tokenized_for(tmp_path, corpus_dir, caplog,
                                                                 capsys):
    """An imported model had no data.tgt_lang, so the evaluation scripts scored a Chinese
    target with 13a (a line one token, BLEU near 0) and mt-eval --test without --langpair did
    so in silence. OPUS-MT's tokenizer_config.json names the languages; --tgt-lang sets them."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    from mt.evaluate import main as eval_main
    from mt.report import model_bleu

    d = _opus_like_dir(tmp_path, corpus_dir, transformers, False)[0]
    tok_config = d / "tokenizer_config.json"
    as_made = json.loads(tok_config.read_text())
    # as Hugging Face's conversion of OPUS-MT writes it (opus-mt-en-zh)
    tok_config.write_text(json.dumps({**as_made, "target_lang": "zh", "source_lang": "en"}))

    def languages(*args: str) -> dict | None:
        import_main(["--from", "hf", str(d), "--out", str(tmp_path / "m.pt"), "--force", *args])
        return (torch.load(tmp_path / "m.pt", weights_only=False)["config"] or {}).get("data")

    assert languages() == {"src_lang": "en", "tgt_lang": "zh"}
    hyps, refs = ["我爱你", "猫在这里"], [["我爱你们", "猫在这里"]]
    assert model_bleu(str(tmp_path / "m.pt")).corpus_score(hyps, refs).score > 0  # 13a: 0
    # mt-eval without --langpair says which tokenizer the model's target needs
    _write_lines(tmp_path / "src", _texts(corpus_dir, 3)[1:3])
    _write_lines(tmp_path / "ref", refs[0])
    with caplog.at_level("WARNING", logger="mt.evaluate"):
        eval_main(["-m", str(tmp_path / "m.pt"), "--src", str(tmp_path / "src"), "--ref",
                   str(tmp_path / "ref"), "--beam", "1", "--max-len-b", "3", "-q", "--json"])
    capsys.readouterr()
    assert "m.pt was trained for zh targets" in caplog.text
    assert "pass --langpair en-zh" in caplog.text
    # exported, the languages go into tokenizer_config.json, and come back
    export_main(["-m", str(tmp_path / "m.pt"), "--format", "hf", "--out", str(tmp_path / "hf")])
    exported = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert (exported["source_lang"], exported["target_lang"]) == ("en", "zh")

    assert languages("--tgt-lang", "ja") == {"src_lang": "en", "tgt_lang": "ja"}
    tok_config.write_text(json.dumps(as_made))  # a folder that names none
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert languages() is None
    assert "names no target language" in caplog.text and "pass --tgt-lang" in caplog.text
    assert languages("--tgt-lang", "zh") == {"tgt_lang": "zh"}
    assert model_bleu(str(tmp_path / "m.pt")).corpus_score(hyps, refs).score > 0
    tok_config.write_text(json.dumps({**as_made, "target_lang": 3}))
    with pytest.raises(SystemExit) as err:
        languages()
    assert str(err.value) == (f"mt-import: {tok_config}: target_lang=3 is not a language code "
                              "(such as 'zh'); give mt-import --tgt-lang")
    assert languages("--tgt-lang", "zh") == {"tgt_lang": "zh"}  # the way round it


def test_an_empty_language_in_tokenizer_config_is_none(tmp_path):
    """tokenizer_config.json with source_lang "" (transformers loads such a folder, and reads
    the language as unset) was refused by mt-import: "source_lang='' is not a language code"."""
    from mt.import_hf import marian_languages

    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"source_lang": "", "target_lang": "de"}))
    assert marian_languages(tmp_path) == {"tgt_lang": "de"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"target_lang": " "}))
    with pytest.raises(ValueError, match="target_lang=' ' is not a language code"):
        marian_languages(tmp_path)  # a blank is not a code either


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))
