"""The translate CLI: one line out per line whatever the batching, formats that parse, errors that
name the file and line. Tiny random models saved as real checkpoints, with a tokenizer trained
here."""

import contextlib
import fcntl
import gzip
import io
import json
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import alive, children

from mt.checkpoint import load_model, model_state, save_atomic
from mt.config import EOS_ID, ModelConfig, TokenizerConfig
from mt.constraints import split_phrases
from mt.inference import (
    BFLOAT16_KERNELS,
    Int8Linear,
    PackedFeedForward,
    PackedLinear,
    bfloat16_row_buckets,
    can_pack,
    prepare_model,
)
from mt.kvcache import KVCache
from mt.lines import best_translations
from mt.model import build_model
from mt.scoring import cross_attention
from mt.search import NOT_A_NUMBER, nan_hint
from mt.tokenizer import train_tokenizer
from mt.translate import SearchOptions, main, search_lines, translate_ids, translate_lines
from mt.workers import FORK

WORDS = ("the a dog cat man woman child ball park street red blue small big runs walks sees "
         "holds plays sits near under with on in at").split()
# Quick decoding for tests: at most 4 tokens (EOS included), never an empty output.
FAST = ["--max-len-a", "0", "--max-len-b", "4", "--min-len", "1", "--quiet"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 9))]
    if rng.random() < 0.3:  # made-up words: several pieces per word
        words.append("".join(rng.choice("aeioukrstnm") for _ in range(rng.randint(4, 9))))
    return " ".join(words)


def _save_model(path: Path, tokenizer, seed: int) -> str:
    torch.manual_seed(seed)
    cfg = ModelConfig(encoder_layers=1, decoder_layers=2, d_model=32, ffn_dim=64, heads=2,
                      dropout=0.0, max_positions=64, src_vocab_size=tokenizer.src_vocab_size,
                      tgt_vocab_size=tokenizer.tgt_vocab_size)
    model = build_model(cfg)
    with torch.no_grad():
        model.output_proj.weight.mul_(3.0)  # sharper distributions, fewer near-ties
    save_atomic(model_state(model, tokenizer, None), path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    rng = random.Random(0)
    text = [_sentence(rng) for _ in range(400)]
    tok = train_tokenizer(text[:200], text[200:], TokenizerConfig(vocab_size=100))
    other = train_tokenizer(text[:200], text[200:], TokenizerConfig(vocab_size=80))
    return {"a": _save_model(tmp / "a.pt", tok, 0), "b": _save_model(tmp / "b.pt", tok, 1),
            "other_vocab": _save_model(tmp / "c.pt", other, 2)}


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _run(argv: list[str], capsys) -> list[str]:
    main(argv)
    out = capsys.readouterr().out
    return out.split("\n")[:-1] if out else []


def test_line_alignment_empty_long_and_many_lines(models, tmp_path, capsys):
    rng = random.Random(1)
    lines = [_sentence(rng) for _ in range(5000)]
    for i in (0, 17, 18, 2500, 4999):
        lines[i] = "" if i != 18 else "   "
    lines[100] = " ".join(rng.choice(WORDS) for _ in range(1000)) + " " + "kr" * 600  # > 2000 tok
    out = _run(["-m", models["a"], "-i", _write(tmp_path / "in.txt", lines), "--beam", "1",
                *FAST], capsys)
    assert len(out) == len(lines)
    for src, hyp in zip(lines, out, strict=True):
        assert bool(src.strip()) == bool(hyp.strip())
    # Each line's translation is its own: the same lines alone, in another order, agree.
    model, tok, _ = load_model(models["a"])
    picked = [1, 2, 100, 3000, 4998]
    opts = SearchOptions(beam=1, max_len_a=0, max_len_b=4, min_len=1)
    alone = translate_lines(model, tok, [lines[i] for i in picked[::-1]], opts)[::-1]
    assert [out[i] for i in picked] == [n[0][0] for n in alone]
    assert len(tok.encode_src([lines[100]])[0]) > 2000


def test_lines_of_nothing_the_tokenizer_keeps_are_empty_lines(models, tmp_path, capsys):
    """A line of a byte-order mark or a zero-width space encodes to EOS alone, as an empty line
    does, and gives what an empty line gives in every format, not a sentence made up from
    nothing."""
    _, tok, _ = load_model(models["a"])
    blank = ["\ufeff", "\u200b", " \ufeff\u200b "]
    assert tok.encode_src(blank) == [[3]] * 3  # EOS alone
    lines = ["the dog runs", *blank, "", "red ball"]
    path = _write(tmp_path / "in.txt", lines)
    args = ["-m", models["a"], "-i", path, "--beam", "2", *FAST]
    for fmt in ([], ["--nbest", "2"], ["--alignment", "--word-scores"],
                ["--nbest", "2", "--alignment", "--word-scores"],
                ["--score", _write(tmp_path / "t.txt", ["the dog"] * len(lines))]):
        out = _run([*args, *fmt], capsys)
        if "--nbest" in fmt:  # index<TAB>rest: each line's entries, without its index
            per_line: list[list[str]] = [[] for _ in lines]
            for row in out:
                i, rest = row.split("\t", 1)
                per_line[int(i)].append(rest)
        else:
            per_line = [[row] for row in out]
        assert len(per_line) == len(lines) and per_line[0] != per_line[4]
        assert per_line[1] == per_line[2] == per_line[3] == per_line[4], fmt


@pytest.mark.parametrize("normalization", ["identity", "nfkc"])
def test_a_byte_order_mark_at_a_lines_start_is_not_translated(tmp_path, capsys, normalization):
    """Files joined by `cat a.txt b.txt`, b saved "UTF-8 with BOM", have b's BOM before a line
    in mid-file (and a's before line 1). The identity and nfkc normalizations keep it, so the
    line began with <unk> and was translated as another sentence; a line of a BOM alone was a
    sentence. Read as not there: each line translates as without it, one line out per line."""
    rng = random.Random(4)
    text = [_sentence(rng) for _ in range(300)]
    tok = train_tokenizer(text[:150], text[150:],
                          TokenizerConfig(vocab_size=100, normalization=normalization))
    model = _save_model(tmp_path / "m.pt", tok, 0)
    plain = ["the dog runs", "red ball near the park", "", "a cat sits"]
    a = _write(tmp_path / "a.txt", plain[:2])
    b = tmp_path / "b.txt"
    b.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\n" for line in plain[2:]).encode())
    joined = tmp_path / "joined.txt"
    joined.write_bytes(b"\xef\xbb\xbf" + Path(a).read_bytes() + b.read_bytes()
                       + "\ufeffthe man\n".encode())
    args = ["-m", model, "--beam", "1", *FAST]
    expected = _run([*args, "-i", _write(tmp_path / "plain.txt", [*plain, "the man"])], capsys)
    for errors in ("strict", "replace"):
        assert _run([*args, "-i", str(joined), "--errors", errors], capsys) == expected, errors
    assert expected[2] == ""  # the BOM-only line: an empty line, as an empty line gives


def test_a_model_that_writes_line_breaks_still_gives_one_line_per_input_line(tmp_path, capsys):
    """A model with byte fallback can write the pieces of a line feed, a carriage return or a tab
    (sampling from an under-trained one did: 62 lines out for 60 in, every later line shifted
    against its source). They are printed as spaces, in every format and through the API."""
    rng = random.Random(4)
    text = [_sentence(rng) for _ in range(300)]
    tok = train_tokenizer(text, text, TokenizerConfig(vocab_size=320, byte_fallback=True))
    breaks = [tok.tgt.piece_to_id(f"<0x{b:02X}>") for b in (0x0A, 0x0D, 0x09, 0x0B)]
    torch.manual_seed(0)
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, d_model=32, ffn_dim=64, heads=2,
                      dropout=0.0, max_positions=64, src_vocab_size=tok.src_vocab_size,
                      tgt_vocab_size=tok.tgt_vocab_size, final_logits_bias=True)
    model = build_model(cfg)
    with torch.no_grad():  # the line breaks' pieces first, each a little less likely
        model.final_logits_bias[breaks] = torch.tensor([40.0, 39.5, 39.0, 38.5])
    path = str(tmp_path / "breaks.pt")
    save_atomic(model_state(model, tok, None), path)
    lines = ["the dog runs", "", "a red ball"]
    src = _write(tmp_path / "in.txt", lines)
    args = ["-m", path, "-i", src, "--beam", "4", "--max-len-a", "0", "--max-len-b", "4",
            "--quiet"]

    def printed(*more: str) -> list[str]:  # lines as Python's readers split them (sacrebleu's)
        main([*args, *more])
        return capsys.readouterr().out.splitlines()

    assert len(printed()) == len(lines)
    nbest = printed("--nbest", "4", "--word-scores")
    assert len(nbest) == 4 * 2 + 1 and all(row.count("\t") == 2 for row in nbest)
    assert len(printed("--sampling", "--nbest", "3")) == 3 * 2 + 1
    loaded, tok, _ = load_model(path)
    texts = translate_lines(loaded, tok, lines, SearchOptions(beam=4, nbest=4, max_len_a=0,
                                                               max_len_b=4))
    assert "\n" in "".join(tok.decode_tgt([breaks]))  # the pieces do spell line breaks
    assert {c for n in texts for t, _ in n for c in t} <= {" "}


def test_long_lines_are_cut_after_sentences_else_between_words():
    """Known cuts with a made-up vocabulary: 4 starts a word, 5 continues one, 6 starts a word
    and ends a sentence ('▁.'), 7 is a closing quote alone, 8 ends a sentence with 。 (no space
    after it), 9 is a UTF-8 continuation byte (byte fallback), 3 is EOS."""
    from mt.lines import _pieces
    from mt.tokenizer import Boundaries

    marks = Boundaries(starts=[False] * 4 + [True, False, True, False, False, False],
                       ends=[False] * 6 + [True, False, True, False],
                       closes=[False] * 7 + [True, False, False],
                       unspaced=[False] * 8 + [True, False], inside=[False] * 9 + [True])
    line = [4, 5, 6, 4, 5, 5, 4, 5, 4, 4, 6, 4, 3]  # limit 6: 5 body tokens + EOS per piece
    pieces = _pieces(line, 6, marks)
    assert pieces == [[4, 5, 6, 3], [4, 5, 5, 4, 5, 3], [4, 4, 6, 4, 3]]
    assert [t for p in pieces for t in p[:-1]] == line[:-1]  # the whole body, in order
    assert _pieces(line, 6) == [line[:5] + [3], line[5:10] + [3], line[10:]]  # no marks
    one_word = [4] + [5] * 11 + [3]  # no word start to cut at: where the limit falls
    assert _pieces(one_word, 6, marks) == _pieces(one_word, 6)
    # ... but not between the bytes of one character (5 9 9: a character in three byte pieces)
    in_bytes = [4] + [5, 9, 9] * 4 + [3]
    pieces = _pieces(in_bytes, 6, marks)
    assert [t for p in pieces for t in p[:-1]] == in_bytes[:-1]
    assert pieces[0] == [4, 5, 9, 9, 3] and all(p[0] == 5 for p in pieces[1:])
    # after closing quotes that follow the sentence's end; after 。 with no word start next
    assert _pieces([4, 5, 6, 7, 4, 5, 5, 5, 3], 6, marks)[0] == [4, 5, 6, 7, 3]
    assert _pieces([5, 5, 8, 5, 5, 5, 5, 5, 3], 6, marks)[0] == [5, 5, 8, 3]
    # a sentence end too early in the piece ("Dr.") loses to the last word start
    assert _pieces([6] + [4] * 9 + [3], 9, marks)[0] == [6, 4, 4, 4, 4, 4, 4, 4, 3]
    with pytest.raises(ValueError, match="1 position"):
        _pieces([4, 4, 3], 1, marks)


def test_output_does_not_depend_on_batch_size_or_order(models):
    model, tok, _ = load_model(models["a"])
    rng = random.Random(2)
    lines = [_sentence(rng) for _ in range(60)] + [""]
    opts = dict(beam=4, nbest=3, max_len_a=0, max_len_b=6)
    big = translate_lines(model, tok, lines, SearchOptions(batch_tokens=100_000, **opts))
    small = translate_lines(model, tok, lines, SearchOptions(batch_tokens=40, **opts))
    threads = torch.get_num_threads()
    workers = translate_lines(model, tok, lines, SearchOptions(batch_tokens=40, workers=3, **opts))
    # batches searched on 3 threads of one core each: the same texts and scores, in order (scores
    # to rounding: a matrix product over 1 thread sums in another order than over several)
    _assert_same_nbest(workers, small)
    assert torch.get_num_threads() == threads
    packed = prepare_model(load_model(models["a"])[0], "float32", "cpu")
    _assert_same_nbest(
        translate_lines(packed, tok, lines, SearchOptions(batch_tokens=40, workers=3, **opts)),
        translate_lines(packed, tok, lines, SearchOptions(batch_tokens=40, **opts)))
    order = list(range(len(lines)))
    random.Random(3).shuffle(order)
    shuffled = translate_lines(model, tok, [lines[i] for i in order], SearchOptions(**opts))
    unshuffled = [None] * len(lines)
    for pos, i in enumerate(order):
        unshuffled[i] = shuffled[pos]
    _assert_same_nbest(big, small)
    _assert_same_nbest(big, unshuffled)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_balanced_batches_cover_the_input_in_order_and_are_as_small_as_possible(workers):
    """Batches for several workers: every sentence once, in the sorted order, within the token
    budget, at most a multiple of ``workers`` of them, and no smaller budget gives that many."""
    from mt.batching import budget_batches
    from mt.workers import balanced_batches

    rng = random.Random(workers)
    for n in (1, 7, 300, 1000):
        lengths = [rng.randint(1, 60) for _ in range(n)]
        order = sorted(range(n), key=lambda i: -lengths[i])
        plain = list(budget_batches(lengths, order, 1000))
        batches = balanced_batches(lengths, order, 1000, workers)
        assert [i for b in batches for i in b] == order
        padded = [len(b) * lengths[b[0]] for b in batches]
        assert max(padded) <= 1000
        if workers == 1 or len(plain) == 1 or len(plain) > 16 * workers:
            assert batches == plain
            continue
        wanted = -(-len(plain) // workers) * workers
        assert len(batches) <= wanted
        assert len(list(budget_batches(lengths, order, max(padded) - 1))) > wanted


def test_workers_do_not_change_a_single_bit(models, monkeypatch):
    """Worker threads share process-wide settings (the oneDNN float32 switch, mt.kvcache): a
    search's results must not depend on what another thread's search is doing. With one thread
    per operator, 2 workers give exactly the scores of the same batches searched one after the
    other in one thread, run after run."""
    import mt.workers

    model, tok, _ = load_model(models["a"])
    rng = random.Random(5)
    lines = [_sentence(rng) for _ in range(80)]
    opts = SearchOptions(workers=2, beam=4, nbest=2, max_len_a=0, max_len_b=8, batch_tokens=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with monkeypatch.context() as m:  # the batches for 2 workers, searched in turn
            m.setattr(mt.workers, "batch_workers", lambda fn, items, *_: contextlib.nullcontext(
                map(fn, items)))
            one = translate_lines(model, tok, lines, opts)
        for _ in range(3):
            assert translate_lines(model, tok, lines, opts) == one
        # and forked worker processes (translate's default on Linux) give them too
        assert translate_lines(model, tok, lines, replace(opts, processes=True)) == one
    finally:
        torch.set_num_threads(threads)


def _assert_same_nbest(a: list, b: list) -> None:
    """The same n-best lists line by line: texts exactly, scores to float rounding."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert [t for t, _ in x] == [t for t, _ in y]
        assert [s for _, s in x] == pytest.approx([s for _, s in y], abs=1e-4)


def test_nbest_format_sorted_and_scores_from_search(models, tmp_path, capsys):
    rng = random.Random(4)
    lines = [_sentence(rng) for _ in range(20)]
    out = _run(["-m", models["a"], "-i", _write(tmp_path / "in.txt", lines), "--beam", "4",
                "--nbest", "3", "--max-len-b", "6", "--quiet"], capsys)
    assert len(out) == 3 * len(lines)
    model, tok, _ = load_model(models["a"])
    expected = translate_lines(model, tok, lines, SearchOptions(beam=4, nbest=3, max_len_b=6))
    for i, nbest in enumerate(expected):
        rows = [line.split("\t") for line in out[3 * i : 3 * i + 3]]
        assert [int(r[0]) for r in rows] == [i, i, i]
        scores = [float(r[2]) for r in rows]
        assert scores == sorted(scores, reverse=True)
        assert [r[1] for r in rows] == [t for t, _ in nbest]
        assert scores == pytest.approx([s for _, s in nbest], abs=1e-4)


def test_beam_one_is_greedy_on_the_command_line(models, tmp_path, capsys):
    rng = random.Random(5)
    path = _write(tmp_path / "in.txt", [_sentence(rng) for _ in range(30)])
    beam1 = _run(["-m", models["a"], "-i", path, "--beam", "1", "--quiet"], capsys)
    model, tok, _ = load_model(models["a"])
    from mt.search import beam_search

    lines = Path(path).read_text().splitlines()
    from mt.batching import pad

    hyps = beam_search(model, pad(tok.encode_src(lines)), beam_size=1)
    assert beam1 == tok.decode_tgt([h[0].tokens for h in hyps])


def test_no_repeat_ngram_size_reaches_the_search(models, tmp_path, capsys):
    """--no-repeat-ngram-size gives the library's search with that constraint (which the search
    tests check), and on long outputs it changes some of them; a negative size is refused."""
    rng = random.Random(6)
    lines = [_sentence(rng) for _ in range(20)]
    path = _write(tmp_path / "in.txt", lines)
    long = ["--max-len-a", "0", "--max-len-b", "14", "--min-len", "10", "--quiet"]
    free = _run(["-m", models["a"], "-i", path, "--beam", "3", *long], capsys)
    fenced = _run(["-m", models["a"], "-i", path, "--beam", "3", "--no-repeat-ngram-size", "2",
                   *long], capsys)
    model, tok, _ = load_model(models["a"])
    opts = SearchOptions(beam=3, max_len_a=0, max_len_b=14, min_len=10, no_repeat_ngram=2)
    assert fenced == [n[0][0] for n in translate_lines(model, tok, lines, opts)]
    assert fenced != free
    with pytest.raises(SystemExit) as err:
        main(["-m", models["a"], "-i", path, "--no-repeat-ngram-size", "-1"])
    assert err.value.code == 2
    assert "--no-repeat-ngram-size: must be at least 0" in capsys.readouterr().err


def test_packed_float32_model_decodes_like_the_plain_one(models):
    model, tok, _ = load_model(models["a"])
    packed = prepare_model(load_model(models["a"])[0], "float32", "cpu")
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    rng = random.Random(9)
    lines = [_sentence(rng) for _ in range(30)]
    opts = SearchOptions(beam=3, nbest=3, max_len_a=0, max_len_b=6)
    for a, b in zip(translate_lines(model, tok, lines, opts),
                    translate_lines(packed, tok, lines, opts), strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=1e-4)


def _teacher_forced(models, seed: int, *prepared) -> list[torch.Tensor]:
    """Each prepared model's teacher-forced logits on the same 8 random sentence pairs."""
    from mt.batching import collate

    tok = load_model(models["a"])[1]
    rng = random.Random(seed)
    src, tgt_in, _ = collate(tok.encode_src([_sentence(rng) for _ in range(8)]),
                             tok.encode_tgt([_sentence(rng) for _ in range(8)]))
    with torch.inference_mode():
        return [model(src, tgt_in) for model in prepared]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_model_computes_the_plain_models_function(models, dtype):
    """Packing (and the ReLU fused into the FFN's first product) changes speed, not the function:
    teacher-forced logits equal the unpacked model's to rounding."""
    if not can_pack(dtype, "cpu"):
        pytest.skip(f"oneDNN cannot pack {dtype} layers on this CPU")
    plain = prepare_model(load_model(models["a"])[0], dtype, "cpu", pack=False)
    packed = prepare_model(load_model(models["a"])[0], dtype, "cpu")
    assert any(isinstance(m, PackedFeedForward) for m in packed.modules())
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert not plain.pad_step_rows
    assert packed.pad_step_rows == (dtype == "bfloat16" and bfloat16_row_buckets())
    a, b = (logits.float() for logits in _teacher_forced(models, 3, plain, packed))
    diff = (a - b).abs()
    if dtype == "float32":
        assert diff.max().item() < 1e-4
    else:  # bf16 products round differently inside oneDNN's blocked kernels
        assert diff.mean().item() < 0.02 * a.std().item()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.95


def test_bucketed_bfloat16_steps_translate_as_unbucketed_ones(models, monkeypatch):
    """Packed bfloat16 steps may compute a bucketed number of rows (mt.kvcache.bucket_rows, for
    oneDNN's kernel per row count); the padding rows, in oneDNN's bfloat16 kernels, change no
    translation and no score beyond their rounding: 13 sentences x 3 beams, shrinking as
    sentences of shorter sources reach their length limit (39 rows down to 18, padded to 48 and
    32). The cache's other paths with padding (finished sentences kept in it, gradients) are
    tests/test_model.py's."""
    if not can_pack("bfloat16", "cpu"):
        pytest.skip("oneDNN cannot pack bfloat16 layers on this CPU")
    model, tok, _ = load_model(models["a"])
    packed = prepare_model(model, "bfloat16", "cpu")
    rng = random.Random(4)
    ids = tok.encode_src([_sentence(rng) for _ in range(13)])
    opts = SearchOptions(beam=3, nbest=3, max_len_a=1.0, max_len_b=1)
    padded = set()  # (rows, padded rows) of the steps that computed padding rows
    start_step = KVCache.start_step

    def record(cache):
        if cache.padded_rows > cache.rows:
            padded.add((cache.rows, cache.padded_rows))
        start_step(cache)

    monkeypatch.setattr(KVCache, "start_step", record)
    packed.pad_step_rows = True
    bucketed = translate_ids(packed, ids, opts)
    assert len(padded) >= 3 and {p for _, p in padded} >= {32, 48}
    packed.pad_step_rows = False
    plain = translate_ids(packed, ids, opts)
    assert [[h.tokens for h in n] for n in bucketed] == [[h.tokens for h in n] for n in plain]
    for a, b in zip(bucketed, plain, strict=True):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-2)


def test_int8_linear_rows_do_not_depend_on_each_other():
    """Int8Linear scales every input row on its own: a row's output is the same, bit for bit,
    alone or next to a row 1,000x larger (a scale per call would coarsen it 1,000x), and it is
    within int8 rounding of float32."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40)
    int8 = Int8Linear(linear)
    x = torch.randn(3, 48)
    big = torch.cat([x, 1000 * torch.randn(1, 48)])
    assert torch.equal(int8(big)[:3], int8(x))
    assert torch.equal(int8(x[1:2]), int8(x)[1:2])
    with torch.no_grad():
        exact = linear(x)
    assert (int8(x) - exact).abs().max().item() < 0.02 * exact.abs().max().item()
    assert int8(torch.zeros(2, 5, 48)).shape == (2, 5, 40)


INT8_PROBE = """
import torch
from mt.inference import Int8Linear, int8_weight_levels

torch.manual_seed(0)
linear, x = torch.nn.Linear(512, 256), torch.randn(64, 512)
with torch.no_grad():
    exact = linear(x)
levels = int8_weight_levels()
out = Int8Linear(linear, levels)(x)
a = torch.full((4, 512), 127, dtype=torch.int8)  # every pair sum at its largest
b = torch.full((512, 8), levels, dtype=torch.int8)
b[:, 1::2] = -levels
summed = torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
print(levels, ((out - exact).abs().max() / exact.abs().max()).item(), summed)
"""


@pytest.mark.parametrize("isa", ["native", "AVX2"])
def test_int8_products_stay_exact_without_vnni(isa):
    """On x86 CPUs without VNNI (emulated: oneDNN limited to AVX2) an int8 product of 8-bit
    weights overflows 16-bit pair sums (a layer's output off by 13% of its range); there the
    weights get 7 bits and the layer stays within int8 rounding of float32."""
    env = dict(os.environ) | ({} if isa == "native" else {"ONEDNN_MAX_CPU_ISA": isa})
    run = subprocess.run([sys.executable, "-c", INT8_PROBE], capture_output=True, text=True,
                         check=True, env=env)
    levels, error, summed = run.stdout.split()
    assert float(error) < 0.03, (levels, error)
    # the levels chosen are summed exactly even where every pair sum is at its largest (7 bits
    # on the AMD CPU with AVX-512 limited to AVX2; an AVX2-only EPYC sums 8 bits exactly)
    assert summed == "True" and levels in ("127", "63"), run.stdout


def test_int8_model_computes_nearly_the_float32_function(models, tmp_path, capsys):
    """--dtype int8 swaps every linear layer for an int8 one: teacher-forced logits stay close to
    float32's (quantization error only), a GPU is refused in one sentence, and the CLI keeps one
    output line per input line."""
    plain = prepare_model(load_model(models["a"])[0], "float32", "cpu", pack=False)
    int8 = prepare_model(load_model(models["a"])[0], "int8", "cpu")
    assert not any(type(m) is torch.nn.Linear for m in int8.modules())
    assert any(isinstance(m, Int8Linear) for m in int8.modules())
    a, b = _teacher_forced(models, 5, plain, int8)
    assert (a - b).abs().mean().item() < 0.05 * a.std().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9
    with pytest.raises(ValueError, match="CPU only"):
        prepare_model(load_model(models["a"])[0], "int8", "cuda")
    path = tmp_path / "in.txt"
    path.write_text("the dog\n\nthe cat sees the dog\n")
    out = _run(["-m", models["a"], "-i", str(path), "--dtype", "int8", *FAST], capsys)
    assert len(out) == 3 and out[1] == "" and out[0] and out[2]


KEEP_FREED_MEMORY_PROBE = """
import resource, sys, torch
from mt.inference import keep_freed_memory

def faults_of_a_second_allocation():
    torch.ones(2 ** 24)  # 64 MB, freed at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(3 * 2 ** 22)  # 48 MB: fits the freed block whatever its alignment padding
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_a_second_allocation()
took = keep_freed_memory()
faults_of_a_second_allocation()  # the first block after the switch may still be fresh
print(default, faults_of_a_second_allocation(), took)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_reuses_freed_blocks():
    """A freed 64 MB block is unmapped by default, so a 48 MB one after it faults in every page
    (12,288 of 4 kB); after keep_freed_memory the heap keeps the freed block and reuses it. Its
    own process: the setting is process-wide and stays."""
    run = subprocess.run([sys.executable, "-c", KEEP_FREED_MEMORY_PROBE], capture_output=True,
                         text=True, check=True)
    default, kept, took = run.stdout.split()
    if took != "True":
        pytest.skip("not glibc: mallopt had no effect")
    assert int(default) > 12000 and int(kept) < 1000


def test_translate_caps_the_kernel_caches_unless_the_user_set_them(models, tmp_path, capsys,
                                                                    monkeypatch):
    """Both caches grow with every new shape a search meets (mt.inference.cap_kernel_caches);
    translate caps them before its first product, and a value the user exported stands."""
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    _run(["-m", models["a"], "-i", _write(tmp_path / "in.txt", ["a b"])], capsys)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "8"
    # bfloat16 keeps room for the kernels of its bucketed row counts (mt.kvcache.bucket_rows)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    _run(["-m", models["a"], "-i", _write(tmp_path / "in.txt", ["a b"]), "--dtype", "bfloat16"],
         capsys)
    kept = str(BFLOAT16_KERNELS) if bfloat16_row_buckets() else "64"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == kept
    assert os.environ["LRU_CACHE_CAPACITY"] == "8"


def test_invalid_utf8_names_the_line_and_replace_works(models, tmp_path, capsys):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"the dog\nthe \xff cat\n")
    with pytest.raises(SystemExit) as err:
        main(["-m", models["a"], "-i", str(path), *FAST])
    assert f"{path}:2" in str(err.value) and "UTF-8" in str(err.value)
    assert len(_run(["-m", models["a"], "-i", str(path), "--errors", "replace", *FAST],
                    capsys)) == 2


def test_out_of_memory_is_one_line_that_says_what_to_lower(models, tmp_path, monkeypatch):
    """Under a memory limit the CPU allocator's RuntimeError ("[enforce fail at alloc_cpu.cpp]
    ... DefaultCPUAllocator: can't allocate memory") came out as a traceback from the KV cache;
    it is one line with the flags to lower, and the output file is not left half written."""
    import mt.translate

    def search(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 104857600 bytes.")

    monkeypatch.setattr(mt.translate, "search_lines", search)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("the dog\n")
    with pytest.raises(SystemExit) as err:
        main(["-m", models["a"], "-i", str(src), "-o", str(out), "--batch-tokens", "512", *FAST])
    assert str(err.value) == ("translate: out of memory: a smaller --batch-tokens (now 512) or "
                              f"--beam (now 5), or fewer --workers; {out} not written")
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_scores_that_are_not_numbers_are_one_line_and_write_nothing(models, tmp_path):
    """A model whose activations overflow (finite weights, as a float16 model's can): beam search
    finished no hypothesis, and translate wrote no line at all and exited 0."""
    big = _overflowing(models["a"], tmp_path)
    src, out = _write(tmp_path / "in.txt", ["the dog", "", "a cat"]), tmp_path / "out.txt"
    for extra in ([], ["--beam", "1"], ["--sampling"]):
        with pytest.raises(SystemExit) as err:
            main(["-m", big, "-i", src, "-o", str(out), *extra, *FAST])
        assert str(err.value) == (f"translate: {NOT_A_NUMBER}; the model's weights are likely "
                                  f"damaged or diverged (huge values); {out} not written")
        assert not out.exists()


def _overflowing(model: str, tmp_path: Path) -> str:
    """A copy of ``model`` whose decoder activations overflow to NaN; its weights are finite."""
    state = torch.load(model, weights_only=False)
    for name, value in state["model"].items():
        if name.startswith("decoder_layers") and name.endswith(".ffn.fc2.weight"):
            value.fill_(1e38)  # finite; the products overflow
    torch.save(state, tmp_path / "big.pt")
    return str(tmp_path / "big.pt")


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_chunks_and_pipes_give_the_files_output(models, tmp_path, capsys, monkeypatch):
    """Input read --chunk-lines at a time, from a file or a pipe: the same lines, in order, with
    n-best indices counting lines across chunks."""
    rng = random.Random(9)
    lines = [_sentence(rng) for _ in range(40)]
    lines[5], lines[30] = "", " ".join(["big red dog"] * 40)  # empty; translated in pieces
    path = _write(tmp_path / "in.txt", lines)
    args = ["-m", models["a"], "--beam", "3", *FAST]
    whole = _run([*args, "-i", path], capsys)
    assert len(whole) == 40 and whole[5] == "" and whole[30]
    assert _run([*args, "-i", path, "--chunk-lines", "3"], capsys) == whole
    _stdin(monkeypatch, Path(path).read_bytes())
    assert _run([*args, "--chunk-lines", "7"], capsys) == whole
    nbest = [line.split("\t") for line in _run([*args, "-i", path, "--nbest", "2"], capsys)]
    chunked = [line.split("\t") for line in _run([*args, "-i", path, "--nbest", "2",
                                                  "--chunk-lines", "4"], capsys)]
    assert [(i, text) for i, text, _ in chunked] == [(i, text) for i, text, _ in nbest]
    assert [float(s) for *_, s in chunked] == pytest.approx([float(s) for *_, s in nbest],
                                                            abs=2e-4)


def test_an_output_that_is_one_of_the_inputs_is_refused_and_left_alone(models, tmp_path):
    src = _write(tmp_path / "in.txt", ["the dog", "a cat"])
    given = _write(tmp_path / "given.txt", ["der Hund", "eine Katze"])
    (tmp_path / "link.txt").symlink_to("in.txt")
    for args, option, written in [(["-i", src, "-o", src], "-i", "translations"),
                                  (["-i", src, "-o", str(tmp_path / "link.txt")], "-i",
                                   "translations"),
                                  (["-i", src, "--score", given, "-o", given], "--score",
                                   "scores")]:
        with pytest.raises(SystemExit, match=f"^translate: -o .* is the {option} file; the "
                                             f"{written} would replace it"):
            main(["-m", models["a"], *args, *FAST])
    with open(src) as stdin:  # translate -o in.txt < in.txt
        result = subprocess.run([sys.executable, "-m", "mt.translate", "-m", models["a"], "-o",
                                 src, *FAST], stdin=stdin, capture_output=True, text=True)
    assert result.returncode == 1 and "is the input (stdin) file" in result.stderr
    assert Path(src).read_text() == "the dog\na cat\n"
    assert Path(given).read_text() == "der Hund\neine Katze\n"


@pytest.mark.parametrize("how", ["-i", "stdin", "-o /dev/stdout"])
def test_stdout_appended_to_the_input_is_refused_before_any_work(models, tmp_path, how):
    """``translate -i in.txt >> in.txt``: stdout is the input file. A chunk written there was
    read back as more input, translated, written again, without end (helper's report: a 3-line
    file grew to 36 lines in 40 s with --chunk-lines 1). Refused, the file left alone."""
    src = _write(tmp_path / "in.txt", ["the dog", "a cat"])
    args = {"-i": f"-i {src}", "stdin": f"< {src}", "-o /dev/stdout": f"-i {src} -o /dev/stdout"}
    proc = subprocess.run(f"exec {sys.executable} -m mt.translate -m {models['a']} {args[how]} "
                          f"--chunk-lines 1 {' '.join(FAST)} >> {src}", shell=True,
                          capture_output=True, text=True, timeout=60)
    name = "input (stdin) file" if how == "stdin" else f"-i file ({src})"
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"translate: stdout is the {name}; the translations would be read back as input: "
        "write them elsewhere")
    assert Path(src).read_text() == "the dog\na cat\n"


def test_stdout_truncating_a_file_translate_reads_says_the_shell_emptied_it(models, tmp_path):
    """``translate -i in.txt > in.txt`` (or ``--score given.de > given.de``): the shell empties
    the file before translate starts. It said the translations 'would be read back as input' (or
    'written into it'), as if nothing had happened, while the user's text was already gone."""
    src = _write(tmp_path / "in.txt", ["the dog", "a cat"])
    given = _write(tmp_path / "given.de", ["der Hund", "eine Katze"])
    for args, name in [(f"-i {src} > {src}", f"-i file ({src})"),
                       (f"-i {src} --score {given} > {given}", f"--score file ({given})")]:
        proc = subprocess.run(f"exec {sys.executable} -m mt.translate -m {models['a']} {args} "
                              f"{' '.join(FAST)}", shell=True, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f"translate: stdout is the {name}, which the shell's '>' emptied before translate "
            "started (its text is gone: restore it); write the output to another file")


def test_an_output_that_is_the_model_or_the_shortlist_is_refused(models, tmp_path):
    """-o naming a checkpoint translate loads (a file, or a run directory's best.pt) or the
    --shortlist: the translations replaced a 50 MB model with a few lines of text."""
    src = _write(tmp_path / "in.txt", ["the dog"])
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    shutil.copy(models["a"], run / "best.pt")
    shortlist = tmp_path / "list.pt"
    shortlist.write_bytes(b"a shortlist")  # refused before it is read
    before = (run / "best.pt").read_bytes()
    for args, option in [(["-m", str(run / "best.pt"), "-o", str(run / "best.pt")], "-m"),
                         (["-m", str(tmp_path / "run"), "-o", str(run / "best.pt")], "-m"),
                         (["-m", models["b"], str(run / "best.pt"), "-o", str(run / "best.pt")],
                          "-m"),
                         (["-m", models["a"], "--shortlist", str(shortlist), "-o",
                           str(shortlist)], "--shortlist")]:
        with pytest.raises(SystemExit, match=f"^translate: -o .* is the {option} file; the "
                                             "translations would replace it"):
            main([*args, "-i", src, *FAST])
    assert (run / "best.pt").read_bytes() == before
    assert shortlist.read_bytes() == b"a shortlist"


@pytest.mark.parametrize("closed, said", [
    ("<&-", "stdin is closed; give the input with -i FILE"),
    (">&-", "stdout is closed; give the output file with -o FILE")])
def test_a_closed_standard_stream_is_one_line(models, tmp_path, closed, said):
    """Run from a service or cron with stdin or stdout closed: one line, not a traceback (or,
    for stdout, a traceback after the whole file was translated)."""
    src = _write(tmp_path / "in.txt", ["the dog"])
    args = "" if closed == "<&-" else f"-i {src}"
    proc = subprocess.run(f"exec {sys.executable} -m mt.translate -m {models['a']} {args} "
                          f"{' '.join(FAST)} {closed}", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr == f"translate: {said}\n"


def test_a_side_file_on_a_closed_stdin_is_one_line(models, tmp_path):
    src = _write(tmp_path / "in.txt", ["the dog"])
    proc = subprocess.run(f"exec {sys.executable} -m mt.translate -m {models['a']} -i {src} "
                          f"--prefix-file - {' '.join(FAST)} <&-", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (
        1, "translate: --prefix-file -: stdin is closed; give it as a file\n")


def test_a_closed_stderr_still_translates(models, tmp_path):
    """2>&-: tqdm and the logs wrote to None and the run failed with no output written."""
    src = _write(tmp_path / "in.txt", ["the dog", "a cat"])
    out = tmp_path / "out.txt"
    proc = subprocess.run(f"exec {sys.executable} -m mt.translate -m {models['a']} -i {src} "
                          f"-o {out} --max-len-a 0 --max-len-b 4 2>&-", shell=True, timeout=120)
    assert proc.returncode == 0 and len(out.read_text().splitlines()) == 2
    # all three closed: /dev/null takes descriptors 0-2, so no file opened later is one of them
    # (a worker's or C++ code's writes to stderr would have gone into it)
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nfrom mt.textio import fill_closed_descriptors\n"
                     "fill_closed_descriptors()\n"
                     "print(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT), file=open(sys.argv[2],"
                     " 'w'))\n")
    subprocess.run(f"exec {sys.executable} {probe} {tmp_path / 'x'} {tmp_path / 'fd'} <&- >&- 2>&-",
                   shell=True, timeout=60, check=True)
    assert int((tmp_path / "fd").read_text()) > 2


def test_one_stream_read_twice_is_refused(models, tmp_path, capsys):
    """stdin (a pipe) as the input and a side file, or one FIFO twice, would deal their lines
    out in turn (line 1 scored against line 2): refused in one line before any work. A regular
    file read twice is fine."""
    src = _write(tmp_path / "in.txt", ["the dog", "a cat", "the man", "a ball"])
    cmd = [sys.executable, "-m", "mt.translate", "-m", models["a"], *FAST]
    for args, said in [(["--score", "-"], "--score - (stdin) and the input (stdin) are one "
                                          "stream"),
                       (["-i", src, "--prefix-file", "-", "--constraints-file", "/dev/stdin"],
                        "--constraints-file /dev/stdin and --prefix-file - (stdin) are one "
                        "stream")]:
        result = subprocess.run([*cmd, *args], input=Path(src).read_text(), capture_output=True,
                                text=True)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr.strip().splitlines()[-1] == (
            f"translate: {said}, which cannot be read twice: give one of them as a file")
    with open(src) as stdin:  # `< in.txt`: stdin is a regular file, and still one stream
        result = subprocess.run([*cmd, "--prefix-file", "-", "--constraints-file", "-"],
                                stdin=stdin, capture_output=True, text=True)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith(
        "translate: --prefix-file - (stdin) and the input (stdin) are one stream")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit, match=f"^translate: --score {fifo} and -i {fifo} are one "
                                         "stream"):
        main(["-m", models["a"], "-i", str(fifo), "--score", str(fifo), *FAST])
    given = _run(["-m", models["a"], "-i", src, "--score", src, *FAST], capsys)
    assert len(given) == 4
    with open(src) as stdin:  # `--score in.txt < in.txt`: the file is opened anew
        result = subprocess.run([*cmd, "--score", src], stdin=stdin, capture_output=True,
                                text=True)
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 4, result.stderr


def test_a_file_of_carriage_return_line_ends_is_refused_not_read_as_one_line(models, tmp_path,
                                                                             capsys):
    """Old Mac line ends (\\r alone): read as one line, 3 sentences came out as one line."""
    mac = tmp_path / "mac.txt"
    mac.write_bytes(b"the dog\ra cat\rthe cat\r")
    with pytest.raises(SystemExit, match=f"^translate: {mac}:1: its lines end in a carriage "
                                         r"return \(\\r\) alone"):
        main(["-m", models["a"], "-i", str(mac), *FAST])
    dos = _write(tmp_path / "dos.txt", ["the dog\r", "a\rcat\r"])  # CRLF, a stray \r inside
    assert len(_run(["-m", models["a"], "-i", dos, *FAST], capsys)) == 2


def test_a_utf16_file_is_refused_with_what_to_do_not_translated_misaligned(models, tmp_path):
    """A UTF-16 file (Windows PowerShell's '>' writes one): 'invalid UTF-8 at byte 0; use
    --errors replace', and --errors replace then gave 3 garbage lines for 2 (its line ends are
    two bytes, '\\n' then NUL). It is refused under either --errors, with the iconv to run.
    A UTF-32 file (its little-endian mark starts with UTF-16's) is named as UTF-32, so that the
    iconv said converts it."""
    wide = tmp_path / "wide.txt"
    for codec, name in (("utf-16", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32"),
                        ("utf-32-be", "UTF-32")):
        text = "the dog\na cat\n"
        # with its byte-order mark (Python writes one for the plain codecs, not for *-be)
        wide.write_bytes(text.encode(codec) if not codec.endswith("-be")
                         else ("\ufeff" + text).encode(codec))
        for errors in ("strict", "replace"):
            with pytest.raises(SystemExit) as err:
                main(["-m", models["a"], "-i", str(wide), "--errors", errors, *FAST])
            assert str(err.value) == (f"translate: {wide}:1: {name} text (it starts with a "
                                      f"{name} byte-order mark), not UTF-8; convert it first: "
                                      f"iconv -f {name} -t UTF-8 FILE > NEW"), codec


def test_output_file_appears_only_whole(models, tmp_path, monkeypatch):
    """A run that fails half-way (stdin's mistakes are found only when read) leaves no output
    file, not even its .partial; a line-parallel file that ends early is named."""
    out = tmp_path / "out.txt"
    _stdin(monkeypatch, b"the dog\n" * 5 + b"the \xff cat\n")
    with pytest.raises(SystemExit, match="<stdin>:6: invalid UTF-8"):
        main(["-m", models["a"], "-o", str(out), "--chunk-lines", "2", *FAST])
    assert not out.exists() and not Path(f"{out}.partial").exists()
    prefixes = _write(tmp_path / "prefixes.txt", ["the"] * 3)
    _stdin(monkeypatch, b"the dog\n" * 5)
    with pytest.raises(SystemExit, match="prefixes.txt: fewer lines than the input"):
        main(["-m", models["a"], "-o", str(out), "--prefix-file", prefixes, *FAST])
    assert not out.exists()
    _stdin(monkeypatch, b"the dog\n" * 5)
    main(["-m", models["a"], "-o", str(out), "--chunk-lines", "2", *FAST])
    assert len(out.read_text(encoding="utf-8").splitlines()) == 5
    with pytest.raises(SystemExit, match="is a directory"):
        main(["-m", models["a"], "-i", str(out), "-o", str(tmp_path), *FAST])
    # a folder not yet made: without the check, a file named after it was written
    with pytest.raises(SystemExit, match="new/: names a directory; give the file to write"):
        main(["-m", models["a"], "-i", str(out), "-o", f"{tmp_path / 'new'}/", *FAST])
    assert not (tmp_path / "new").exists()


def _script_run(args: list[str], **kw) -> subprocess.CompletedProcess:
    """The console script in its own process, bounded in time: a regression that blocks on a
    pipe fails the test instead of hanging the suite."""
    script = Path(sys.executable).with_name("translate")
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, **kw)


def _fifo(path: Path, data: bytes | None) -> tuple[str, threading.Thread, list]:
    """A named pipe fed ``data`` (or, for None, read into the list) by a daemon thread, which a
    blocked regression leaves behind without keeping the test process alive."""
    os.mkfifo(path)
    got: list = []
    if data is None:
        thread = threading.Thread(target=lambda: got.append(path.read_text()), daemon=True)
    else:
        thread = threading.Thread(target=lambda: path.write_bytes(data), daemon=True)
    thread.start()
    return str(path), thread, got


def test_pipes_that_can_be_read_only_once(models, tmp_path, capsys):
    """A named pipe (or `<(...)`) as input, --score file or output: read once, checked as read,
    written through (renaming a file over the pipe would lose the output)."""
    lines = ["the dog runs", "", "a red ball", "the cat sees the man"]
    path = _write(tmp_path / "in.txt", lines)
    args = ["-m", models["a"], "--beam", "2", *FAST]
    expected = _run([*args, "-i", path], capsys)
    pipe, feeder, _ = _fifo(tmp_path / "in.fifo", Path(path).read_bytes())
    proc = _script_run([*args, "-i", pipe])
    feeder.join(timeout=10)
    assert proc.returncode == 0 and proc.stdout.splitlines() == expected, proc.stderr
    out, reader, got = _fifo(tmp_path / "out.fifo", None)
    proc = _script_run([*args, "-i", path, "-o", out])
    reader.join(timeout=10)
    assert proc.returncode == 0 and got == ["".join(line + "\n" for line in expected)]
    assert stat.S_ISFIFO(os.stat(out).st_mode)  # still the pipe, not a file renamed over it
    for given, which in ((lines[:3], "fewer"), (lines + ["one more"], "more")):
        data = "".join(line + "\n" for line in given).encode()
        pipe, feeder, _ = _fifo(tmp_path / f"{which}.fifo", data)
        proc = _script_run([*args, "-i", path, "--score", pipe])
        feeder.join(timeout=10)
        assert proc.returncode == 1 and f"{which} lines than the input" in proc.stderr


def test_output_through_symlinks_keeps_them_and_terminate_leaves_nothing(models, tmp_path,
                                                                         capsys):
    lines = ["the dog runs", "a red ball"]
    path = _write(tmp_path / "in.txt", lines)
    args = ["-m", models["a"], "-i", path, "--beam", "2", *FAST]
    expected = _run(args, capsys)
    real, link = tmp_path / "real.txt", tmp_path / "link.txt"
    real.write_text("old\n")
    real.chmod(0o640)
    link.symlink_to(real.name)
    main([*args, "-o", str(link)])
    assert link.is_symlink() and real.read_text().splitlines() == expected
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert _run([*args, "-o", "-"], capsys) == expected
    # a descriptor's name is written in place, appending (as `2>>log` meant), never renamed over
    log = tmp_path / "log.txt"
    log.write_text("old\n")
    script = Path(sys.executable).with_name("translate")
    with open(log, "a") as f:
        proc = subprocess.run([str(script), *args, "-o", "/dev/stderr"], stderr=f, timeout=120,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and log.read_text().splitlines() == ["old", *expected]
    Path(f"{real}.partial").write_text("another run's\n")  # another run, or a killed one's
    with pytest.raises(SystemExit, match="real.txt.partial exists"):
        main([*args, "-o", str(link)])
    assert Path(f"{real}.partial").read_text() == "another run's\n"
    # SIGTERM mid-run: the process ends by the signal (as a shell loop expects) after removing
    # its partial file.
    big = _write(tmp_path / "big.txt", ["the dog sees a red ball"] * 20000)
    out = tmp_path / "out.txt"
    # Batches of 3 lines for 2 workers: forked worker processes, which end with it.
    proc = subprocess.Popen([str(script), "-m", models["a"], "-i", big, "-o", str(out),
                             "--chunk-lines", "100", "--batch-tokens", "21", "--workers", "2",
                             *FAST], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 60
    workers = []
    while (not Path(f"{out}.partial").exists() or len(workers) < 2 and FORK) \
            and time.monotonic() < deadline:
        workers = children(proc.pid) if FORK else []
        time.sleep(0.01)
    proc.terminate()
    assert proc.wait(timeout=60) == -signal.SIGTERM, proc.stderr.read()
    assert "interrupted" in proc.stderr.read()
    assert not out.exists() and not Path(f"{out}.partial").exists()
    assert len(workers) == 2 or not FORK
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP here")
def test_a_hangup_leaves_no_partial_output_as_terminate_does(models, tmp_path):
    """SIGHUP (the terminal closed, an ssh session dropped) killed translate outright and left
    out.txt.partial behind, which the next run to out.txt refused to write over; it ends the
    run as SIGTERM does, by the signal, with its workers."""
    script = Path(sys.executable).with_name("translate")
    big = _write(tmp_path / "big.txt", ["the dog sees a red ball"] * 20000)
    out, partial = tmp_path / "out.txt", tmp_path / "out.txt.partial"
    proc = subprocess.Popen([str(script), "-m", models["a"], "-i", big, "-o", str(out),
                             "--chunk-lines", "100", "--batch-tokens", "21", "--workers", "2",
                             *FAST], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 60
    workers = []
    while (not partial.exists() or len(workers) < 2 and FORK) and time.monotonic() < deadline:
        workers = children(proc.pid) if FORK else []
        time.sleep(0.01)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=60) == -signal.SIGHUP, proc.stderr.read()
    assert "interrupted" in proc.stderr.read()
    assert not out.exists() and not partial.exists()
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers)


def test_gzipped_input_and_output(models, tmp_path, capsys):
    lines = ["the dog runs", "", "a red ball"]
    plain = _write(tmp_path / "in.txt", lines)
    packed = tmp_path / "in.txt.gz"
    packed.write_bytes(gzip.compress(Path(plain).read_bytes()))
    args = ["-m", models["a"], "--beam", "2", *FAST]
    expected = _run([*args, "-i", plain], capsys)
    out = tmp_path / "out.txt.gz"
    main([*args, "-i", str(packed), "-o", str(out)])
    assert gzip.decompress(out.read_bytes()).decode().splitlines() == expected
    # gzipped by the name given, not by a link's target
    (tmp_path / "real.txt").write_text("")
    (tmp_path / "link.gz").symlink_to("real.txt")
    main([*args, "-i", plain, "-o", str(tmp_path / "link.gz")])
    assert gzip.decompress((tmp_path / "real.txt").read_bytes()).decode().splitlines() == expected
    truncated, corrupt = tmp_path / "cut.gz", tmp_path / "bad.gz"
    truncated.write_bytes(packed.read_bytes()[:-6])
    big = gzip.compress("".join(f"line {i} of a file\n" for i in range(3000)).encode())
    corrupt.write_bytes(big[:40] + bytes(b ^ 0x55 for b in big[40:80]) + big[80:])
    for broken in (truncated, corrupt):
        with pytest.raises(SystemExit, match=f"{broken.name}: cannot read"):
            main([*args, "-i", str(broken)])
    with pytest.raises(SystemExit, match="empty file name"):
        main([*args, "-i", plain, "-o", ""])


def test_sampling_in_chunks_draws_one_stream(models, tmp_path, capsys):
    """Chunks share the sampling stream: a file of the same lines twice, in chunks of its half,
    does not repeat its first half's samples."""
    rng = random.Random(10)
    half = [_sentence(rng) for _ in range(6)]
    path = _write(tmp_path / "in.txt", half + half)
    out = _run(["-m", models["a"], "-i", path, "--sampling", "--chunk-lines", "6",
                "--max-len-b", "8", "--quiet"], capsys)
    assert len(out) == 12 and out[:6] != out[6:]


def test_progress_bar_counts_lines_across_chunks_and_pieces(models, tmp_path, capsys, caplog,
                                                            monkeypatch):
    """Without --quiet: one bar over the file's lines (long lines in pieces, empty lines never
    searched) that ends full, and each warning once for the whole file."""
    import tqdm

    bars = []

    class Recorded(tqdm.tqdm):
        def close(self):
            bars.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    lines = ["the dog", "", " ".join(["big red dog"] * 40), "a cat", " ".join(["red"] * 90)]
    path = _write(tmp_path / "in.txt", lines)
    main(["-m", models["a"], "-i", path, "--chunk-lines", "2", "--beam", "2", *FAST[:-1]])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[1] == ""
    assert len(set(bars)) == 1 and bars[0][0] == bars[0][1] > 5  # one bar, pieces counted, full
    pieces = [r.getMessage() for r in caplog.records if "in pieces" in r.getMessage()]
    assert pieces == ["2 line(s) longer than the model's 64 tokens were translated in pieces"]
    scored = _run(["-m", models["a"], "-i", path, "--score", path, "--chunk-lines", "2",
                   "--quiet"], capsys)
    assert scored[2] == scored[4] == "nan" and "nan" not in scored[:2] + scored[3:4]


def test_missing_or_corrupt_model_is_a_one_line_error(models, tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(os.urandom(300))
    truncated = tmp_path / "truncated.pt"
    data = Path(models["a"]).read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    inp = _write(tmp_path / "in.txt", ["the dog"])
    for path in (tmp_path / "missing.pt", corrupt, truncated):
        with pytest.raises(SystemExit) as err:
            main(["-m", str(path), "-i", inp, *FAST])
        message = str(err.value)
        assert str(path) in message and "\n" not in message


def test_a_device_torch_cannot_use_is_a_one_line_error_naming_it(models, tmp_path):
    """--device is checked before loading: a misspelt one is not a broken model file, a GPU
    missing not a traceback; mt-eval checks it too."""
    from mt.evaluate import main as evaluate

    inp = _write(tmp_path / "in.txt", ["the dog"])
    wrong = ["foo", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])
    wrong.append("meta")  # loaded "fine", then a traceback from the search
    try:  # without Intel Gaudi's module: a ModuleNotFoundError traceback
        torch.empty(0, device="hpu")
    except ImportError:
        wrong.append("hpu")
    for device in wrong:
        with pytest.raises(SystemExit, match=f"^translate: --device {device}: [^\n]*$"):
            main(["-m", models["a"], "-i", inp, "--device", device, *FAST])
        with pytest.raises(SystemExit, match=f"^mt-eval: --device {device}: [^\n]*$"):
            evaluate(["-m", models["a"], "--src", inp, "--ref", inp, "--device", device])


def test_ensemble_of_one_model_twice_is_the_model(models, tmp_path, capsys):
    rng = random.Random(6)
    path = _write(tmp_path / "in.txt", [_sentence(rng) for _ in range(30)])
    fast = ["--beam", "3", "--max-len-a", "0", "--max-len-b", "6", "--quiet"]
    single = _run(["-m", models["a"], "-i", path, *fast], capsys)
    twice = _run(["-m", models["a"], models["a"], "-i", path, *fast], capsys)
    assert single == twice
    assert _run(["-m", models["a"], models["a"], "--weights", "1", "3", "-i", path, *fast],
                capsys) == single
    mixed = _run(["-m", models["a"], "-m", models["b"], "-i", path, *fast], capsys)
    assert len(mixed) == 30
    # nearly all the weight on one member: that member's translations
    leaning = _run(["-m", models["a"], models["b"], "--weights", "1", "1e-9", "-i", path, *fast],
                   capsys)
    assert leaning == single != mixed
    for weights, message in [(["1"], "1 weights for 2 models"), (["1", "0"], "above 0")]:
        with pytest.raises(SystemExit, match=f"^translate: --weights.*{message}"):
            main(["-m", models["a"], models["b"], "--weights", *weights, "-i", path, "--quiet"])
    with pytest.raises(SystemExit, match="share"):
        main(["-m", models["a"], models["other_vocab"], "-i", path, "--quiet"])


def test_score_gives_the_nbest_scores_one_line_per_pair(models, tmp_path, capsys):
    rng = random.Random(8)
    lines = [_sentence(rng) for _ in range(30)]
    model, tok, _ = load_model(models["a"])
    opts = SearchOptions(beam=3, nbest=3, max_len_a=0, max_len_b=6)
    results = search_lines(model, tok, lines, opts)
    # Text is scored as it tokenizes: keep the entries whose text gives back their own tokens.
    entries = [(i, text, h.score) for i, r in enumerate(results) for h in r.hyps[0]
               if tok.encode_tgt([text := tok.decode_tgt([h.tokens])[0]])[0] == h.tokens]
    assert len(entries) >= 30
    # Each n-best entry scored as a given translation gets the score the search gave it.
    pairs = _write(tmp_path / "pairs.txt", [lines[i] for i, _, _ in entries])
    given = _write(tmp_path / "given.txt", [text for _, text, _ in entries])
    scored = _run(["-m", models["a"], "-i", pairs, "--score", given, "--quiet"], capsys)
    assert [float(s) for s in scored] == pytest.approx([s for *_, s in entries], abs=2e-4)
    ensemble = _run(["-m", models["a"], models["b"], "-i", pairs, "--score", given, "--quiet"],
                    capsys)
    assert len(ensemble) == len(entries) and ensemble != scored
    lenpen0 = _run(["-m", models["a"], "-i", pairs, "--score", given, "--lenpen", "0",
                    "--quiet"], capsys)
    assert all(float(a) < float(b) for a, b in zip(lenpen0, scored, strict=True))
    # An empty line with an empty translation scores what --nbest prints for it (0: never
    # searched); an empty line with a translation is scored; a pair longer than the model's
    # maximum is 'nan'; aligned output.
    lines = [lines[i] for i, _, _ in entries[:10]] + ["", "", " ".join(["big red dog"] * 40)]
    targets = [text for _, text, _ in entries[:10]] + ["", "the dog", "a"]
    out = _run(["-m", models["a"], "-i", _write(tmp_path / "in2.txt", lines), "--score",
                _write(tmp_path / "t2.txt", targets), "--alignment", "--quiet"], capsys)
    assert len(out) == len(lines)
    scores = [line.split(" ||| ")[0] for line in out]
    assert scores[:10] == scored[:10]  # the same pairs, alone or with others
    nbest = _run(["-m", models["a"], "-i", _write(tmp_path / "empty.txt", [""]), "--beam", "3",
                  "--nbest", "3", "--quiet"], capsys)
    assert nbest == ["0\t\t0.0000"] and scores[10] == "0.0000"
    assert float(scores[11]) < 0
    assert scores[12] == "nan"


def test_score_counts_only_pairs_too_long_as_not_scored(models, tmp_path, caplog):
    src = _write(tmp_path / "in.txt", ["the dog", "", " ".join(["big red dog"] * 400), "  "])
    given = _write(tmp_path / "given.txt", ["a", "", "b", ""])
    with caplog.at_level(logging.WARNING, logger="mt.translate"):
        main(["-m", models["a"], "-i", src, "--score", given, "-o", str(tmp_path / "out.txt")])
    assert (tmp_path / "out.txt").read_text().splitlines()[1:] == ["0.0000", "nan", "0.0000"]
    assert [r.getMessage().split()[0] for r in caplog.records
            if "not scored" in r.getMessage()] == ["1"]


def test_score_refuses_a_translation_file_that_does_not_match(models, tmp_path):
    src = _write(tmp_path / "in.txt", ["the dog", "a cat"])
    short = _write(tmp_path / "short.txt", ["der Hund"])
    with pytest.raises(SystemExit, match="short.txt: 1 lines, but the input has 2"):
        main(["-m", models["a"], "-i", src, "--score", short, "--quiet"])
    with pytest.raises(SystemExit, match="does not combine"):
        main(["-m", models["a"], "-i", src, "--score", src, "--nbest", "2", "--quiet"])
    # a combination that cannot work is said before a value's range, whose message would ask
    # for a value that cannot help (--mbr --score said "needs --beam 16")
    with pytest.raises(SystemExit, match="--mbr chooses among translations it searches"):
        main(["-m", models["a"], "-i", src, "--score", src, "--mbr", "chrf", "--quiet"])
    with pytest.raises(SystemExit, match="--score scores given translations"):
        main(["-m", models["a"], "-i", src, "--score", src, "--nbest", "9", "--quiet"])
    # a sampling flag without --sampling was told to "add --sampling", which --score refuses
    for shaping in (["--temperature", "0.5"], ["--top-k", "3"], ["--top-p", "0.9"],
                    ["--epsilon", "0.02"]):
        with pytest.raises(SystemExit, match="--score scores given translations; it does not "
                                             "combine with --sampling .or its --temperature"):
            main(["-m", models["a"], "-i", src, "--score", src, *shaping, "--quiet"])


def test_alignment_links_words_of_both_sides(models, tmp_path, capsys):
    rng = random.Random(7)
    lines = [_sentence(rng) for _ in range(40)] + ["", " ".join(["big red dog"] * 40)]
    out = _run(["-m", models["a"], "-i", _write(tmp_path / "in.txt", lines), "--beam", "2",
                "--alignment", "--max-len-b", "8", "--quiet"], capsys)
    plain = _run(["-m", models["a"], "-i", str(tmp_path / "in.txt"), "--beam", "2",
                  "--max-len-b", "8", "--quiet"], capsys)
    assert len(out) == len(lines)
    for src, line, text in zip(lines, out, plain, strict=True):
        hyp, links = line.split(" ||| ")
        assert hyp == text
        pairs = [tuple(map(int, p.split("-"))) for p in links.split()]
        assert all(0 <= i < len(src.split()) for i, _ in pairs)
        # every target word is linked (each target token has one source token)
        assert {j for _, j in pairs} == set(range(len(hyp.split())))


def test_alignment_counts_source_words_as_the_input_writes_them(models, tmp_path, capsys):
    """A character the source vocabulary lacks (<unk>) belongs to the word it is written in
    ("dog🙂", "🐕dog") and is a word of its own only between spaces: source word i is the input
    line's i-th whitespace-separated word, as docs/decoding.md promises."""
    from mt.alignment import _word_index

    _, tok, _ = load_model(models["a"])
    lines = ["the dog\U0001f642 runs", "\U0001f415dog sees a cat", "a \U0001f642 b",
             "\u0436", "the \u0436\u0443\u043a cat \u0436", "red ball\u0436\U0001f642x big"]
    for line in lines:
        ids = tok.encode_src([line])[0][:-1]
        assert 1 in ids  # <unk>
        # SentencePiece splits at whitespace first: a line's pieces are its words' pieces
        words = [tok.encode_src([word])[0][:-1] for word in line.split()]
        assert ids == [t for w in words for t in w]
        blank = [not tok.src.is_unknown(t) and not tok.src.id_to_piece(t).lstrip("\u2581")
                 for t in ids]
        want = [k for k, w in enumerate(words) for _ in w]
        assert _word_index(tok.src, ids, source=True) == [
            -1 if b else k for k, b in zip(want, blank, strict=True)]
    out = _run(["-m", models["a"], "-i", _write(tmp_path / "in.txt", lines), "--beam", "2",
                "--alignment", "--max-len-b", "8", "--quiet"], capsys)
    for line, aligned in zip(lines, out, strict=True):
        links = aligned.split(" ||| ")[1].split()
        assert links and all(int(p.split("-")[0]) < len(line.split()) for p in links)


def test_alignment_numbers_the_input_words_that_normalization_splits(models, tmp_path, capsys):
    """NFKC writes '´' as a space and a combining accent, '½' as "1⁄2", and drops U+200B: the
    model reads other words than the input has. Source word i is still the input line's i-th
    whitespace-separated word (a review saw "The dog´s cat´s ..." aligned to word 11 of 7)."""
    from mt.alignment import _source_words, _word_index

    _, tok, _ = load_model(models["a"])
    lines = ["The dog\u00b4s cat\u00b4s ball\u00b4s man", "a \u200b b", "x\u00a8y z w",
             "\ufb01ne \u00bd day", "the dog\u00b8s sees \U0001f642 a cat"]
    moved = 0
    for line in lines:
        ids = tok.encode_src([line])[0][:-1]
        words = [tok.encode_src([word])[0][:-1] for word in line.split()]
        assert ids == [t for w in words for t in w]  # so each token's word is known
        blank = [not tok.src.is_unknown(t) and not tok.src.id_to_piece(t).lstrip("\u2581")
                 for t in ids]
        want = [-1 if b else k for (k, _), b in zip(
            ((k, t) for k, w in enumerate(words) for t in w), blank, strict=True)]
        assert _source_words(tok.src, line, ids) == want, line
        moved += _word_index(tok.src, ids, source=True) != want
    assert moved >= 3  # counting '▁' pieces numbers these lines' words wrongly
    out = _run(["-m", models["a"], "-i", _write(tmp_path / "in.txt", lines), "--beam", "2",
                "--alignment", "--max-len-b", "8", "--quiet"], capsys)
    for line, aligned in zip(lines, out, strict=True):
        links = aligned.split(" ||| ")[1].split()
        assert links and all(int(p.split("-")[0]) < len(line.split()) for p in links)


def test_word_scores_are_per_word_and_sum_to_the_log_probability(models, tmp_path, capsys):
    """--word-scores: one number per whitespace word of each n-best entry and one for EOS, after
    the alignment, summing to the entry's log-probability (--lenpen 0), for empty lines and lines
    translated in pieces too; --score --word-scores gives the same numbers for the same text."""
    rng = random.Random(9)
    lines = [_sentence(rng) for _ in range(40)] + ["", " ".join(["big red dog"] * 40)]
    src = _write(tmp_path / "in.txt", lines)
    args = ["-m", models["a"], "-i", src, "--lenpen", "0", "--max-len-b", "8", "--quiet"]
    out = _run([*args, "--beam", "3", "--nbest", "2", "--alignment", "--word-scores"], capsys)
    best: dict[int, tuple[str, list[float]]] = {}
    for line in out:
        head, links, numbers = line.split(" ||| ")
        i, text, score = head.split("\t")
        words = [float(x) for x in numbers.split()]
        if not lines[int(i)].strip():
            assert (text, links, words) == ("", "", [])
            continue
        assert len(words) == len(text.split()) + 1
        assert all(int(p.split("-")[1]) < len(text.split()) for p in links.split())
        assert sum(words) == pytest.approx(float(score), abs=1e-4 * len(words) + 1e-4)
        best.setdefault(int(i), (text, words))
    assert len(best) == len(lines) - 1
    hyps = _write(tmp_path / "hyp.txt", [best[i][0] if i in best else "" for i in
                                         range(len(lines))])
    scored = _run([*args, "--score", hyps, "--word-scores"], capsys)
    model, tok, _ = load_model(models["a"])
    found = search_lines(model, tok, lines[:40], SearchOptions(beam=3, nbest=2, lenpen=0,
                                                                max_len_b=8))
    same = 0
    for i, line in enumerate(scored[:40]):
        score, numbers = line.split(" ||| ")
        words = [float(x) for x in numbers.split()]
        assert len(words) == len(best[i][0].split()) + 1
        assert sum(words) == pytest.approx(float(score), abs=1e-4 * len(words) + 1e-4)
        # Text is scored as it tokenizes: where that is the search's own segmentation, the
        # numbers are the search's.
        if tok.encode_tgt([best[i][0]])[0] == found[i].hyps[0][0].tokens:
            assert words == pytest.approx(best[i][1], abs=2e-4)
            same += 1
    assert same >= 10
    assert scored[41] == "nan ||| "  # too long to score as one pair


@pytest.mark.parametrize("source", ["sampling", "beam"])
def test_mbr_prints_the_choice_among_the_searchs_candidates(models, tmp_path, capsys, source):
    """--mbr: one line per input line (empty ones too), each the mbr_choose of the n-best list
    the same search gives in Python; options that cannot combine with it are refused."""
    from mt.mbr import mbr_choose

    rng = random.Random(10)
    lines = [_sentence(rng) for _ in range(12)] + [""]
    path = _write(tmp_path / "in.txt", lines)
    search = (["--sampling", "--epsilon", "0.02", "--seed", "3"] if source == "sampling"
              else ["--beam", "6"])
    out = _run(["-m", models["a"], "-i", path, "--mbr", "chrf", "--mbr-candidates", "6",
                "--max-len-b", "8", "--quiet", *search], capsys)
    model, tok, _ = load_model(models["a"])
    opts = (SearchOptions(sampling=True, epsilon=0.02, seed=3, nbest=6, max_len_b=8)
            if source == "sampling" else SearchOptions(beam=6, nbest=6, max_len_b=8))
    nbest = translate_lines(model, tok, lines, opts)
    assert out == [n[mbr_choose([t for t, _ in n])][0] for n in nbest]
    assert out[-1] == "" and any(o != n[0][0] for o, n in zip(out, nbest, strict=True))
    for bad in (["--nbest", "2"], ["--beam", "4"]):  # 16 candidates by default
        with pytest.raises(SystemExit, match="--mbr"):
            main(["-m", models["a"], "-i", path, "--mbr", "bleu", *bad])


@pytest.mark.parametrize("bad, message", [
    (["--sampling", "--nbest", "0"], "--nbest"), (["--sampling", "--top-p", "-1"], "--top-p"),
    (["--sampling", "--top-k", "-2"], "--top-k"), (["--sampling", "--temperature", "0"],
                                                   "--temperature"),
    (["--sampling", "--epsilon", "1"], "--epsilon"), (["--beam", "2", "--nbest", "3"], "--nbest"),
    (["--epsilon", "0.02"], "--epsilon shapes the sampling"),  # ignored without --sampling
    (["--beam", "16", "--mbr", "chrf", "--top-p", "0.9"], "--top-p shapes the sampling"),
    (["--max-len-a", "0", "--max-len-b", "1"], "--max-len-a 0 --max-len-b 1 leaves a short line"),
    (["--max-len-a", "0.1", "--max-len-b", "1"], "--max-len-a 0.1 --max-len-b 1 leaves a short"),
    (["-m", "SAME", "--weights", "1", "inf"], "--weights must be above 0 and finite"),
    # one model: warned that --weights does nothing, then refused by loading as "2 weights for 1
    # models", a line that named no option
    (["--weights", "1", "2"], "--weights: 2 weights for 1 model \\(-m\\); one per model"),
    (["--max-len-b", "-3"], "--max-len-a and --max-len-b must be at least 0"),
    (["--max-len-a", "nan"], "--max-len-a and --max-len-b must be at least 0, got nan"),
    (["--sampling", "--temperature", "inf"], "--temperature must be positive and finite"),
    (["--sampling", "--temperature", "nan"], "--temperature must be positive and finite"),
    (["--lenpen", "nan"], "--lenpen must be a number between -10 and 10 \\(GNMT's alpha; "
                          "0.6-1 is usual\\), got nan"),
    (["--lenpen", "inf"], "--lenpen must be a number between -10 and 10"),
    # past the bound, the penalty overflowed: an OverflowError traceback
    (["--lenpen", "1000"], "--lenpen must be a number between -10 and 10"),
    (["--beam", str(2**62)], f"--beam must be at most {2**31 - 1}, got {2**62}"),
    (["--sampling", "--top-k", str(10**20)], "--top-k must be at most"),
    (["--sampling", "--seed", str(2 ** 64)], "--seed must be within -2\\*\\*63 and 2\\*\\*64")])
def test_search_options_out_of_range_are_one_line_errors(models, tmp_path, bad, message):
    path = _write(tmp_path / "in.txt", ["a dog"])
    bad = [models["a"] if b == "SAME" else b for b in bad]
    with pytest.raises(SystemExit, match=f"^translate: {message}"):
        main(["-m", models["a"], "-i", path, *bad])


def test_a_count_past_what_torch_and_islice_hold_is_a_usage_error(models, tmp_path, capsys):
    """--chunk-lines 10**20 passed argparse and failed in itertools.islice, a traceback."""
    path = _write(tmp_path / "in.txt", ["a dog"])
    with pytest.raises(SystemExit) as err:
        main(["-m", models["a"], "-i", path, "--chunk-lines", str(10**20)])
    assert err.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"argument --chunk-lines: must be at most {2**31 - 1}, got {10**20}")


def test_a_budget_past_the_model_maximum_is_the_model_maximum(models, tmp_path, capsys):
    """--max-len-a inf, or a budget past what a 64-bit integer holds, is capped at the model's
    maximum like any budget above it (cast before the cap, it wrapped to EOS alone)."""
    path = _write(tmp_path / "in.txt", ["the dog sees a ball", "a man"])
    base = ["-m", models["a"], "-i", path, "--beam", "2", "--quiet"]
    want = _run([*base, "--max-len-a", "0", "--max-len-b", "1000"], capsys)
    assert len(want) == 2 and all(want)  # the bug: empty lines
    for budget in (["--max-len-a", "inf"], ["--max-len-a", "1e19"],
                   ["--max-len-b", str(10 ** 19)], ["--max-len-b", str(10 ** 20)]):
        assert _run([*base, *budget], capsys) == want, budget


def test_a_min_len_the_budget_cannot_hold_is_warned_about(models, tmp_path, caplog, capsys):
    path = _write(tmp_path / "in.txt", ["a dog", "the red ball"])
    with caplog.at_level(logging.WARNING, logger="mt.translate"):
        out = _run(["-m", models["a"], "-i", path, "--beam", "2", *FAST, "--min-len", "4"],
                   capsys)
    assert [r.getMessage() for r in caplog.records] == [
        "--min-len 4 is not below the budget of --max-len-a 0 --max-len-b 4 (EOS included): "
        "every translation runs to the budget"]
    assert len(out) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt.translate"):
        _run(["-m", models["a"], "-i", path, "--beam", "2", *FAST, "--min-len", "3"], capsys)
    assert not caplog.records


def test_a_min_len_the_model_cannot_hold_is_warned_about(models, tmp_path, caplog, capsys):
    """With the default --max-len-a (a budget of the source's length) a --min-len past the
    model's maximum made every translation run to that maximum without a word."""
    from mt.checkpoint import load_model

    most = load_model(models["a"])[0].cfg.max_positions
    path = _write(tmp_path / "in.txt", ["a dog"])
    with caplog.at_level(logging.WARNING, logger="mt.translate"):
        out = _run(["-m", models["a"], "-i", path, "--beam", "2", "--quiet", "--min-len",
                    str(most)], capsys)
    assert [r.getMessage() for r in caplog.records] == [
        f"--min-len {most} is not below the model's maximum of {most} tokens (EOS included): "
        "every translation runs to it"]
    assert len(out) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt.translate"):
        _run(["-m", models["a"], "-i", path, "--beam", "2", "--quiet", "--min-len",
              str(most - 1)], capsys)
    assert not caplog.records


def test_mt_eval_warns_of_a_min_len_as_translate_does(models, tmp_path, caplog, capsys):
    """mt-eval translates with translate's search flags, and a --min-len at or past the budget
    or the model's maximum made each of its translations run to that length too, without the
    warning translate gives (the score alone, far lower, was the sign)."""
    from mt import evaluate

    most = load_model(models["a"])[0].cfg.max_positions
    src = _write(tmp_path / "src.txt", ["a dog", "the red ball"])
    ref = _write(tmp_path / "ref.txt", ["a dog", "the red ball"])
    base = ["-m", models["a"], "--src", src, "--ref", ref, "--beam", "1", "--json", "-q"]
    for flags, said in (
            (["--max-len-a", "0", "--max-len-b", "4", "--min-len", "4"],
             "--min-len 4 is not below the budget of --max-len-a 0 --max-len-b 4 (EOS "
             "included): every translation runs to the budget"),
            (["--min-len", str(most)],
             f"-m {models['a']}: --min-len {most} is not below the model's maximum of {most} "
             "tokens (EOS included): every translation runs to it"),
            (["--min-len", str(most - 1)], None)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mt.evaluate"):
            evaluate.main([*base, *flags])
        capsys.readouterr()
        assert [r.getMessage() for r in caplog.records] == ([said] if said else []), flags


@pytest.mark.parametrize("flags, warned", [
    (["--seed", "3"], ["--seed has no effect without --sampling"]),
    (["--mbr-candidates", "8"], ["--mbr-candidates has no effect without --mbr"]),
    (["--sampling", "--beam", "7"],
     ["--beam has no effect with --sampling (--nbest sets the samples per line)"]),
    (["--alignment-layer", "0"],
     ["--alignment-layer has no effect without --alignment or --replace-unk"]),
    (["--weights", "2"], ["--weights has no effect with one model"]),
    (["--workers", "1", "--worker-threads"],
     ["--worker-threads has no effect with one worker (--workers 1, --sampling or a GPU)"]),
    (["--sampling", "--worker-threads"],
     ["--worker-threads has no effect with one worker (--workers 1, --sampling or a GPU)"]),
    (["--score", "GIVEN", "--beam", "3", "--min-len", "2"],
     ["--beam has no effect with --score", "--min-len has no effect with --score"]),
    (["--sampling", "--seed", "3", "--mbr", "chrf", "--mbr-candidates", "4"], []),
    # sampling's one random stream is drawn a batch at a time: --workers 2 was dropped silently
    (["--sampling", "--workers", "2"],
     ["--workers has no effect with --sampling or on a GPU (one batch is searched at a time)"]),
    (["--sampling", "--workers", "1"], []),
    (["--no-pack", "--dtype", "float16"], ["--no-pack has no effect with --dtype float16 on cpu "
                                           "(only float32 and bfloat16 layers on a CPU are "
                                           "packed)"]),
    (["--no-pack", "--dtype", "float32"], []),
    (["--sampling", "--mbr", "chrf", "--mbr-candidates", "4", "--beam", "7"],
     ["--beam has no effect with --sampling (--mbr-candidates sets the samples per line)"]),
])
def test_flags_that_do_nothing_in_a_combination_are_warned_about(models, tmp_path, capsys,
                                                                 caplog, flags, warned):
    path = _write(tmp_path / "in.txt", ["a dog"])
    given = _write(tmp_path / "given.txt", ["a dog"])
    flags = [given if f == "GIVEN" else f for f in flags]
    short = [] if "--score" in flags else FAST[:-1]  # --score takes no length flags
    with caplog.at_level(logging.WARNING, logger="mt.translate"):
        main(["-m", models["a"], "-i", path, *short, *flags])
    said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert said == warned


def test_dtype_prefix_and_seeded_sampling(models, tmp_path, capsys, caplog):
    rng = random.Random(8)
    lines = [_sentence(rng) for _ in range(30)]
    path = _write(tmp_path / "in.txt", lines)
    fast = ["--max-len-a", "0", "--max-len-b", "6", "--quiet"]
    f32 = _run(["-m", models["a"], "-i", path, "--beam", "2", *fast], capsys)
    bf16 = _run(["-m", models["a"], "-i", path, "--beam", "2", "--dtype", "bfloat16", *fast],
                capsys)
    assert len(bf16) == len(f32)
    assert sum(a == b for a, b in zip(f32, bf16, strict=True)) >= len(f32) // 2
    prefixes = [rng.choice(WORDS) + " " + rng.choice(WORDS) if i % 3 else "" for i in range(30)]
    pre = _run(["-m", models["a"], "-i", path, "--prefix-file",
                _write(tmp_path / "prefix.txt", prefixes), "--max-len-b", "6", "--quiet"],
               capsys)
    for p, hyp in zip(prefixes, pre, strict=True):
        assert hyp.startswith(p)
    # An empty line is not searched: its prefix goes unused, which a warning says (as an
    # unmet constraint's); it used to be dropped without a word.
    emptied = ["" if i in (1, 3, 4) else line for i, line in enumerate(lines)]
    with caplog.at_level("WARNING", logger="mt"):
        pre = _run(["-m", models["a"], "-i", _write(tmp_path / "e.txt", emptied),
                    "--prefix-file", str(tmp_path / "prefix.txt"), "--max-len-b", "6",
                    "--quiet", "--chunk-lines", "2"], capsys)
    assert [pre[i] for i in (1, 3, 4)] == ["", "", ""]
    assert "2 empty line(s) have a prefix, which goes unused" in caplog.text  # 1 and 4, not 3
    sample = ["-m", models["a"], "-i", path, "--sampling", "--top-k", "20", *fast]
    s1 = _run([*sample, "--seed", "1"], capsys)
    assert s1 == _run([*sample, "--seed", "1"], capsys)
    assert s1 != _run([*sample, "--seed", "2"], capsys)


def test_prefix_the_target_vocabulary_cannot_spell_is_refused(models, tmp_path, capsys,
                                                             monkeypatch):
    """A prefix with a character the target vocabulary lacks would be forced as <unk>: it is
    refused as a constraint is, in one line naming the file, the line and the character, before
    any work for a regular file and where it is read for a pipe."""
    lines = ["the dog runs", "a red ball", "the man sees a cat"]
    path = _write(tmp_path / "in.txt", lines)
    bad = _write(tmp_path / "prefix.txt", ["the", "a red \u0436", ""])
    args = ["-m", models["a"], "-i", path, "--beam", "2", "--max-len-b", "6", "--quiet"]
    with pytest.raises(SystemExit, match=f"^translate: {bad}:2: prefix 'a red \u0436': "
                                         "the target vocabulary lacks '\u0436'$"):
        main([*args, "--prefix-file", bad])
    assert capsys.readouterr().out == ""  # refused before any line is translated
    _stdin(monkeypatch, Path(bad).read_bytes())
    with pytest.raises(SystemExit, match="^translate: -:2: prefix .* lacks '\u0436'"):
        main([*args, "--prefix-file", "-", "--chunk-lines", "1"])
    model, tok, _ = load_model(models["a"])
    with pytest.raises(ValueError, match="prefixes:2: .* lacks '\u0436'"):
        search_lines(model, tok, lines, SearchOptions(beam=2), prefixes=["", "\u0436", ""])


def test_a_prefix_the_model_cannot_write_whole_is_refused(models, tmp_path, capsys,
                                                         monkeypatch):
    """A prefix of the model's maximum (64 tokens, EOS included) or more pieces was cut where
    the output ends, and the translation was that cut prefix alone, without a word. It is
    refused as a prefix the vocabulary cannot spell is: one line naming the file and the line,
    before any work for a regular file, where it is read for a pipe; one piece shorter fits."""
    lines = ["the dog runs", "a red ball"]
    path = _write(tmp_path / "in.txt", lines)
    model, tok, _ = load_model(models["a"])
    fits, long = " ".join(["the"] * 63), " ".join(["the"] * 64)
    assert [len(ids) for ids in tok.encode_tgt([fits, long])] == [63, 64]
    pre = _write(tmp_path / "prefix.txt", ["the dog", long])
    args = ["-m", models["a"], "-i", path, "--beam", "2", "--quiet"]
    said = "prefix of 64 pieces: the model writes at most 63 before EOS"
    with pytest.raises(SystemExit, match=f"^translate: {pre}:2: {said} "):
        main([*args, "--prefix-file", pre])
    assert capsys.readouterr().out == ""
    _stdin(monkeypatch, Path(pre).read_bytes())
    with pytest.raises(SystemExit, match=f"^translate: -:2: {said}"):
        main([*args, "--prefix-file", "-", "--chunk-lines", "1"])
    assert len(capsys.readouterr().out.splitlines()) == 1  # the line before it
    with pytest.raises(ValueError, match=f"^prefixes:2: {said}"):
        search_lines(model, tok, lines, SearchOptions(beam=2), prefixes=["", long])
    out = _run([*args, "--prefix-file", _write(tmp_path / "fits.txt", ["", fits])], capsys)
    assert out[1] == fits


def test_constraints_file_puts_every_phrase_in_its_translation(models, tmp_path, capsys,
                                                              caplog):
    rng = random.Random(9)
    long = " ".join(WORDS * 4)  # over the model's 64 tokens: translated in pieces
    lines = [_sentence(rng) for _ in range(20)] + ["", long, "the dog"]
    words = [w for w in WORDS if len(w) > 2]
    wanted = ["\t".join(rng.sample(words, rng.randint(1, 2))) if i % 3 else ""
              for i in range(len(lines))]
    wanted[20:] = ["dog", "dog", "big red\t\tball"]  # the last: two words, a blank field
    path, cpath = _write(tmp_path / "in.txt", lines), _write(tmp_path / "c.txt", wanted)
    args = ["-m", models["a"], "-i", path, "--beam", "4", "--max-len-b", "12", "--quiet"]
    free = _run(args, capsys)
    out = _run([*args, "--constraints-file", cpath], capsys)
    assert len(out) == len(lines) and out[20] == ""
    for i, (c, hyp) in enumerate(zip(wanted, out, strict=True)):
        if i in (20, 21):  # empty; in pieces (the constraints go unused)
            assert hyp == free[i]
            continue
        assert all(p in hyp for p in split_phrases(c)), (c, hyp)
        if not c:
            assert hyp == free[i]
    assert "2 translation(s) lack a constraint" in caplog.text
    bad = _write(tmp_path / "bad.txt", [""] * 12 + ["dog", "жук"] + [""] * (len(lines) - 14))
    with pytest.raises(SystemExit, match=f"^translate: {bad}:14: constraint 'жук'"):
        main([*args, "--constraints-file", bad, "--chunk-lines", "5"])
    assert capsys.readouterr().out == ""  # refused before any line is translated
    with pytest.raises(SystemExit, match="c3.txt: 3 lines, but the input has 23"):
        main([*args, "--constraints-file", _write(tmp_path / "c3.txt", ["a", "b", "c"])])
    for wrong in (["--sampling"], ["--beam", "1"]):
        with pytest.raises(SystemExit, match="--constraints-file needs beam search"):
            main(["-m", models["a"], "-i", path, "--constraints-file", cpath, *wrong])
    # A file saved "UTF-8 with BOM" whose first line has no phrase, a zero-width space: no
    # phrase, as such an input line is empty (both were refused as characters the target
    # vocabulary lacks, naming '\ufeff')
    blank = _write(tmp_path / "bom.txt", ["\ufeff", "\u200b", *wanted[2:]])
    assert _run([*args, "--constraints-file", blank], capsys)[:2] == free[:2]
    with pytest.raises(SystemExit, match="does not combine"):
        main([*args, "--constraints-file", cpath, "--score", path])


def test_constraints_from_stdin_are_read_once(models, tmp_path, capsys, monkeypatch):
    """'-' is stdin, even beside a file named '-': it cannot be checked ahead, only read once."""
    lines = ["the dog runs", "a red ball", "the man sees a cat"]
    path = _write(tmp_path / "in.txt", lines)
    cpath = _write(tmp_path / "c.txt", ["park", "", "woman\tstreet"])
    args = ["-m", models["a"], "-i", path, "--beam", "4", "--max-len-b", "12", "--quiet"]
    want = _run([*args, "--constraints-file", cpath], capsys)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").write_text("a file named '-'\n")
    _stdin(monkeypatch, Path(cpath).read_bytes())
    assert _run([*args, "--constraints-file", "-"], capsys) == want


def test_mbr_chooses_among_the_candidates_holding_the_constraints(models):
    model, tok, _ = load_model(models["a"])
    rng = random.Random(11)
    lines = [_sentence(rng) for _ in range(30)]
    wanted = [rng.sample([w for w in WORDS if len(w) > 2], 2) for _ in lines]
    opts = SearchOptions(beam=4, nbest=4, max_len_b=6)  # a budget that some lines run out of
    nbest = search_lines(model, tok, lines, opts, constraints=wanted, warn=False)
    mbr = translate_lines(model, tok, lines, SearchOptions(beam=4, max_len_b=6, mbr="chrf",
                                                          mbr_candidates=4), constraints=wanted)
    some = 0
    for r, (text, _), phrases in zip(nbest, (n[0] for n in mbr), wanted, strict=True):
        held = [all(p in t for p in phrases) for t in tok.decode_tgt([h.tokens for h in r.hyps[0]])]
        if any(held) and not all(held):
            some += 1
        assert all(p in text for p in phrases) == any(held)
    assert some  # lines where MBR had candidates of both kinds to choose from


class _Terminal(io.BytesIO):
    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch, typed: bytes) -> None:
    """stdin as a terminal that has ``typed`` to give (text over bytes, as Python's own)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_Terminal(typed), encoding="utf-8"))


def test_interactive_prompt(models, monkeypatch, capsys):
    _terminal(monkeypatch, b"the dog runs\n\nred ball\n")
    out = _run(["-m", models["a"], "--beam", "2", *FAST], capsys)
    model, tok, _ = load_model(models["a"])
    opts = SearchOptions(beam=2, max_len_a=0, max_len_b=4, min_len=1)
    assert out == [n[0][0] for n in translate_lines(model, tok, ["the dog runs", "", "red ball"],
                                                       opts)]


def test_interactive_prompt_says_nan_scores_and_goes_on(models, tmp_path, monkeypatch, capsys):
    """A sentence whose scores are NaN ended the session with a traceback; it is one line, as a
    line that is not UTF-8 is, and the prompt goes on."""
    _terminal(monkeypatch, b"the dog\n\nred ball\n")
    main(["-m", _overflowing(models["a"], tmp_path), *FAST])
    said = capsys.readouterr()
    assert said.out == "\n"  # the empty line's; a refused line has none, as for bad UTF-8
    assert said.err.count(f"translate: {NOT_A_NUMBER}{nan_hint('float32')}\n") == 2


def test_interactive_prompt_says_out_of_memory_and_goes_on(models, monkeypatch, capsys):
    """Out of memory at the prompt (a long paste, a large --beam) ended the session in a
    traceback from the allocator, where a file's run says it in one line with what to lower;
    it is that line, and the prompt goes on."""
    import mt.translate

    search = mt.translate.search_lines

    def short_of_memory(model, tokenizer, lines, *args, **kwargs):
        if lines == ["the dog"]:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator"
                               ": can't allocate memory: you tried to allocate 104857600 bytes.")
        return search(model, tokenizer, lines, *args, **kwargs)

    monkeypatch.setattr(mt.translate, "search_lines", short_of_memory)
    _terminal(monkeypatch, b"the dog\nred ball\n")
    main(["-m", models["a"], "--beam", "2", *FAST])
    said = capsys.readouterr()
    model, tok, _ = load_model(models["a"])
    opts = SearchOptions(beam=2, max_len_a=0, max_len_b=4, min_len=1)
    assert said.out.splitlines() == [translate_lines(model, tok, ["red ball"], opts)[0][0][0]]
    assert ("translate: out of memory: a smaller --batch-tokens (now 4096) or --beam (now 2), or "
            "fewer --workers\n") in said.err
    assert "Traceback" not in said.err


def test_interactive_sampling_draws_on_one_stream_as_a_file_does(models, tmp_path, monkeypatch,
                                                                  capsys):
    """A sentence typed twice gets new samples, as the same line twice in a file does: a fresh
    stream per line gave the same samples each time."""
    args = ["-m", models["a"], "--sampling", "--nbest", "3", "--seed", "5", *FAST]
    _terminal(monkeypatch, b"the dog runs\nthe dog runs\n")
    typed = _run(args, capsys)
    path = _write(tmp_path / "in.txt", ["the dog runs", "the dog runs"])
    assert typed == _run([*args, "-i", path, "--chunk-lines", "1"], capsys)
    assert [row.split("\t")[1:] for row in typed[:3]] != [row.split("\t")[1:]
                                                          for row in typed[3:]]


def test_interactive_prompt_decodes_as_files_do_and_counts_lines(models, monkeypatch, capsys):
    """A line typed at the prompt is decoded as a file's line (--errors): strict refuses one that
    is not UTF-8 in one line naming it and the prompt goes on, replace translates it with
    U+FFFD; --nbest's index counts the lines typed, as it counts a file's."""
    typed = b"the dog runs\nthe \xff cat\nred ball\n"
    model, tok, _ = load_model(models["a"])
    opts = SearchOptions(beam=2, nbest=2, max_len_a=0, max_len_b=4, min_len=1)
    want = [[[str(i), text] for text, _ in n] for i, n in enumerate(translate_lines(
        model, tok, ["the dog runs", "the \ufffd cat", "red ball"], opts))]
    args = ["-m", models["a"], "--beam", "2", "--nbest", "2", *FAST]
    _terminal(monkeypatch, typed)
    out = _run([*args, "--errors", "replace"], capsys)
    assert [row.split("\t")[:2] for row in out] == [e for n in want for e in n]
    _terminal(monkeypatch, typed)
    main(args)
    captured = capsys.readouterr()
    assert [row.split("\t")[:2] for row in captured.out.splitlines()] == want[0] + want[2]
    assert captured.err.count("translate: <stdin>:2: invalid UTF-8") == 1
    assert "Traceback" not in captured.err


def test_the_prompt_refuses_an_output_file_it_would_never_write(models, tmp_path, monkeypatch):
    """`translate -m M -o out.txt` at a terminal printed each translation and never wrote
    out.txt, without a word: a session's work seemed saved and was not."""
    out = tmp_path / "out.txt"
    for stdin in ([], ["-i", "-"]):
        _terminal(monkeypatch, b"the dog runs\n")
        with pytest.raises(SystemExit, match=f"^translate: -o {out} needs the input from a file "
                                             "\\(-i FILE\\) or a pipe; at the prompt"):
            main(["-m", models["a"], *stdin, "-o", str(out), *FAST])
        assert not out.exists()


def test_a_reader_that_leaves_the_prompt_gets_no_traceback(models):
    """`translate -m M | head -1` at a terminal: the second translation met a closed pipe and
    ended in a BrokenPipeError traceback, where a file's or a pipe's input ends quietly."""
    script = Path(sys.executable).with_name("translate")
    terminal, typing = os.openpty()  # stdin a terminal: the interactive prompt
    try:
        proc = subprocess.Popen([str(script), "-m", models["a"], "--beam", "2", *FAST],
                                stdin=typing, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        os.write(terminal, b"the dog runs\n")
        assert proc.stdout.readline()
        proc.stdout.close()  # head has its line and leaves
        os.write(terminal, b"a red ball\n\x04")  # another sentence, then Ctrl-D
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 1
    finally:
        os.close(terminal)
        os.close(typing)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_console_script_keeps_stdout_for_translations(models):
    script = Path(sys.executable).with_name("translate")
    proc = subprocess.run([str(script), "-m", models["a"], "--beam", "2", *FAST[:-1]],
                          input="the dog\n\nthe cat sees a ball\n", capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[0] and lines[2] and lines[3] == ""
    assert "translated 3 lines" in proc.stderr  # logs went to stderr


@pytest.mark.parametrize(("encoding", "unbuffered"), [("utf-8", ""), ("ascii", ""),
                                                     ("utf-8", "1")])
def test_a_reader_that_leaves_early_gets_no_traceback(models, tmp_path, encoding, unbuffered):
    """`translate ... | head -1`: the output outgrows the pipe, head exits, and translate must stop
    quietly instead of printing a BrokenPipeError traceback. ascii: through utf8_stdout's writer;
    PYTHONUNBUFFERED=1 (common in containers): one write of a whole chunk lost the rest silently
    there, with exit status 0."""
    script = Path(sys.executable).with_name("translate")
    src = _write(tmp_path / "in.txt", ["the dog sees a red ball"] * 8000)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": encoding,
           "PYTHONUNBUFFERED": unbuffered}  # empty: unset, for Python
    proc = subprocess.Popen([str(script), "-m", models["a"], "-i", src, "--beam", "1", *FAST],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # A 4 KiB pipe (the default 64 KiB held all 56 KB of the output: a test that paused ~2 s
    # before closing let translate finish and exit 0), set before translate has loaded.
    fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    assert proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
def test_stdout_is_utf8_whatever_the_locale(tmp_path, encoding):
    """Input is read as UTF-8 and -o FILE written so: stdout too, whatever PYTHONIOENCODING or
    the locale say (latin-1 garbled translations, ASCII failed on the first umlaut)."""
    rng = random.Random(3)
    text = [_sentence(rng) for _ in range(400)]
    umlauts = [line.translate(str.maketrans("aou", "\u00e4\u00f6\u00fc")) for line in text]
    tok = train_tokenizer(text[:200], umlauts[200:], TokenizerConfig(vocab_size=100))
    model = _save_model(tmp_path / "de.pt", tok, 0)
    src = _write(tmp_path / "in.txt", text[:20])
    script = Path(sys.executable).with_name("translate")
    args = [str(script), "-m", model, "-i", src, "--beam", "2", *FAST]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": encoding}
    subprocess.run([*args, "-o", str(tmp_path / "out.txt")], check=True, timeout=120, env=env)
    want = (tmp_path / "out.txt").read_bytes()
    assert max(want.decode("utf-8")) > "\x7f"  # translations with umlauts
    proc = subprocess.run(args, capture_output=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == want


def test_the_python_api_refuses_what_it_would_misread(models):
    """Mistakes a notebook makes: one string for a list (read as one line per character), items
    that are not strings, a model left in training mode (dropout on), a packed model cast to
    another dtype, a misspelt dtype or device. Each is one clear error; a generator of lines and
    one path instead of a list of paths are fine."""
    from mt.evaluate import score
    from mt.inference import load_models
    from mt.lines import score_lines

    model, tok, _ = load_models(models["a"], "cpu")  # one path, not a list
    assert all(not m.training for m in model.modules())  # packed modules too
    opts = SearchOptions(beam=2, max_len_a=0, max_len_b=6)
    lines = ["a line", "", "another line"]
    expected = translate_lines(model, tok, lines, opts)
    assert translate_lines(model, tok, (x for x in lines), opts) == expected
    with pytest.raises(TypeError, match="lines: a list of strings, not one string"):
        translate_lines(model, tok, "a line", opts)
    with pytest.raises(TypeError, match=r"lines\[1\] is int, not str"):
        translate_lines(model, tok, ["a line", 3], opts)
    with pytest.raises(TypeError, match="^lines: a list of strings, not NoneType$"):  # iterating
        translate_lines(model, tok, None, opts)
    with pytest.raises(ValueError, match=r"^lines\[1\] holds a lone surrogate \('\\ud800' at "
                                         "character 1\\)"):  # SentencePiece's TypeError
        translate_lines(model, tok, ["a line", "a\ud800b"], opts)
    assert best_translations(model, tok, lines, None) == [  # AttributeError on None.mbr
        n[0][0] for n in translate_lines(model, tok, lines, None)]
    with pytest.raises(TypeError, match="targets: a list of strings"):
        score_lines(model, tok, ["a line"], "a line")
    with pytest.raises(TypeError, match="hypotheses: a list of strings"):
        score("a b c", "a b c")
    with pytest.raises(ValueError, match="no hypotheses to score"):
        score([], [])
    if any(isinstance(m, PackedLinear) for m in model.modules()):  # a torch with oneDNN
        model.to("cpu")  # changes nothing: allowed
        with pytest.raises(RuntimeError, match="a packed model cannot change its dtype"):
            model.to(torch.bfloat16)
    plain = load_model(models["a"])[0].train()
    with pytest.raises(ValueError, match="the model is in training mode"):
        translate_lines(plain, tok, lines, opts)
    again = translate_lines(plain.eval(), tok, lines, opts)  # unpacked: the last digits differ
    assert [[t for t, _ in n] for n in again] == [[t for t, _ in n] for n in expected]
    for wrong, message in ((dict(beam=0), "--beam must be at least 1"),
                           (dict(batch_tokens=0), "--batch-tokens must be at least 1"),
                           (dict(top_k=5), "--top-k shapes the sampling distribution"),
                           # what the command line's types refuse, checked here too
                           (dict(workers=0), "--workers must be at least 1, got 0"),
                           (dict(min_len=-1), "--min-len must be at least 0"),
                           (dict(no_repeat_ngram=-1), "--no-repeat-ngram-size must be 0"),
                           (dict(beam=16, mbr="chrf", mbr_candidates=0),
                            "--mbr-candidates must be at least 1")):
        with pytest.raises(ValueError, match=message):  # the command line's checks and words
            SearchOptions(**wrong)
    with pytest.raises(TypeError, match="beam must be an int, got 2.5"):  # was topk's TypeError
        SearchOptions(beam=2.5)
    with pytest.raises(ValueError, match="--lenpen must be a number between -10 and 10"):
        score_lines(model, tok, ["a line"], ["eine Zeile"], lenpen=float("nan"))  # scores of nan
    with pytest.raises(ValueError, match="2 weights for 1 models"):  # were ignored
        load_models([models["a"]], "cpu", weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        load_models([models["a"]], "cpu", "fp16")
    with pytest.raises(ValueError, match="device gpu: not a device"):
        load_models([models["a"]], "gpu")
    # constraints: a list of strings was read as one phrase per letter, each letter forced in
    two = ["a line", "another line"]
    for wrong, message in (("dog", "constraints: a list of phrase lists, one per line, not one "
                                   "string"),
                           (["dog", ""], r"constraints\[0\] is a str: give each line's phrases "
                                         r"as a list \(\['dog'\]\)"),
                           ([None, ["dog"]], r"constraints\[0\] is NoneType")):
        with pytest.raises(TypeError, match=message):
            translate_lines(model, tok, two, opts, constraints=wrong)
    # blank phrases are none (as in a file), a generator of lists is fine
    assert translate_lines(model, tok, two, opts, constraints=([" "], [])) == translate_lines(
        model, tok, two, opts)
    with pytest.raises(ValueError, match="constraints need beam search with a beam of 2 or more"):
        translate_lines(model, tok, two, replace(opts, beam=1), constraints=[["dog"], []])
    from mt.shortlist import build_shortlist

    with pytest.raises(TypeError, match="sources: a list of strings, not one string"):
        build_shortlist(tok, "abc", "def")


def test_replace_unk_copies_what_the_source_spells(models, tmp_path, capsys):
    """A model that writes nothing but <unk>: without --replace-unk its lines are ' ⁇ ' marks;
    with it, every character comes from its own input line (a line of one piece, '€', gives
    that piece), one output line per input line, empty lines included, in pieces or not."""
    _, tok, _ = load_model(models["a"])
    path = tmp_path / "unk.pt"
    _unk_model(tok, path)
    lines = ["€", "", "the dog ß sees a ball", " ".join(["man"] * 30)]  # the last in pieces
    src = _write(tmp_path / "in.txt", lines)
    plain = _run(["-m", str(path), "-i", src, *FAST], capsys)
    assert len(plain) == 4 and "⁇" in plain[0] and plain[1] == ""
    out = _run(["-m", str(path), "-i", src, "--replace-unk", *FAST], capsys)
    assert len(out) == 4 and out[1] == "" and out[0] == "€" * len(out[0]) and out[0]
    for line, text in zip(lines, out, strict=True):
        assert "⁇" not in text and set(text) <= set(line)
    with pytest.raises(SystemExit, match="does not combine with .*--replace-unk"):
        main(["-m", str(path), "-i", src, "--score", src, "--replace-unk"])


def _unk_model(tok, path, bias=30.0):
    torch.manual_seed(0)
    cfg = ModelConfig(encoder_layers=1, decoder_layers=2, d_model=32, ffn_dim=64, heads=2,
                      dropout=0.0, max_positions=16, src_vocab_size=tok.src_vocab_size,
                      tgt_vocab_size=tok.tgt_vocab_size, final_logits_bias=True)
    model = build_model(cfg)
    with torch.no_grad():
        model.final_logits_bias[tok.tgt.unk_id()] = bias
    save_atomic(model_state(model, tok, None), path)
    return model.eval()


def _oracle(model, tok, r, layer):
    """The texts --replace-unk should print for one LineResult (lines NFKC leaves alone)."""
    if not r.hyps:
        return [""]
    sp, unk = tok.src, tok.tgt.unk_id()
    spelled = sp.encode(r.text, out_type=str)
    starts = [0]
    for s in r.sources[:-1]:
        starts.append(starts[-1] + len(s) - 1)
    entries = range(len(r.hyps[0])) if len(r.hyps) == 1 else range(1)
    out = []
    for e in entries:
        parts = []
        for p, src in enumerate(r.sources):
            toks = r.hyps[p][e].tokens
            with torch.inference_mode():
                attn = cross_attention(model, torch.tensor([src]), torch.tensor([toks + [EOS_ID]]),
                                       layer)[0]
            attn = attn.clone()  # a normal tensor, outside inference mode
            for k, t in enumerate(src):
                if sp.is_control(t) or (not sp.is_unknown(t)
                                        and not sp.id_to_piece(t).lstrip("\u2581")):
                    attn[:, k] = -1.0
            best = attn.argmax(-1).tolist()
            pieces = [spelled[starts[p] + best[j]].lstrip("\u2581") if t == unk
                      else tok.tgt.id_to_piece(t) for j, t in enumerate(toks)]
            parts.append(tok.tgt.decode_pieces(pieces))
        out.append(" ".join(parts))
    return out


LINES = ["€ the ¥ dog", "", "the dog ß sees a ball",
         " ".join(WORDS[:12]) + " € " + " ".join(WORDS[12:]) + " ¥ man"]  # the last in pieces


@pytest.mark.parametrize("layer", [None, -1])
def test_replace_unk_copies_the_attended_piece(models, tmp_path, capsys, layer):
    _, tok, _ = load_model(models["a"])
    path = tmp_path / "unk.pt"
    model = _unk_model(tok, path)
    opts = SearchOptions(beam=2, nbest=2, max_len_a=0, max_len_b=4, min_len=1)
    results = search_lines(model, tok, LINES, opts, warn=False)
    want = [[f"{i}\t{t}" for t in _oracle(model, tok, r, -2 if layer is None else layer)]
            for i, r in enumerate(results)]
    args = ["-m", str(path), "--replace-unk", "--beam", "2", "--nbest", "2", *FAST]
    if layer is not None:
        args += ["--alignment-layer", str(layer)]
    out = _run([*args, "-i", _write(tmp_path / "in.txt", LINES)], capsys)
    assert [row.rsplit("\t", 1)[0] for row in out] == [w for ws in want for w in ws]
    mp = pytest.MonkeyPatch()
    _terminal(mp, "".join(line + "\n" for line in LINES).encode())
    try:
        prompt = _run(args, capsys)
    finally:
        mp.undo()
    assert [row.rsplit("\t", 1)[0] for row in prompt] == [w for ws in want for w in ws]


def test_replace_unk_leaves_lines_without_unk_alone(models, tmp_path, capsys):
    src = _write(tmp_path / "in.txt", LINES)
    args = ["-m", models["a"], "-i", src, "--beam", "3", "--nbest", "3", *FAST]
    assert _run([*args, "--replace-unk"], capsys) == _run(args, capsys)


def test_mt_eval_replace_unk_scores_what_translate_writes(models, tmp_path, capsys, caplog):
    """mt-eval --replace-unk (and its --alignment-layer) scores exactly translate's output with
    the same flags; a layer the decoder lacks is one line naming -m and the flag."""
    from mt import evaluate

    _, tok, _ = load_model(models["a"])
    path = tmp_path / "unk.pt"
    _unk_model(tok, path)
    src = _write(tmp_path / "in.txt", LINES)
    ref = _write(tmp_path / "ref.txt", LINES)
    search = ["--beam", "2", "--max-len-a", "0", "--max-len-b", "4", "--min-len", "1"]
    for layer in ([], ["--alignment-layer", "0"]):
        want = _run(["-m", str(path), "-i", src, "--replace-unk", *layer, *search, "--quiet"],
                    capsys)
        assert "⁇" not in "".join(want)
        evaluate.main(["-m", str(path), "--src", src, "--ref", ref, "--replace-unk", *layer,
                       *search, "--output", str(tmp_path / "hyp.txt"), "--json", "-q"])
        system = json.loads(capsys.readouterr().out)["tests"][0]["systems"][0]
        assert (tmp_path / "hyp.txt").read_text(encoding="utf-8").splitlines() == want
        assert system["replace_unk"] and system["alignment_layer"] == (int(layer[1]) if layer
                                                                       else None)
    evaluate.main(["-m", str(path), "--src", src, "--ref", ref, *search, "--alignment-layer",
                   "0", "--output", str(tmp_path / "plain.txt")])
    assert "⁇" in (tmp_path / "plain.txt").read_text(encoding="utf-8")
    assert "--alignment-layer has no effect without --replace-unk" in caplog.text
    with pytest.raises(SystemExit, match=f"^mt-eval: -m {path}: --alignment-layer 2: the "
                       "decoder has 2 layers$"):
        evaluate.main(["-m", str(path), "--src", src, "--ref", ref, "--replace-unk",
                       "--alignment-layer", "2", *search])


def test_replace_unk_copies_the_input_spelling_not_nfkc(models, tmp_path, capsys):
    _, tok, _ = load_model(models["a"])
    path = tmp_path / "unk.pt"
    _unk_model(tok, path)
    lines = ["½", "ＤＯＧ", "x²"]
    out = _run(["-m", str(path), "-i", _write(tmp_path / "in.txt", lines), "--replace-unk", *FAST],
               capsys)
    for line, text in zip(lines, out, strict=True):
        assert text and set(text) <= set(line), (line, text)
    # a line separator (NEL survives NFKC, as <unk>) is not copied: it would break the rows
    # for a reader that splits lines on it; nor is text read as a piece ('</s>')
    lines = ["\x85", "€ </s>"]
    out = _run(["-m", str(path), "-i", _write(tmp_path / "sep.txt", lines), "--replace-unk",
                "--beam", "2", "--nbest", "2", *FAST], capsys)
    assert len(out) == 4 and all(len(row.split("\t")) == 3 for row in out)
    assert not any("\x85" in row for row in out)
    assert all("⁇" not in row.split("\t")[1] for row in out[2:])


def test_the_dtype_flag_names_what_the_models_can_be_cast_to():
    """translate and mt-eval list the dtypes without importing torch (mt.options); the list is
    mt.inference's."""
    from mt.inference import DTYPES
    from mt.options import DTYPE_NAMES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_stdout_writer_writes_every_byte_of_a_raw_stdout(monkeypatch, encoding):
    """Under PYTHONUNBUFFERED=1 stdout's buffer is the raw file, whose write may take part of
    the bytes; sys.stdout dropped the rest without a word. utf8_stdout's writer writes them all
    (and has writelines, which mt-eval --output - calls: it had none)."""
    import io

    from mt.textio import utf8_stdout

    class Slow(io.RawIOBase):  # a pipe that takes 3 bytes a write
        def __init__(self) -> None:
            self.data = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.data += bytes(b[:3])
            return min(3, len(b))

    raw = Slow()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding=encoding,
                                                        write_through=True))
    out = utf8_stdout()
    out.write("Grüße aus Köln\n")
    out.writelines(["zwei\n", "drei\n"])
    out.flush()
    assert raw.data.decode("utf-8") == "Grüße aus Köln\nzwei\ndrei\n"


@pytest.mark.parametrize("fast", [False, True])
def test_bfloat16_on_a_cpu_without_it_is_said_slower(models, monkeypatch, caplog, fast):
    """On an AVX2-only CPU a bfloat16 product ran at 1/6 of float32's rate: the README's
    `--dtype bfloat16` made translate several times slower there, without a word."""
    from mt import inference, optim
    from mt.inference import load_models

    monkeypatch.setattr(inference, "cpu_has_fast_bf16", lambda: fast)
    monkeypatch.setattr(optim, "cpu_has_fast_bf16", lambda: fast)
    with caplog.at_level(logging.WARNING):
        load_models([models["a"]], "cpu", "bfloat16")
        load_models([models["a"]], "cpu", "float32")
        optim.autocast_dtype("bf16", torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records if "without bfloat16 instructions" in r.message]
    assert len(said) == (0 if fast else 2), said
    if not fast:
        assert "--dtype float32 (or int8) decodes faster" in said[0]
        assert said[1].startswith("trainer.precision=bf16 on a CPU without bfloat16")
