"""Fine-tuning (``init_from``): a saved model's shape, tokenizer and weights; the run's dropouts."""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import PYTHON, cli_env, tiny_train_args
from test_train import weights

from mt.config import ModelConfig, TokenizerConfig, finetune_model_config
from mt.data import read_lines
from mt.tokenizer import Tokenizer, TokenizerMismatch, place, train_tokenizer


def test_finetune_config_keeps_the_models_shape_and_the_runs_dropout():
    saved = vars(ModelConfig(name="small", d_model=64, heads=2, dropout=0.1, norm="pre",
                             src_vocab_size=300, tgt_vocab_size=300))
    run = ModelConfig(d_model=256, dropout=0.3, attention_dropout=0.2)
    model, replaced = finetune_model_config(run, dict(saved))
    assert (model.d_model, model.heads, model.norm, model.src_vocab_size) == (64, 2, "pre", 300)
    assert (model.dropout, model.attention_dropout) == (0.3, 0.2)
    assert replaced == ("model.d_model=256 (model: 64), model.heads=4 (model: 2), "
                        "model.norm=post (model: pre)")
    same = ModelConfig(**{**saved, "dropout": 0.5})
    assert finetune_model_config(same, dict(saved))[1] == ""


def test_each_rank_draws_from_a_stream_of_its_own():
    from mt.distributed import rank_seed

    assert rank_seed(7, 0) == 7  # one process: the seed as given
    draws = []
    for rank in range(4):
        torch.manual_seed(rank_seed(7, rank))
        draws.append(torch.rand(4))
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :])
    assert rank_seed(7, 1) == rank_seed(7, 1) != rank_seed(8, 1)


def test_place_writes_a_models_tokenizer_and_refuses_another(tmp_path, corpus_dir,
                                                             tokenizer_dir):
    mine = Tokenizer.load(tokenizer_dir)
    placed = place(tmp_path / "tok", mine, "init_from=x")
    assert Tokenizer.load(tmp_path / "tok").fingerprint == mine.fingerprint == placed.fingerprint
    assert place(tmp_path / "tok", mine, "init_from=x").fingerprint == mine.fingerprint  # again
    other = train_tokenizer(read_lines(corpus_dir / "train.en"),
                            read_lines(corpus_dir / "train.zz"), TokenizerConfig(vocab_size=150))
    # a TokenizerMismatch: the command's mistake, which mt-train says in one line
    with pytest.raises(TokenizerMismatch, match=r"init_from=x: the model's tokenizer is not the "
                                                r"one in .*: start in another run directory "
                                                r"\(that one"):
        place(tmp_path / "tok", other, "init_from=x")
    with pytest.raises(TokenizerMismatch, match=r"keeps its own: unset data.tokenizer.path$"):
        place(tmp_path / "tok", other, "init_from=x", shared=True)


def test_init_from_trains_on_from_the_saved_model(tmp_path, corpus_dir, tokenizer_dir, fit_here):
    base = tmp_path / "base"
    fit_here("base", "trainer.max_steps=2", "trainer.test_at_end=false")
    # The fine-tuning run names neither the model's shape nor its tokenizer: both come from base.
    # With lr 0 the weights stay those it started from, so they show where it started.
    args = [a for a in tiny_train_args(corpus_dir, tokenizer_dir)
            if not a.startswith(("model.", "data.tokenizer.path"))]
    tuned = tmp_path / "tuned"
    common = [f"hydra.run.dir={tuned}", "model.dropout=0.3", "optim.lr=0",
              "trainer.test_at_end=false"]
    def train(*more: str) -> subprocess.CompletedProcess:
        result = subprocess.run([PYTHON, "-m", "mt.train", *args, *common, *more],
                                env=cli_env(tmp_path), capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    first = train(f"init_from={base}", "trainer.max_steps=2")
    assert "the model's shape replaces model.encoder_layers=3 (model: 1)" in first.stderr
    a, b = weights(base), weights(tuned)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    saved = torch.load(tuned / "checkpoints" / "last.pt", weights_only=True)
    expected = torch.load(base / "checkpoints" / "last.pt", weights_only=True)["model_config"]
    assert saved["model_config"] == {**expected, "dropout": 0.3}
    assert (Tokenizer.load(tuned / "tokenizer").fingerprint
            == Tokenizer.load(tokenizer_dir).fingerprint)
    # It resumes like any other run, with or without init_from: the shape is its last.pt's.
    again = train("trainer.max_steps=3")
    assert "resumed" in again.stderr
    assert "last.pt: the model's shape replaces model.encoder_layers=3 (model: 1)" in again.stderr


def test_frozen_parameters_keep_their_values_and_a_resume_keeps_the_set(tmp_path, fit_here,
                                                                        trainer_factory):
    common = ["trainer.test_at_end=false"]
    fit_here("base", *common, "trainer.max_steps=2")
    fit_here("tuned", *common, f"init_from={tmp_path / 'base'}", "trainer.max_steps=3",
             "trainer.freeze=[encoder_layers.*]", "optim.weight_decay=0.1", "optim.name=adamw")
    a, b = weights(tmp_path / "base"), weights(tmp_path / "tuned")
    kept = [n for n in a if n.startswith("encoder_layers.")]
    assert kept and all(torch.equal(a[n], b[n]) for n in kept)  # decay would have moved them
    fc1 = "decoder_layers.0.ffn.fc1.weight"
    assert not torch.equal(a[fc1], b[fc1])
    # refused at start-up (mt-train's one line for a ValueError is tested elsewhere)
    for freeze, message in [("[]", "the run trained another set of parameters"),
                            # as many tensors as the encoder's: another set all the same
                            ("[decoder_layers.0.self_attn.*,decoder_layers.0.ffn.*,"
                             "decoder_layers.0.self_sub.*,decoder_layers.0.ffn_sub.*]",
                             "another set of parameters"),
                            ("[encoder.*]", r"trainer.freeze: 'encoder.\*' matches no parameter")]:
        with pytest.raises(ValueError, match=message):
            trainer_factory("tuned", *common, "trainer.max_steps=4", f"trainer.freeze={freeze}")


def test_freezing_every_parameter_is_refused_with_the_key():
    """'*' (or patterns that cover everything) would leave the optimizer an empty list, whose
    PyTorch error names neither the key nor the cause."""
    from mt.config import ModelConfig
    from mt.model import build_model
    from mt.optim import freeze

    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, src_vocab_size=20, tgt_vocab_size=20))
    with pytest.raises(ValueError, match=r"trainer.freeze: \* freezes all \d+ parameter tensors"):
        freeze(model, ["*"])
    assert freeze(model, ["encoder_layers.*"])  # part of them is fine


def test_init_from_an_imported_model_with_one_vocabulary_over_two_sentencepiece_models(
        tmp_path, tokenizer_dir, fit_here):
    """mt-import writes an OPUS-MT model of one vocab.json (tied embeddings) with two
    SentencePiece models over the same rows: translate took it, fine-tuning it stopped at
    start-up with 'tie_embeddings=all needs a joint vocabulary' and two fixes that could not
    apply (the model's tokenizer and shape are the checkpoint's, whatever data.tokenizer.joint
    or model.tie_embeddings say)."""
    from mt.checkpoint import model_state, save_atomic
    from mt.model import build_model

    proto = Tokenizer.load(tokenizer_dir).src_proto
    tok = Tokenizer(proto, proto)  # as mt-import makes it: not joint, the same pieces
    model = build_model(ModelConfig(d_model=32, ffn_dim=64, heads=2, encoder_layers=1,
                                    decoder_layers=1, max_positions=128, tie_embeddings="all",
                                    src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size))
    save_atomic(model_state(model, tok, {"imported_from": "opus-mt-en-zz"}), tmp_path / "opus.pt")
    fit_here("tuned", f"init_from={tmp_path / 'opus.pt'}", "data.tokenizer.path=null",
             "trainer.max_steps=2", "trainer.test_at_end=false")
    saved = torch.load(tmp_path / "tuned" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["model_config"]["tie_embeddings"] == "all"
    assert Tokenizer.from_state(saved["tokenizer"]).fingerprint == tok.fingerprint
    trained = saved["model"]["src_embed.weight"]  # trained on from the imported weights
    assert torch.equal(trained, saved["model"]["tgt_embed.weight"])  # and still tied
    assert not torch.equal(trained, model.state_dict()["src_embed.weight"])


def test_a_resume_says_when_init_from_names_another_model_than_the_run_started_from(
        tmp_path, fit_here):
    """A run directory with a last.pt resumes it; a fine-tuning run started in a folder reused by
    mistake went on training the old run's model, with 'init_from=new.pt (was ...)' only among
    the settings changed. The same model named otherwise (its run directory, its best.pt), or
    no init_from, is no news."""
    steps = ["trainer.test_at_end=false", "trainer.validate_every=2"]
    fit_here("base", *steps, "trainer.max_steps=2")
    # another seed: with base's, its weights were base's, bit for bit (no other model at all)
    fit_here("other", *steps, "trainer.max_steps=2", "trainer.seed=2")
    base, other = tmp_path / "base", tmp_path / "other"
    fit_here("tuned", *steps, f"init_from={base}", "trainer.max_steps=2")
    said = fit_here("tuned", *steps, f"init_from={other}", "trainer.max_steps=3")
    assert (f"init_from={other} is not used: {tmp_path / 'tuned'} resumes the run of "
            f"{tmp_path / 'tuned' / 'checkpoints' / 'last.pt'}, which started from "
            f"{base / 'checkpoints' / 'best.pt'}; to start from {other}, give the run another "
            "directory (hydra.run.dir)") in said
    for steps_now, same in enumerate((f"init_from={base / 'checkpoints' / 'best.pt'}",
                                      f"init_from={base}", "init_from=null"), start=4):
        said = fit_here("tuned", *steps, same, f"trainer.max_steps={steps_now}")
        assert f"at step {steps_now - 1}" in said and "is not used" not in said, same
    said = fit_here("other", *steps, f"init_from={base}", "trainer.max_steps=3", "trainer.seed=2")
    assert "which started from no model (no init_from)" in said
    # the starting model moved and named anew is the same weights: no warning (by the digest
    # last.pt keeps of them); another model under the starting model's old name is news
    moved = tmp_path / "archive" / "base-final.pt"
    moved.parent.mkdir()
    (base / "checkpoints" / "best.pt").rename(moved)
    said = fit_here("tuned", *steps, f"init_from={moved}", "trainer.max_steps=7")
    assert "at step 6" in said and "is not used" not in said
    assert (f"init_from={moved} holds the weights this run started from (as "
            f"{base / 'checkpoints' / 'best.pt'}; the same by their digest)") in said
    # from then on the run's starting model is named as the command named it: the warning
    # named the old path, where no file was
    said = fit_here("tuned", *steps, f"init_from={other / 'checkpoints' / 'best.pt'}",
                    "trainer.max_steps=8")
    assert f"is not used: {tmp_path / 'tuned'} resumes" in said
    assert f"which started from {moved}; to start" in said


def test_a_resume_of_a_last_pt_without_started_from_whose_model_is_gone_keeps_its_name(
        tmp_path, fit_here, monkeypatch):
    """A last.pt saved before ``started_from`` names its origin only by its config's init_from;
    where that file is gone (deleted, or relative to another directory), the resume cannot
    check, and the last.pt it writes must not say the run started from no model: the next
    resume with another init_from was told 'which started from no model (no init_from)'. The
    name kept as written is the same model when given so again."""
    monkeypatch.chdir(tmp_path)  # init_from=start.pt, relative, as a user writes it
    steps = ["trainer.test_at_end=false", "trainer.validate_every=2"]
    fit_here("base", *steps, "trainer.max_steps=2")
    start = tmp_path / "start.pt"
    start.write_bytes((tmp_path / "base" / "checkpoints" / "best.pt").read_bytes())
    fit_here("tuned", *steps, "init_from=start.pt", "trainer.max_steps=2")
    last = tmp_path / "tuned" / "checkpoints" / "last.pt"
    old = torch.load(last, weights_only=True)
    del old["trainer"]["started_from"], old["trainer"]["started_digest"]  # as saved before
    torch.save(old, last)
    start.unlink()
    said = fit_here("tuned", *steps, "init_from=start.pt", "trainer.max_steps=3")
    assert "at step 2" in said and "is not used" not in said
    said = fit_here("tuned", *steps, f"init_from={tmp_path / 'base'}", "trainer.max_steps=4")
    assert "which started from start.pt (no file there now);" in said and "no model" not in said
    start.write_bytes((tmp_path / "base" / "checkpoints" / "best.pt").read_bytes())  # back
    said = fit_here("tuned", *steps, "init_from=start.pt", "trainer.max_steps=5")
    assert "at step 4" in said and "is not used" not in said


def test_every_resume_with_another_init_from_says_it_is_not_used(tmp_path, fit_here):
    """The same command run again (a job requeued, a command repeated) resumes again; its
    init_from is then the last.pt config's, and the run went on training the model it started
    from without a word. The model it started from, deleted since and named as before, is no
    news."""
    steps = ["trainer.test_at_end=false", "trainer.validate_every=2"]
    fit_here("base", *steps, "trainer.max_steps=2")
    # another seed: with base's, its weights were base's, bit for bit (no other model at all)
    fit_here("other", *steps, "trainer.max_steps=2", "trainer.seed=2")
    base, other = tmp_path / "base", tmp_path / "other"
    fit_here("tuned", *steps, f"init_from={base}", "trainer.max_steps=2")
    for steps_now in (3, 4):
        said = fit_here("tuned", *steps, f"init_from={other}", f"trainer.max_steps={steps_now}")
        assert f"init_from={other} is not used" in said, steps_now
    fit_here("gone", *steps, f"init_from={base}", "trainer.max_steps=2")
    (base / "checkpoints" / "best.pt").unlink()
    (base / "checkpoints" / "last.pt").unlink()
    said = fit_here("gone", *steps, f"init_from={base}", "trainer.max_steps=3")
    assert "at step 2" in said and "is not used" not in said


def test_a_fine_tune_records_and_reads_the_tokenizer_the_model_has(tmp_path, corpus_dir,
                                                                    trainer_factory):
    """A model fine-tuned from an import (whose checkpoint has no data.tokenizer) recorded the
    run's defaults as its tokenizer (joint, 8000 pieces, nmt_nfkc) for one of two vocabularies
    that folds case; and the tag check read them: back-translations tagged "<BT>" beforehand
    were not seen as tagged with the case-folding tokenizer's "<bt>", and trained on two tags."""
    import shutil

    from mt.checkpoint import model_state, save_atomic
    from mt.model import build_model

    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    src, tgt = (read_lines(corpus_dir / f"train.{lang}")[:40] for lang in ("en", "zz"))
    (data / "bt.en").write_text("".join(f"<BT> {line}\n" for line in src))
    (data / "bt.zz").write_text("".join(f"{line}\n" for line in tgt))
    made = TokenizerConfig(vocab_size=150, joint=False, model_type="bpe",
                           normalization="nmt_nfkc_cf", user_symbols=["<bt>"])
    tok = train_tokenizer(read_lines(corpus_dir / "train.en"), read_lines(corpus_dir / "train.zz"),
                          made)
    model = build_model(ModelConfig(d_model=32, ffn_dim=64, heads=2, encoder_layers=1,
                                    decoder_layers=1, max_positions=128,
                                    src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size))
    save_atomic(model_state(model, tok, {"imported_from": "opus-mt-en-zz"}), tmp_path / "opus.pt")
    trainer = trainer_factory("tuned", f"init_from={tmp_path / 'opus.pt'}",
                              "data.tokenizer.path=null", f"data.dir={data}",
                              "data.train=train+bt", "data.tagged=[bt]", "data.tag='<bt>'")
    recorded = trainer.config_dict["data"]["tokenizer"]  # what every checkpoint saves
    assert {k: recorded[k] for k in ("joint", "model_type", "normalization", "vocab_size")} == {
        "joint": False, "model_type": "bpe", "normalization": "nmt_nfkc_cf",
        "vocab_size": max(tok.src_vocab_size, tok.tgt_vocab_size)}
    tag = tok.symbol_id("<bt>")
    corpus = trainer.corpus
    firsts = [corpus.collate([i])[0][0].tolist()[:2] for i in range(len(corpus.pairs))]
    assert sum(ids[0] == tag for ids in firsts) >= 30  # bt's pairs kept, tagged
    assert not any(ids == [tag, tag] for ids in firsts)  # "<BT> ..." read as tagged: once


def test_an_init_from_that_names_no_model_says_the_key(tmp_path, trainer_factory):
    """mt-train's one line named the path only ('/x/runs/old: no checkpoint in it'), not which of
    the run's settings gave it; a file with mt's format tag and no weights was a KeyError. The
    command's mistake (``SetupRefused``): mt-train said it pointing at a traceback in train.log,
    and left the run directory it had made."""
    from mt.config_checks import SetupRefused

    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model\n")
    torch.save({"format": "mt-checkpoint-1", "config": {}}, tmp_path / "bare.pt")
    for given, message in [(tmp_path / "gone", r"no such model file or run directory"),
                           (tmp_path / "empty", r"no checkpoint in it"),
                           (tmp_path / "notes.txt", r"not a readable mt checkpoint"),
                           (tmp_path / "bare.pt", r"not an mt model checkpoint \(it has no "
                                                  r"'model_config' or 'model' or 'tokenizer'\)")]:
        with pytest.raises(SetupRefused, match=rf"^init_from={given}: {message}"):
            trainer_factory("tuned", f"init_from={given}")
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)  # a run directory: its best.pt's
    (tmp_path / "old" / "checkpoints" / "best.pt").write_text("cut short")
    with pytest.raises(SetupRefused, match=rf"^init_from={tmp_path / 'old'}: "
                                           rf"{tmp_path / 'old'}/checkpoints/best.pt: not a "):
        trainer_factory("tuned", f"init_from={tmp_path / 'old'}")


def test_a_resume_of_a_last_pt_that_recorded_the_asked_tokenizer_says_no_change(tmp_path,
                                                                                 fit_here):
    """A last.pt saved before a run recorded its tokenizer's own settings holds the command line's
    (data.tokenizer.vocab_size=8000, the default, for the 200 pieces of a data.tokenizer.path
    reused): the same command resumed from it said 'resuming with settings changed:
    data.tokenizer.vocab_size=200 (was 8000)', a change nobody made."""
    from mt.checkpoint import load, save_atomic

    fit_here("run", "trainer.max_steps=2", "trainer.test_at_end=false")
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    ckpt = load(last)
    assert ckpt["config"]["data"]["tokenizer"]["vocab_size"] == 200  # the tokenizer's, recorded
    ckpt["config"]["data"]["tokenizer"]["vocab_size"] = 8000  # as an older mt recorded it
    ckpt.pop("path", None)
    save_atomic(ckpt, last)
    said = fit_here("run", "trainer.max_steps=3", "trainer.test_at_end=false")
    assert "resumed" in said and "data.tokenizer" not in said.split("resuming with", 1)[-1]
