"""The benchmark scripts' own accounting, checked on a tiny model: a ceiling computed from the
wrong FLOPs or from missed layers would mislead every comparison made with it."""

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from mt.config import EOS_ID, ModelConfig
from mt.inference import prepare_model
from mt.model import build_model
from mt.search import beam_search

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recorded_linear_calls_count_every_matrix_product_of_a_beam_search():
    """Known answer: the FLOPs of the linear layers that beam search runs, by hand, for float32,
    bfloat16 and int8 models alike (an int8 layer is a different module type)."""
    bench = _script("bench_decode")
    d, f, vocab, enc, dec, beam, steps = 32, 64, 40, 2, 3, 3, 5
    torch.manual_seed(0)
    cfg = ModelConfig(encoder_layers=enc, decoder_layers=dec, d_model=d, ffn_dim=f, heads=2,
                      dropout=0.0, max_positions=64, src_vocab_size=vocab, tgt_vocab_size=vocab)
    model = build_model(cfg).eval()
    src = torch.tensor([[5, 6, 7, 8, 9, EOS_ID], [10, 11, 12, EOS_ID, 0, 0]])
    n, s = src.shape

    # Encoder: every padded position through self-attention (qkv + out) and the FFN; each decoder
    # layer projects the encoder output to cross-attention keys and values once. Decoder: the
    # first step has one row per sentence, the others one per beam; per layer q/k/v + out,
    # cross-attention q + out, FFN; then the output layer.
    macs = n * s * enc * (4 * d * d + 2 * d * f) + n * s * dec * 2 * d * d
    per_row = dec * (4 * d * d + 2 * d * d + 2 * d * f) + d * vocab
    macs += (n + n * beam * (steps - 1)) * per_row
    for dtype in ("float32", "bfloat16", "int8"):
        m = prepare_model(copy.deepcopy(model), dtype)
        calls = bench.record_linear_calls(m, lambda m=m: beam_search(
            m, src, beam_size=beam, lenpen=1.0, max_len_a=0, max_len_b=steps, min_len=steps - 1))
        flops = sum(2 * rows * mod.in_features * mod.out_features for mod, rows in calls)
        assert flops == 2 * macs, dtype
        # and the replay runs those very modules on inputs of their shapes
        inputs = [(mod, torch.randn(rows, mod.in_features, dtype=next(m.parameters()).dtype))
                  for mod, rows in calls]
        bench.replay_linear_calls(inputs)


def test_free_linear_ceiling_is_the_time_left_without_the_linear_layers():
    """Known answers: 1,000 tokens/s in all with linear layers that alone run 5,000 tokens/s
    leaves 0.8 ms per token to the rest (1,250 tokens/s); no figure without a measurement or
    when the linear layers alone were measured no faster than the whole."""
    bench = _script("bench_decode")
    assert bench.free_linear_ceiling(1000.0, 5000.0) == 1250.0
    assert bench.free_linear_ceiling(1890.2, 5633.3) == pytest.approx(2844.6, abs=0.2)
    assert bench.free_linear_ceiling(1000.0, None) is None
    assert bench.free_linear_ceiling(1000.0, 990.0) is None


def test_training_flops_for_mfu_equal_three_times_a_counted_forward_pass():
    """Known answer: on a batch without padding, bench_train's model FLOPs are 3x (forward +
    backward) what torch's FLOP counter counts in one forward pass of the model."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    bench = _script("bench_train")
    cfg = ModelConfig(encoder_layers=2, decoder_layers=3, d_model=32, ffn_dim=48, heads=4,
                      dropout=0.0, max_positions=64, src_vocab_size=50, tgt_vocab_size=50)
    model = build_model(cfg)
    src = torch.randint(4, 50, (3, 7))
    tgt_in = torch.randint(4, 50, (3, 5))
    # The math backend spells attention out in matrix products, which the counter sees.
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(src, tgt_in)
    assert bench.model_flops(src, tgt_in, cfg) == 3 * counter.get_total_flops()


def test_decode_benchmark_leaves_out_ctranslate2_where_it_cannot_run(monkeypatch, tmp_path):
    """CTranslate2 is optional (and its CUDA build needs CUDA 12 libraries): without it the CT2
    systems are left out with the reason, and the others are still measured and checked."""
    pytest.importorskip("transformers")
    bench = _script("bench_decode")
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import fails
    out = tmp_path / "report.json"
    bench.main(["--sentences", "4", "--batch", "2", "--tgt-len", "3", "--vocab", "300",
                "--repeat", "1", "--systems", "mt-float32,ct2-float32", "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"mt-float32"}
    assert "not installed" in report["skipped"]["ct2-float32"]
    assert report["checks"]["hf_max_logit_diff"] < 1e-4


@pytest.mark.parametrize("script, args, said", [
    ("eval_constraints", ["-m", "MISSING", "--src", "A", "--ref", "A"],
     "eval_constraints.py: MISSING: no such model file or run directory"),
    ("eval_constraints", ["-m", "MISSING", "--src", "A", "--ref", "B"],
     "eval_constraints.py: A has 2 lines but B has 1"),
    ("eval_constraints", ["-m", "MISSING", "--src", "A", "--ref", "A", "--beam", "1"],
     "eval_constraints.py: error: --beam must be 2 or more"),
    ("eval_long_lines", ["-m", "MISSING", "--src", "A", "--ref", "A", "--join", "0"],
     "eval_long_lines.py: error: argument --join: must be at least 1, got 0"),
    ("eval_long_lines", ["-m", "MISSING", "--src", "EMPTY", "--ref", "EMPTY"],
     "eval_long_lines.py: EMPTY: no lines to translate"),
    ("bench_mbr", ["B"], "bench_mbr.py: error: B:1: not translate --nbest output"),
    # after a minute of measuring the peak: a ZeroDivisionError, or a report of fewer steps
    ("bench_train", ["--steps", "0"], "bench_train.py: error: argument --steps: must be at least"),
    ("bench_train", ["--block", "0"], "bench_train.py: error: argument --block: must be at least"),
    ("bench_train", ["--vocab", "3"], "bench_train.py: error: --vocab must be at least 5"),
    ("bench_train", ["--max-tokens", "10"], "bench_train.py: error: --max-tokens 10 makes"),
    ("bench_train", ["--threads", "-1"], "bench_train.py: error: argument --threads: must be at"),
    # a traceback from numpy or at the report (min() of no epochs), or silently one sentence a
    # batch (--max-tokens 0), each after the corpus was made and read
    ("bench_data", ["--pairs", "-1"], "bench_data.py: error: argument --pairs: must be at least"),
    ("bench_data", ["--epochs", "0"], "bench_data.py: error: argument --epochs: must be at least"),
    ("bench_data", ["--max-tokens", "0"], "bench_data.py: error: argument --max-tokens: must be"),
    ("bench_data", ["--sentences", "0"], "bench_data.py: error: argument --sentences: must be"),
    ("bench_data", ["--num-proc", "0"], "bench_data.py: error: argument --num-proc: must be"),
    ("bench_data", ["--seed", "-1"], "bench_data.py: error: argument --seed: must be at least 0"),
    ("bench_data", ["--vocab-size", "4"], "bench_data.py: error: --vocab-size must be at least 5"),
    ("bench_loss", ["--vocab", "4"], "bench_loss.py: error: --vocab must be at least 5"),
    # the report was a FileNotFoundError traceback after all the measuring, and lost
    ("bench_decode", ["--out", "nodir/r.json"],
     "bench_decode.py: error: --out nodir/r.json: no such directory nodir"),
    ("bench_translate", ["-m", "MISSING", "-i", "A", "--out", "nodir/r.json"],
     "bench_translate.py: error: --out nodir/r.json: no such directory nodir"),
    ("bench_train", ["--out", "nodir/r.json"],
     "bench_train.py: error: --out nodir/r.json: no such directory nodir"),
])
def test_evaluation_scripts_say_a_mistake_in_one_line(tmp_path, script, args, said):
    """They ended in tracebacks: zip() of files of other lengths, randrange of an empty range,
    IndexError inside sacrebleu for an empty file, a model that is not there."""
    import subprocess

    files = {"A": "one\ntwo\n", "B": "one\n", "EMPTY": ""}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [str(tmp_path / a) if a in files or a == "MISSING" else a for a in args]
    said = said.replace("MISSING", str(tmp_path / "MISSING"))
    for name in files:
        said = said.replace(f" {name}", f" {tmp_path / name}")
    result = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(said), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("given", ["model", "option"])
@pytest.mark.parametrize("script", ["eval_constraints", "eval_long_lines"])
def test_evaluation_scripts_tokenize_bleu_for_the_target_language(script, given, tmp_path,
                                                                   tokenizer_dir, monkeypatch,
                                                                   capsys):
    """They scored every language with sacrebleu's 13a, which keeps a Chinese line (no spaces)
    as one token: BLEU 0 for translations that mt-eval, by the target language, scores high.
    The language is the model's data.tgt_lang, or --tgt-lang (a model imported with mt-import
    from a folder that names none has no data.tgt_lang)."""
    from sacrebleu.metrics import BLEU

    from mt.checkpoint import model_state, save_atomic
    from mt.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, max_positions=64, src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size))
    config = ({"data": {"src_lang": "en", "tgt_lang": "zh"}} if given == "model" else
              {"imported_from": "opus-mt-en-zh"})
    save_atomic(model_state(model, tok, config), tmp_path / "m.pt")
    refs = ["我爱你们", "猫在这里"]
    (tmp_path / "src").write_text("the dog\nthe cat\n")
    (tmp_path / "ref").write_text("".join(r + "\n" for r in refs))
    module = _script(script)
    hyps = ["我爱你", "猫在这里"]  # what the search gave, fixed: the scoring is under test
    monkeypatch.setattr(module, "best_translations", lambda model, tok, lines, *a, **k:
                        hyps[:len(lines)])
    monkeypatch.setattr(sys, "argv", [script, "-m", str(tmp_path / "m.pt"), "--src",
                                      str(tmp_path / "src"), "--ref", str(tmp_path / "ref"),
                                      *(["--join", "1"] if script == "eval_long_lines" else []),
                                      *(["--tgt-lang", "zh"] if given == "option" else []),
                                      "--workers", "1"])
    module.main()
    result = json.loads(capsys.readouterr().out)
    want = round(BLEU(trg_lang="zh").corpus_score(hyps, [refs]).score, 2)
    assert want > 0 == BLEU().corpus_score(hyps, [refs]).score
    for name in ("free", "constrained") if script == "eval_constraints" else (
            "at_the_limit", "between_sentences"):
        assert result[name]["bleu"] == want, name
    assert "tok:zh" in result["bleu_signature"]


def test_an_evaluation_script_scores_with_13a_where_the_targets_tokenizer_cannot_load(
        tmp_path, tokenizer_dir, monkeypatch, capsys, caplog):
    """A Japanese target without sacrebleu's [ja] extra (MeCab): the scripts ended before any
    translation with 'or choose another --tokenize', a flag they do not have, where they had
    scored with 13a before, as mt-train's test score of the same model did on that machine.
    Now one warning, 13a, and the signature says so."""
    import sacrebleu.tokenizers.tokenizer_ja_mecab as ja
    from sacrebleu.metrics import BLEU

    from mt.checkpoint import model_state, save_atomic
    from mt.tokenizer import Tokenizer

    monkeypatch.setattr(ja, "MeCab", None)  # as where sacrebleu[ja] is not installed
    tok = Tokenizer.load(tokenizer_dir)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, max_positions=64, src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size))
    save_atomic(model_state(model, tok, {"data": {"src_lang": "en", "tgt_lang": "ja"}}),
                tmp_path / "m.pt")
    refs, hyps = ["a b c d", "e f g h"], ["a b c d", "e f g x"]
    (tmp_path / "src").write_text("the dog\nthe cat\n")
    (tmp_path / "ref").write_text("".join(r + "\n" for r in refs))
    module = _script("eval_long_lines")
    monkeypatch.setattr(module, "best_translations", lambda model, tok, lines, *a, **k:
                        hyps[:len(lines)])
    monkeypatch.setattr(sys, "argv", ["eval_long_lines", "-m", str(tmp_path / "m.pt"), "--src",
                                      str(tmp_path / "src"), "--ref", str(tmp_path / "ref"),
                                      "--join", "1", "--workers", "1"])
    module.main()
    result = json.loads(capsys.readouterr().out)
    assert result["at_the_limit"]["bleu"] == round(BLEU().corpus_score(hyps, [refs]).score, 2)
    assert "tok:13a" in result["bleu_signature"]
    assert "BLEU uses the 13a tokenizer: BLEU's tokenizer for ja targets (ja-mecab)" in caplog.text


def test_a_report_that_cannot_be_written_is_printed_not_lost(tmp_path, capsys):
    """--out that fails after the measuring (a full disk, a folder removed meanwhile) ended in a
    traceback, and the minutes of measurements with it."""
    bench = _script("bench_decode")
    out = tmp_path / "gone" / "r.json"
    with pytest.raises(SystemExit) as stop:
        bench.write_report({"tokens_per_s": 123.0}, str(out), "bench_decode.py")
    assert stop.value.code == (f"bench_decode.py: cannot write --out {out} (No such file or "
                               "directory); the report is on stdout above")
    assert json.loads(capsys.readouterr().out) == {"tokens_per_s": 123.0}


def test_bench_translate_gives_empty_lines_empty_outputs_and_refuses_a_short_reference(
        tmp_path, corpus_dir, tokenizer_dir, monkeypatch, capsys):
    """Its mt systems searched an empty line's EOS-only source (translate writes an empty line
    and never searches it), so their outputs, BLEU and agreement with CTranslate2 were not
    translate's; a reference of fewer lines scored BLEU over the shorter zip (100 for 3 of 40)."""
    from mt.checkpoint import model_state, save_atomic
    from mt.tokenizer import Tokenizer

    monkeypatch.syspath_prepend(str(SCRIPTS))  # its import of bench_decode, as when run
    bench = _script("bench_translate")
    tok = Tokenizer.load(tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, dropout=0.0, max_positions=64,
                                    src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size)).eval()
    # a Chinese target: BLEU tokenized for it, as mt-eval and mt-train's test score do; the
    # model's data.tgt_lang (tests of eval_constraints.py, by the same model_bleu) or, for a
    # model imported from a folder that names none, --tgt-lang
    save_atomic(model_state(model, tok, {"imported_from": "opus-mt-en-zh"}), tmp_path / "m.pt")
    src, ref, short = tmp_path / "in.en", tmp_path / "ref.zz", tmp_path / "short.zz"
    src.write_text("the dog sees a cat\n\nthe cat\n")
    ref.write_text("我爱你\nb\n猫在这里\n")
    short.write_text("a\n")
    common = ["-m", str(tmp_path / "m.pt"), "-i", str(src), "--threads", "1", "--repeat", "1",
              "--beam", "2", "--systems", "mt-float32", "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit) as stop:
        bench.main([*common, "-r", str(short)])
    assert stop.value.code == 2
    assert f"{src} has 3 lines but {short} has 1" in capsys.readouterr().err
    scored = []
    real = bench.model_bleu

    def recorded(path, tgt_lang):
        metric = real(path, tgt_lang)
        score = metric.corpus_score
        metric.corpus_score = lambda hyps, refs: scored.append(list(hyps)) or score(hyps, refs)
        return metric

    monkeypatch.setattr(bench, "model_bleu", recorded)
    bench.main([*common, "-r", str(ref), "--tgt-lang", "zh"])
    (hyps,) = scored
    assert len(hyps) == 3 and hyps[1] == "" and hyps[0] and hyps[2]
    from sacrebleu.metrics import BLEU

    report = json.loads((tmp_path / "r.json").read_text())
    assert "tok:zh" in report["bleu_signature"]
    refs = ref.read_text().splitlines()
    assert report["systems"]["mt-float32"]["bleu"] == round(
        BLEU(trg_lang="zh").corpus_score(hyps, [refs]).score, 2)


def test_bench_translate_says_a_bad_shortlist_or_an_empty_input_before_any_work(
        tmp_path, tokenizer_dir, monkeypatch, capsys):
    """A missing shortlist, or one made for another model, was a traceback after the mt systems
    had loaded; an empty input timed nothing and printed speed ratios of noise."""
    from mt.checkpoint import model_state, save_atomic
    from mt.tokenizer import Tokenizer

    monkeypatch.syspath_prepend(str(SCRIPTS))  # its import of bench_decode, as when run
    bench = _script("bench_translate")
    tok = Tokenizer.load(tokenizer_dir)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, max_positions=64, src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size))
    save_atomic(model_state(model, tok, None), tmp_path / "m.pt")
    src, empty, other = tmp_path / "in.en", tmp_path / "empty.en", tmp_path / "other.pt"
    src.write_text("the dog sees a cat\n")
    empty.write_text("")
    save_atomic({"format": "mt-shortlist/1", "table": torch.zeros(1, 1, dtype=torch.int32),
                 "always": torch.zeros(1, dtype=torch.int32), "fingerprint": "another model",
                 "tgt_vocab_size": 1}, other)
    common = ["-m", str(tmp_path / "m.pt"), "--threads", "1", "--repeat", "1",
              "--systems", "mt-float32+sl"]
    for path, said in ((tmp_path / "missing.pt", "no such shortlist file"),
                       (other, "made for another tokenizer")):
        with pytest.raises(SystemExit) as stop:
            bench.main([*common, "-i", str(src), "--shortlist", str(path)])
        assert stop.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        bench.main([*common[:-2], "-i", str(empty)])
    assert stop.value.code == 2
    assert f"{empty}: no lines to translate" in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_every_script_runs_without_mt_installed(script, tmp_path):
    """scripts/ put the repository on sys.path, so that a checkout runs them as they are; four
    did not, and stopped at ``No module named 'mt'`` where mt was not installed (``-S`` leaves out
    the editable install's .pth file; the libraries' own folder is given as PYTHONPATH)."""
    import os
    import subprocess

    libraries = Path(torch.__file__).resolve().parents[1]
    if (libraries / "mt").is_dir():
        pytest.skip("mt is installed as a copy beside torch")
    result = subprocess.run([sys.executable, "-S", str(SCRIPTS / script), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(libraries)})
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-2000:]
