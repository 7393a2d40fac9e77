"""mt-eval must print exactly what sacrebleu's own command line prints, and stop silent mistakes.

Scores are checked against the ``sacrebleu`` CLI run on the same files (a different code path:
its own file reading and argument handling), paired tests against planted differences, and the
sanity checks against the mistakes they exist for.
"""

import hashlib
import io
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mt import evaluate, testsets
from mt.evaluate import main

SACREBLEU = str(Path(sys.executable).with_name("sacrebleu"))
WORDS = ("the a dog cat man woman child ball park street red blue small big runs walks sees "
         "holds plays sits near under with on in at").split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
    if rng.random() < 0.3:
        words[rng.randrange(1, len(words))] += ","
    return " ".join(words).capitalize() + "."


def _perturb(lines: list[str], rate: float, seed: int) -> list[str]:
    """Replaces each word with probability ``rate``: a system of known, controllable quality."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) if rng.random() < rate else w for w in line.split())
            for line in lines]


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture
def files(tmp_path):
    rng = random.Random(0)
    ref = [_sentence(rng) for _ in range(200)]
    ref2 = _perturb(ref, 0.2, seed=9)  # a second reference translation
    return {
        "ref": _write(tmp_path / "ref.de", ref),
        "ref2": _write(tmp_path / "ref2.de", ref2),
        "good": _write(tmp_path / "good.hyp", _perturb(ref, 0.2, seed=1)),
        "bad": _write(tmp_path / "bad.hyp", _perturb(ref, 0.45, seed=2)),
        "tmp": tmp_path,
    }


def _run(argv: list[str], capsys) -> dict:
    main([*argv, "--json", "--quiet"])
    return json.loads(capsys.readouterr().out)  # the whole of stdout is one JSON object


def _cli(refs: list[str], hyp: str, *args: str) -> list[dict]:
    out = subprocess.run([SACREBLEU, *refs, "-i", hyp, "-w", "4", "-f", "json", *args],
                         capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    return result if isinstance(result, list) else [result]


@pytest.mark.parametrize("options,cli_options", [
    ([], []),
    (["--tokenize", "intl"], ["--tokenize", "intl"]),
    (["--lowercase"], ["--lowercase", "--chrf-lowercase"]),
    (["--tokenize", "none"], ["--tokenize", "none"]),
])
@pytest.mark.parametrize("two_refs", [False, True])
def test_scores_equal_the_sacrebleu_cli(files, capsys, options, cli_options, two_refs):
    refs = [files["ref"], files["ref2"]] if two_refs else [files["ref"]]
    ours = _run(["--hyp", files["good"], "--ref", *refs, "-M", "bleu", "chrf", "chrf++", "ter",
                 *options], capsys)
    (test,) = ours["tests"]
    scores = test["systems"][0]["scores"]
    assert test["sentences"] == 200 and test["references"] == refs
    cli = _cli(refs, files["good"], "-m", "bleu", "chrf", "ter", *cli_options)
    cli += _cli(refs, files["good"], "-m", "chrf", "--chrf-word-order", "2", *cli_options)
    for name, theirs in zip(["bleu", "chrf", "ter", "chrf++"], cli, strict=True):
        assert scores[name]["score"] == pytest.approx(theirs["score"], abs=1e-3), name
        assert scores[name]["signature"] == theirs["signature"], name
        system = test["systems"][0]  # the flat keys of score() and test.json, for scripts
        assert (system[name], system[f"{name}_signature"]) == (scores[name]["score"],
                                                                scores[name]["signature"])
    assert 0.9 < test["systems"][0]["len_ratio"] < 1.1
    assert scores["bleu"]["ratio"] == test["systems"][0]["len_ratio"]


def test_score_api_used_by_training_equals_the_cli(files):
    ref = Path(files["ref"]).read_text().splitlines()
    hyp = Path(files["bad"]).read_text().splitlines()
    result = evaluate.score(hyp, ref)
    cli = _cli([files["ref"]], files["bad"], "-m", "bleu", "chrf")
    assert set(result) == {"bleu", "bleu_signature", "chrf", "chrf_signature", "sentences"}
    assert result["bleu"] == pytest.approx(cli[0]["score"], abs=1e-3)
    assert result["chrf"] == pytest.approx(cli[1]["score"], abs=1e-3)
    assert result["bleu_signature"] == cli[0]["signature"] and result["sentences"] == 200


def test_confidence_interval_equals_the_cli(files, capsys):
    ours = _run(["--hyp", files["bad"], "--ref", files["ref"], "-M", "bleu", "--confidence",
                 "--confidence-n", "200"], capsys)
    bleu = ours["tests"][0]["systems"][0]["scores"]["bleu"]
    (cli,) = _cli([files["ref"]], files["bad"], "-m", "bleu", "--confidence",
                  "--confidence-n", "200")
    assert bleu["ci"] > 0 and "bs:200" in bleu["signature"]
    assert bleu["signature"] == cli["signature"]
    assert bleu["mean"] == pytest.approx(cli["confidence_mean"], abs=1e-3)
    assert bleu["ci"] == pytest.approx(cli["confidence_var"], abs=1e-3)


def test_paired_tests_find_a_planted_improvement_and_not_a_copy(files, capsys, caplog):
    ref = Path(files["ref"]).read_text().splitlines()
    bad = Path(files["bad"]).read_text().splitlines()
    almost = list(bad)
    fixed = next(i for i, (b, r) in enumerate(zip(bad, ref, strict=True)) if b != r)
    almost[fixed] = ref[fixed]  # one sentence fixed: a real but tiny difference
    almost_file = _write(files["tmp"] / "almost.hyp", almost)
    copy_file = _write(files["tmp"] / "copy.hyp", bad)
    ours = _run(["--hyp", files["bad"], files["good"], copy_file, almost_file, "--ref",
                 files["ref"], "-M", "bleu", "chrf", "--paired-bs", "--paired-ar",
                 "--paired-ar-n", "2000"], capsys)
    base, good, copy, tiny = ours["tests"][0]["systems"]
    for metric in ("bleu", "chrf"):
        assert good["scores"][metric]["score"] > base["scores"][metric]["score"]
        for kind in ("bs", "ar"):
            assert base["scores"][metric].get(f"p_{kind}") is None  # the baseline has none
            assert good["scores"][metric][f"p_{kind}"] < 0.05
            assert copy["scores"][metric][f"p_{kind}"] == 1.0
        assert tiny["scores"][metric]["p_bs"] > 0.05
    assert copy["identical_to_baseline"] and tiny["differing_sentences"] == 1
    # sacrebleu's AR test calls a one-sentence difference significant (it counts only strictly
    # larger shuffled differences); mt-eval reports its p-value unchanged, with a warning.
    assert any("differs from the baseline in only 1 sentence" in r.message
               for r in caplog.records)
    # The p-values are sacrebleu's own: the CLI's AR test on the same pair agrees.
    cli = json.loads(subprocess.run(
        [SACREBLEU, files["ref"], "-i", files["bad"], almost_file, "-m", "bleu", "--paired-ar",
         "--paired-ar-n", "2000", "-f", "json"], capture_output=True, text=True,
        check=True).stdout)
    assert tiny["scores"]["bleu"]["p_ar"] == pytest.approx(cli[1]["BLEU"]["p_value"])


def test_an_equal_score_is_not_significant(files, capsys):
    """Two different systems with the same BLEU (0: barely trained checkpoints that share no
    4-gram with the references) differ in no resample either; sacrebleu then counts no larger
    difference and gives the smallest p-value (1/1001), which mt-eval printed as significant."""
    ref = Path(files["ref"]).read_text().splitlines()
    first = _write(files["tmp"] / "first.hyp", [line.split()[0] for line in ref])
    second = _write(files["tmp"] / "second.hyp", [line.split()[1] for line in ref])
    result = _run(["--hyp", first, second, "--ref", files["ref"], "-M", "bleu", "chrf",
                   "--paired-bs", "--paired-bs-n", "100", "--paired-ar", "--paired-ar-n", "100"],
                  capsys)
    base, other = result["tests"][0]["systems"]
    assert base["scores"]["bleu"]["score"] == other["scores"]["bleu"]["score"] == 0.0
    assert other["scores"]["bleu"]["p_bs"] == other["scores"]["bleu"]["p_ar"] == 1.0
    # the chrF scores differ: sacrebleu's own p-value stays
    assert other["scores"]["chrf"]["score"] != base["scores"]["chrf"]["score"]
    assert other["scores"]["chrf"]["p_bs"] < 1.0
    main(["--hyp", first, second, "--ref", files["ref"], "-M", "bleu", "--paired-bs",
          "--paired-bs-n", "100", "--quiet"])
    (row,) = [r for r in capsys.readouterr().out.splitlines() if "second.hyp " in r]
    assert "(p=1.0000)" in row and "*" not in row


def test_a_metric_given_twice_is_scored_once(files, capsys):
    result = _run(["--hyp", files["good"], files["bad"], "--ref", files["ref"],
                   "-M", "chrf", "bleu", "chrf", "--paired-bs", "--paired-bs-n", "20"], capsys)
    assert result["metrics"] == ["chrf", "bleu"]
    assert list(result["tests"][0]["systems"][1]["scores"]) == ["chrf", "bleu"]
    assert result["tests"][0]["systems"][1]["scores"]["bleu"]["p_bs"] is not None


def test_line_count_mismatch_names_both_files_and_counts(files):
    short = _write(files["tmp"] / "short.hyp", Path(files["good"]).read_text().splitlines()[:150])
    with pytest.raises(SystemExit) as err:
        main(["--hyp", short, "--ref", files["ref"]])
    message = str(err.value)
    assert short in message and files["ref"] in message
    assert "150" in message and "200" in message


def test_mismatched_second_reference_and_source_are_errors(files):
    short = _write(files["tmp"] / "short.de", ["x"] * 10)
    with pytest.raises(SystemExit, match="short.de has 10 lines"):
        main(["--hyp", files["good"], "--ref", files["ref"], short])


def test_source_is_checked_for_hypothesis_files_too(files):
    """--src is recorded as the test set's source: a wrong one is an error with --hyp as with -m."""
    short = _write(files["tmp"] / "short.en", ["x"] * 10)
    with pytest.raises(SystemExit, match="short.en has 10 lines but .*ref.de has 200"):
        main(["--hyp", files["good"], "--src", short, "--ref", files["ref"]])
    with pytest.raises(SystemExit, match="missing.en: no such file"):
        main(["--hyp", files["good"], "--src", str(files["tmp"] / "missing.en"),
              "--ref", files["ref"]])
    latin1 = files["tmp"] / "latin1.en"
    latin1.write_bytes("caf\xe9\n".encode("latin-1") * 200)
    with pytest.raises(SystemExit, match="latin1.en:1: invalid UTF-8"):
        main(["--hyp", files["good"], "--src", str(latin1), "--ref", files["ref"]])
    wide = files["tmp"] / "wide.de"  # UTF-16 (PowerShell's '>'): not 'invalid UTF-8 at byte 0'
    wide.write_bytes(Path(files["good"]).read_text().encode("utf-16"))
    with pytest.raises(SystemExit, match="wide.de:1: UTF-16 text .* iconv -f UTF-16 -t UTF-8"):
        main(["--hyp", str(wide), "--ref", files["ref"]])
    mac = files["tmp"] / "mac.de"  # old Mac line ends: one line, not 200
    mac.write_bytes(Path(files["good"]).read_bytes().replace(b"\n", b"\r"))
    with pytest.raises(SystemExit, match=r"mac.de:1: its lines end in a carriage return \(\\r"):
        main(["--hyp", str(mac), "--ref", files["ref"]])


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_hypotheses_are_an_error(files, content):
    empty = files["tmp"] / "empty.hyp"
    empty.write_text(content)
    with pytest.raises(SystemExit, match="the hypotheses are empty"):
        main(["--hyp", str(empty), "--ref", files["ref"]])


def test_a_line_per_reference_all_empty_is_scored(files, capsys, caplog):
    """A system that wrote an empty line for every reference (an early validation's step_N.hyp)
    scores 0 with a warning, as sacrebleu scores it and as mt-eval -m scores such a model; it
    was an error that stopped the whole command, the other systems' scores with it."""
    blank = _write(files["tmp"] / "blank.hyp", [" "] * 200)
    with caplog.at_level("WARNING", logger="mt.evaluate"):
        result = _run(["--hyp", files["good"], blank, "--ref", files["ref"], "-M", "bleu",
                       "chrf", "ter", "--paired-bs", "--paired-bs-n", "100"], capsys)
    assert "blank.hyp: every translation is empty" in caplog.text
    scores = result["tests"][0]["systems"][1]["scores"]
    cli = _cli([files["ref"]], blank, "-m", "bleu", "chrf", "ter")
    assert [round(s["score"], 4) for s in scores.values()] == [c["score"] for c in cli]


def test_tokenized_reference_gives_a_warning(files, caplog):
    ref = Path(files["ref"]).read_text().splitlines()
    tokenized = _write(files["tmp"] / "tok.de",
                       [s.replace(",", " ,").replace(".", " .") for s in ref])
    main(["--hyp", files["good"], "--hyp", files["good"], "--ref", tokenized, "--quiet"])
    said = [r.message for r in caplog.records if "tok.de looks tokenized" in r.message]
    assert len(said) == 1, said  # once, not once per system
    caplog.clear()
    main(["--hyp", files["good"], "--ref", files["ref"], "--quiet"])  # detokenized: no warning
    assert not any("tokenized" in r.message for r in caplog.records)


def test_formats_show_the_same_scores(files, capsys):
    argv = ["--hyp", files["bad"], files["good"], "--ref", files["ref"], "--quiet",
            "-M", "bleu", "ter", "--json-out", str(files["tmp"] / "r.json")]
    main(argv)
    text = capsys.readouterr().out
    saved = json.loads((files["tmp"] / "r.json").read_text())
    bleu = saved["tests"][0]["systems"][1]["scores"]["bleu"]["score"]
    for fmt in ("markdown", "latex"):
        main([*argv, "--format", fmt])
        out = capsys.readouterr().out
        assert f"{bleu:.2f}" in out
        assert out.count("\n") >= 4
    assert f"{bleu:.2f}" in text and "BLEU: nrefs:1|" in text
    odd = files["tmp"] / "sys_a^2~b\\c&d.de"  # LaTeX's special characters in a file name
    odd.write_bytes(Path(files["good"]).read_bytes())
    main(["--hyp", str(odd), "--ref", files["ref"], "--quiet", "--format", "latex"])
    out = capsys.readouterr().out
    assert (r"sys\_a\textasciicircum{}2\textasciitilde{}b\textbackslash{}c\&d.de" in out
            and "~" not in out and "^" not in out)
    main([*argv, "--format", "json"])
    assert json.loads(capsys.readouterr().out)["tests"] == saved["tests"]


def test_results_on_stdout_are_utf8_whatever_the_locale(files, monkeypatch):
    """Names and paths may hold any character: stdout is UTF-8, as --json-out is, not the
    locale's encoding (an ASCII stdout failed after all the work was done)."""
    hyp = files["tmp"] / "hyp-\u00fc.txt"
    hyp.write_bytes(Path(files["good"]).read_bytes())
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stdout)
    main(["--hyp", str(hyp), "--ref", files["ref"], "--name", "Pr\u00fcfung", "--quiet", "--json"])
    stdout.flush()
    result = json.loads(stdout.buffer.getvalue().decode("utf-8"))
    assert result["tests"][0]["name"] == "Pr\u00fcfung"


def test_named_test_set_resolves_against_the_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the cwd must not matter
    test = testsets.load_named_test("multi30k_test2016")
    root = Path(evaluate.__file__).resolve().parent.parent
    data = (root / "../shared/data/multi30k").resolve()
    assert test.langpair == "en-de"
    assert test.src == str(data / "test2016.en") and test.refs == [str(data / "test2016.de")]
    fr = testsets.load_named_test("multi30k_test2016", "en-fr")
    assert fr.refs == [str(data / "test2016.fr")] and fr.src == test.src
    with pytest.raises(testsets.EvalError, match="no language 'ja'"):
        testsets.load_named_test("multi30k_test2016", "en-ja")
    with pytest.raises(testsets.EvalError, match="multi30k_test2016"):  # lists the known ones
        testsets.load_named_test("no_such_set")


def test_several_named_test_sets_in_one_call(files, tmp_path, monkeypatch, capsys):
    conf = tmp_path / "testsets"
    conf.mkdir()
    for name in ("one", "two"):
        (conf / f"{name}.yaml").write_text(
            f"langpair: en-de\nsrc: {files['ref']}\nref: '{{tgt}}_{name}.txt'\n")
        _write(tmp_path / f"de_{name}.txt", Path(files["ref"]).read_text().splitlines())
        _write(tmp_path / f"{name}.hyp", Path(files[
            "good" if name == "one" else "bad"]).read_text().splitlines())
    monkeypatch.setattr(testsets, "TESTSETS_DIR", conf)
    monkeypatch.setattr(testsets, "REPO_ROOT", tmp_path)
    with pytest.raises(SystemExit, match=r"\{test\}"):
        main(["--hyp", str(tmp_path / "one.hyp"), "--test", "one", "two"])
    out = _run(["--hyp", str(tmp_path / "{test}.hyp"), "--test", "one", "two"], capsys)
    one, two = out["tests"]
    assert (one["name"], two["name"]) == ("one", "two")
    assert one["systems"][0]["hypotheses"] == str(tmp_path / "one.hyp")
    assert one["systems"][0]["scores"]["bleu"]["score"] > two["systems"][0]["scores"]["bleu"][
        "score"]
    (conf / "typo.yaml").write_text("langpair: en-de\nsrc: x.{src}\nref: x.{target}\n")
    with pytest.raises(SystemExit, match=r"^mt-eval: .*typo.yaml: 'x.\{target\}': the "
                                         r"placeholders are \{src\} and \{tgt\}"):
        main(["--hyp", str(tmp_path / "one.hyp"), "--test", "typo"])


@pytest.mark.parametrize("body,said", [
    ("src: x.en\nref: []\n", "ref: [] is not a path or a list of paths"),
    ("src: x.en\nref: 12\n", "ref: 12 is not a path or a list of paths"),
    ("src: null\nref: x.de\n", "src: None is not a path"),
    ("src: x.en\nref: [x.de, null]\n", "ref: ['x.de', None] is not a path"),
    ("5\n", "not a mapping of keys"),
    ("src: x.en\nref: x.de\nlanguages: en\n", "languages: 'en' is not a list of language codes"),
    ("src: x.en\nref: x.de\nlangpair: en-no\nlanguages: [en, no]\n",  # YAML: no is false
     "languages: ['en', False] is not a list of language codes"),
])
def test_a_named_test_set_of_the_wrong_shape_is_one_line(files, tmp_path, monkeypatch, body,
                                                         said):
    """Values that are not paths (null, a number, an empty list) went on as paths: tracebacks;
    a languages string was read as its letters."""
    conf = tmp_path / "testsets"
    conf.mkdir()
    prefix = "langpair: en-de\n" if "src" in body and "langpair" not in body else ""
    (conf / "odd.yaml").write_text(prefix + body)
    monkeypatch.setattr(testsets, "TESTSETS_DIR", conf)
    with pytest.raises(SystemExit) as err:
        main(["--hyp", files["good"], "--test", "odd"])
    assert str(err.value).startswith(f"mt-eval: {conf / 'odd.yaml'}: ") and said in str(err.value)


def test_a_named_test_set_with_a_missing_file_names_its_yaml(files, tmp_path, monkeypatch):
    """The path alone did not say which conf/testsets/ file gave it, nor that its relative paths
    start at the repository root (not the working directory)."""
    conf = tmp_path / "testsets"
    conf.mkdir()
    (conf / "gone.yaml").write_text(f"langpair: en-de\nsrc: data/x.{{src}}\nref: {files['ref']}\n")
    monkeypatch.setattr(testsets, "TESTSETS_DIR", conf)
    monkeypatch.setattr(testsets, "REPO_ROOT", tmp_path / "root")
    with pytest.raises(SystemExit) as err:
        main(["--hyp", files["good"], "--test", "gone"])
    assert str(err.value) == (f"mt-eval: conf/testsets/gone.yaml: src {tmp_path}/root/data/x.en: "
                              f"no such file (relative paths there start at {tmp_path}/root)")


def test_sacrebleu_test_set_offline_fails_fast_with_one_line(tmp_path):
    env = {**os.environ, "SACREBLEU": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mt.evaluate", "--hyp", "x.hyp", "--test-set",
                           "wmt14", "--langpair", "en-de"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert time.perf_counter() - start < 20
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "wmt14" in lines[0] and "offline" in lines[0], proc.stderr
    with pytest.raises(SystemExit, match="no language pair en-xx"):
        main(["--hyp", "x.hyp", "--test-set", "wmt14", "--langpair", "en-xx"])


def test_a_bleu_tokenizer_that_cannot_load_is_a_one_line_error(files, monkeypatch):
    """sacreBLEU downloads the flores tokenizers' model and needs extras for ja/ko: a traceback."""
    import urllib.error

    from sacrebleu.tokenizers import tokenizer_ja_mecab, tokenizer_spm

    monkeypatch.setattr(tokenizer_spm, "SACREBLEU_DIR", str(files["tmp"] / "cache"))
    hyp_ref = ["--hyp", files["good"], "--ref", files["ref"]]
    with pytest.raises(SystemExit, match=r"--tokenize flores200: .* is set \(offline\)") as err:
        main([*hyp_ref, "--tokenize", "flores200"])
    assert "\n" not in str(err.value)

    def no_network(url, path, *args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    for var in testsets.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tokenizer_spm, "download_file", no_network)
    with pytest.raises(SystemExit, match=r"flores101: cannot download .*Name or service") as err:
        main([*hyp_ref, "--tokenize", "flores101", "-M", "chrf"])  # BLEU's length ratio needs it
    assert "\n" not in str(err.value)

    monkeypatch.setattr(tokenizer_ja_mecab, "MeCab", None)  # as without sacrebleu[ja]
    with pytest.raises(SystemExit, match=r"for ja targets \(ja-mecab\): .*sacrebleu\[ja\]") as err:
        main([*hyp_ref, "--langpair", "en-ja"])
    assert "\n" not in str(err.value)


def test_chrf_alone_needs_no_bleu_tokenizer_for_the_target_language(files, capsys, caplog,
                                                                   monkeypatch):
    """`sacrebleu -m chrf -l en-ja` scores without MeCab; mt-eval refused, for the len ratio
    alone (BLEU's tokens), chrF and TER for Japanese targets without sacrebleu[ja]."""
    from sacrebleu.tokenizers import tokenizer_ja_mecab

    monkeypatch.setattr(tokenizer_ja_mecab, "MeCab", None)  # as without sacrebleu[ja]
    argv = ["--hyp", files["good"], files["bad"], "--ref", files["ref"], "-M", "chrf", "ter",
            "--paired-bs", "--paired-bs-n", "50"]
    with caplog.at_level("WARNING", logger="mt.evaluate"):
        ja = _run([*argv, "--langpair", "en-ja"], capsys)
    assert "sacrebleu[ja]" in caplog.text and "the len ratio (in BLEU's tokens) is left out" in \
        caplog.text
    plain = _run(argv, capsys)["tests"][0]["systems"]
    for system, same in zip(ja["tests"][0]["systems"], plain, strict=True):
        assert system["len_ratio"] is None
        assert {m: system[m] for m in ("chrf", "ter")} == {m: same[m] for m in ("chrf", "ter")}
    main([*argv, "--langpair", "en-ja", "-q"])
    assert capsys.readouterr().out.splitlines()[3].endswith("  -")  # the table's len ratio
    with pytest.raises(SystemExit, match=r"for ja targets \(ja-mecab\)"):  # BLEU asked for
        main([*argv, "-M", "chrf", "bleu", "--langpair", "en-ja"])


def test_sacrebleu_test_set_from_the_cache_equals_the_cli(files):
    cache = files["tmp"] / "cache"
    (cache / "wmt14").mkdir(parents=True)
    ref = Path(files["ref"]).read_text().splitlines()[:50]
    for field in ("src", "ref", "docid", "genre", "origlang"):  # the files sacrebleu makes
        _write(cache / "wmt14" / f"wmt14.en-de.{field}", ref)  # only the references count here
    hyp = _write(files["tmp"] / "wmt14.hyp", Path(files["good"]).read_text().splitlines()[:50])
    env = {**os.environ, "SACREBLEU": str(cache), "HF_HUB_OFFLINE": "1"}
    ours = json.loads(subprocess.run(
        [sys.executable, "-m", "mt.evaluate", "--hyp", hyp, "--test-set", "wmt14", "-l", "en-de",
         "--json"], capture_output=True, text=True, env=env, check=True).stdout)
    theirs = json.loads(subprocess.run(
        [SACREBLEU, "-t", "wmt14", "-l", "en-de", "-i", hyp, "-w", "4"], capture_output=True,
        text=True, env=env, check=True).stdout)
    (test,) = ours["tests"]
    assert test["origin"] == "sacrebleu" and test["sentences"] == 50
    assert test["systems"][0]["scores"]["bleu"]["score"] == pytest.approx(theirs["score"],
                                                                          abs=1e-3)


@pytest.mark.parametrize("flag, value", [("--width", "-1"), ("--paired-bs-n", "0"),
                                         ("--paired-ar-n", "-3"), ("--confidence-n", "0"),
                                         ("--confidence-n", "1"), ("--paired-bs-n", "1")])
def test_counts_out_of_range_are_refused(files, capsys, flag, value):
    """--width -1 was a traceback; a resample count of 0 silently ran the default (or showed
    no interval)."""
    with pytest.raises(SystemExit):
        main(["--hyp", files["good"], "--ref", files["ref"], flag, value])
    assert f"argument {flag}" in capsys.readouterr().err


def test_json_and_another_format_is_refused(files):
    with pytest.raises(SystemExit, match="--json means --format json; it does not combine with "
                                         "--format latex"):
        main(["--hyp", files["good"], "--ref", files["ref"], "--format", "latex", "--json"])


def test_a_byte_order_mark_is_not_text(files, capsys):
    """A file saved with a BOM scores as the same file without one, as mt-train reads its test
    references (the run's test.json and mt-eval on the same files gave different chrF); so does
    one with a BOM before a line in mid-file (`cat a.txt b.txt`, b saved with one)."""
    marked = {}
    for name in ("ref", "good"):
        lines = Path(files[name]).read_text(encoding="utf-8").splitlines(keepends=True)
        marked[name] = files["tmp"] / f"bom.{name}"
        marked[name].write_text("\ufeff" + "".join(lines[:3]) + "\ufeff" + "".join(lines[3:]),
                                encoding="utf-8")
    plain = _run(["--hyp", files["good"], "--ref", files["ref"], "--name", "t"], capsys)
    bom = _run(["--hyp", str(marked["good"]), "--ref", str(marked["ref"]), "--name", "t"], capsys)
    assert [s["scores"] for s in bom["tests"][0]["systems"]] == [
        s["scores"] for s in plain["tests"][0]["systems"]]
    assert testsets.read_text(marked["ref"]) == testsets.read_text(files["ref"])


def _wmt19_cache(cache: Path, ref: list[str]) -> list[str]:
    """sacrebleu's cache of wmt19 en-de made of ``ref`` (also the source): its text files and
    the raw SGML file that --origlang reads, four documents of 10 lines first written in en, de,
    en, de. Returns each line's original language."""
    origlang = [("en", "de")[i // 10 % 2] for i in range(len(ref))]
    fields = {"src": ref, "ref": ref, "docid": [f"d{i // 10}" for i in range(len(ref))],
              "genre": ["news"] * len(ref), "origlang": origlang}
    (cache / "wmt19" / "raw" / "sgm").mkdir(parents=True)
    for field, lines in fields.items():
        _write(cache / "wmt19" / f"wmt19.en-de.{field}", lines)
    sgm = ['<srcset setid="newstest2019" srclang="any">']
    for i, line in enumerate(ref):
        if i % 10 == 0:
            sgm += ["</doc>"] * (i > 0) + [
                f'<doc sysid="ref" docid="d{i // 10}" genre="news" origlang="{origlang[i]}">']
        sgm.append(f'<seg id="{i % 10 + 1}">{line}</seg>')
    _write(cache / "wmt19" / "raw" / "sgm" / "newstest2019-ende-src.en.sgm",
           [*sgm, "</doc>", "</srcset>"])
    return origlang


@pytest.mark.parametrize("origlang", ["de", "non-de"])
def test_origlang_scores_what_the_sacrebleu_cli_scores(files, origlang):
    """WMT19 and later are scored on their halves first written in each language."""
    cache = files["tmp"] / "cache"
    ref = Path(files["ref"]).read_text().splitlines()[:40]
    _wmt19_cache(cache, ref)
    hyp = Path(files["tmp"] / "wmt19.hyp")
    _write(hyp, _perturb(ref[:10], 0.1, seed=4) + _perturb(ref[10:], 0.5, seed=5))
    env = {**os.environ, "SACREBLEU": str(cache), "HF_HUB_OFFLINE": "1"}
    common = ["-t", "wmt19", "-l", "en-de", "--origlang", origlang]
    scores = files["tmp"] / "scores.jsonl"
    ours = json.loads(subprocess.run(
        [sys.executable, "-m", "mt.evaluate", "--hyp", str(hyp), *common, "--json",
         "--sentence-scores", str(scores)], capture_output=True, text=True, env=env,
        check=True).stdout)
    rows = [json.loads(x) for x in scores.read_text().splitlines()[1:]]
    first = 11 if origlang == "de" else 1  # documents 2 and 4 are de; line numbers of the file
    assert [r["line"] for r in rows][:2] == [first, first + 1] and len(rows) == 20
    assert all(r["hyp"] == hyp.read_text().splitlines()[r["line"] - 1] for r in rows)
    theirs = json.loads(subprocess.run(
        [SACREBLEU, *common, "-i", str(hyp), "-w", "4"], capture_output=True, text=True,
        env=env, check=True).stdout)
    (test,) = ours["tests"]
    assert (test["sentences"], test["sentences_in_test_set"]) == (20, 40)
    assert test["origlang"] == origlang
    assert test["systems"][0]["scores"]["bleu"]["score"] == pytest.approx(theirs["score"],
                                                                          abs=1e-3)
    whole = json.loads(subprocess.run(
        [sys.executable, "-m", "mt.evaluate", "--hyp", str(hyp), *common[:4], "--json"],
        capture_output=True, text=True, env=env, check=True).stdout)
    assert whole["tests"][0]["sentences"] == 40  # the subset did change the score
    assert whole["tests"][0]["systems"][0]["scores"]["bleu"]["score"] != pytest.approx(
        theirs["score"], abs=0.5)


def test_origlang_translates_only_the_documents_it_keeps(tmp_path):
    src_file, _ = _tiny_model_and_test_set(tmp_path)
    src = Path(src_file).read_text().splitlines()
    cache = tmp_path / "cache"
    origlang = _wmt19_cache(cache, (src * 4)[:30])  # en, de, en
    env = {**os.environ, "SACREBLEU": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mt.evaluate", "-m", str(tmp_path / "m.pt"), "-t", "wmt19", "-l",
         "en-de", "--origlang", "en", "--beam", "1", "--max-len-b", "3", "--output",
         str(tmp_path / "{test}.out"), "--json"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    (test,) = json.loads(proc.stdout)["tests"]
    assert test["sentences"] == origlang.count("en") == 20
    assert len((tmp_path / "wmt19.out").read_text().splitlines()) == 20
    # that output scores again as a --hyp file of the kept lines alone (or of all 30)
    again = subprocess.run(
        [sys.executable, "-m", "mt.evaluate", "--hyp", str(tmp_path / "wmt19.out"), "-t",
         "wmt19", "-l", "en-de", "--origlang", "en", "--json"], capture_output=True, text=True,
        env=env)
    assert again.returncode == 0, again.stderr
    assert (json.loads(again.stdout)["tests"][0]["systems"][0]["scores"]["bleu"]["score"]
            == test["systems"][0]["scores"]["bleu"]["score"])
    (cache / "wmt19" / "raw" / "sgm" / "newstest2019-ende-src.en.sgm").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "mt.evaluate", "--hyp", str(tmp_path / "wmt19.out"), "-t",
         "wmt19", "-l", "en-de", "--subset", "news"], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--subset news reads the documents' metadata from" in proc.stderr


def test_origlang_needs_a_sacrebleu_test_set(files):
    with pytest.raises(SystemExit, match="--origlang and --subset pick documents of sacrebleu"):
        main(["--hyp", files["good"], "--ref", files["ref"], "--origlang", "de"])


@pytest.mark.parametrize("two_refs", [False, True])
def test_sentence_scores_equal_the_sacrebleu_cli_line_by_line(files, capsys, two_refs):
    refs = [files["ref"], files["ref2"]] if two_refs else [files["ref"]]
    pattern = str(files["tmp"] / "scores" / "{test}.{n}.jsonl")
    result = _run(["--hyp", files["good"], files["bad"], "--ref", *refs, "--name", "t",
                   "-M", "bleu", "chrf", "ter", "--sentence-scores", pattern], capsys)
    written = [s["sentence_scores"] for s in result["tests"][0]["systems"]]
    assert written == [pattern.format(test="t", n=n) for n in (1, 2)]
    lines = Path(written[1]).read_text(encoding="utf-8").splitlines()
    signatures, rows = json.loads(lines[0])["signatures"], [json.loads(x) for x in lines[1:]]
    hyps = Path(files["bad"]).read_text(encoding="utf-8").splitlines()
    assert [r["line"] for r in rows] == list(range(1, 201))
    assert [r["hyp"] for r in rows] == hyps
    assert [r["refs"] for r in rows] == [list(x) for x in zip(
        *(Path(f).read_text(encoding="utf-8").splitlines() for f in refs), strict=True)]
    for name in ("bleu", "chrf", "ter"):
        out = subprocess.run([SACREBLEU, *refs, "-i", files["bad"], "-sl", "-m", name, "-w", "6"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        assert len(out) == 200
        theirs = [line.split(" = ", 1) for line in out]
        assert {sig.split("|", 1)[1] for sig, _ in theirs} == {signatures[name]}
        assert [r[name] for r in rows] == pytest.approx(
            [float(rest.split()[0]) for _, rest in theirs], abs=1e-5), name


def test_files_it_writes_never_overwrite_what_it_reads_or_each_other(files, caplog):
    hyp, ref, tmp = files["good"], files["ref"], files["tmp"]
    before = Path(hyp).read_text(), Path(ref).read_text()
    for extra, message in [
        (["--sentence-scores", hyp], "--sentence-scores .*good.hyp is the --hyp file"),
        (["--sentence-scores", ref], "--sentence-scores .*ref.de is the --ref file"),
        (["--json-out", str(tmp / "x.json"), "--sentence-scores", str(tmp / "x.json")],
         "--json-out .*x.json is also the --sentence-scores file"),
        (["--sentence-scores", "-"], "--sentence-scores -: it writes a file per system"),
        (["--sentence-scores", str(tmp)], "--sentence-scores .*: is a directory"),
    ]:
        with pytest.raises(SystemExit, match=f"^mt-eval: {message}"):
            main(["--hyp", hyp, "--ref", ref, "-q", *extra])
    assert (Path(hyp).read_text(), Path(ref).read_text()) == before
    # the checkpoints and the shortlist it loads, refused before they are read
    run = tmp / "run" / "checkpoints"
    run.mkdir(parents=True)
    (run / "best.pt").write_bytes(b"weights")
    (tmp / "list.pt").write_bytes(b"pieces")
    for extra, message in [
        (["-m", str(run / "best.pt"), "--output", str(run / "best.pt")], "--output .* the -m"),
        (["-m", f"{hyp},{tmp / 'run'}", "--json-out", str(run / "best.pt")], "--json-out .* -m"),
        (["-m", str(tmp / "run"), "--sentence-scores", str(run / "best.pt")],
         "--sentence-scores .*best.pt is the -m file"),
        (["-m", str(tmp / "run"), "--shortlist", str(tmp / "list.pt"), "--json-out",
          str(tmp / "list.pt")], "--json-out .*list.pt is the --shortlist file"),
    ]:
        with pytest.raises(SystemExit, match=f"^mt-eval: {message}"):
            main(["--src", ref, "--ref", ref, "-q", *extra])
    assert (run / "best.pt").read_bytes() == b"weights"
    assert (tmp / "list.pt").read_bytes() == b"pieces"
    with caplog.at_level(logging.WARNING, logger="mt.evaluate"):
        main(["--hyp", hyp, "--ref", ref, "--beam", "3", "--json-out", str(tmp / "r.json")])
    assert [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()] == [
        "--beam has no effect without -m (nothing is translated)"]


def test_a_reader_that_leaves_early_gets_no_traceback(files):
    """`mt-eval ... | head`: the pipe closes before the results are written."""
    proc = subprocess.Popen([sys.executable, "-m", "mt.evaluate", "--hyp", files["good"],
                             "--ref", files["ref"], "--json", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first byte
    err = proc.stderr.read().decode()
    assert proc.wait() == 1 and err == ""


def test_a_full_stdout_and_ctrl_c_are_one_line_each(files, monkeypatch, capsys):
    """`mt-eval ... > /dev/full` and Ctrl-C were tracebacks (translate had one line for each)."""
    import mt.evaluate

    with open(os.devnull if not os.path.exists("/dev/full") else "/dev/full", "wb") as full:
        proc = subprocess.run([sys.executable, "-m", "mt.evaluate", "--hyp", files["good"],
                               "--ref", files["ref"], "-q"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    if os.path.exists("/dev/full"):
        assert proc.returncode == 1
        assert proc.stderr == ("mt-eval: cannot write the results to stdout (No space left on "
                               "device)\n"), proc.stderr

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mt.evaluate, "run", interrupted)
    with pytest.raises(SystemExit) as exit_:
        main(["--hyp", files["good"], "--ref", files["ref"], "-q"])
    assert exit_.value.code == 130 and "mt-eval: interrupted" in capsys.readouterr().err


def test_output_pattern_must_separate_systems(files):
    with pytest.raises(SystemExit, match="several translations would go to one file"):
        main(["-m", "a.pt", "b.pt", "--src", files["ref"], "--ref", files["ref"],
              "--output", str(files["tmp"] / "out.txt")])


def _tiny_model_and_test_set(tmp_path: Path, tgt_lang: str = "de") -> tuple[str, str]:
    """A random 1+1 layer model saved as m.pt (trained for en-``tgt_lang``, as its config
    says), and a 12-line test set; returns (src, ref)."""
    import torch

    from mt.checkpoint import model_state, save_atomic
    from mt.config import ModelConfig, TokenizerConfig
    from mt.model import build_model
    from mt.tokenizer import train_tokenizer

    rng = random.Random(3)
    src = [_sentence(rng) for _ in range(300)]
    tok = train_tokenizer(src, [s.upper() for s in src],
                          TokenizerConfig(vocab_size=100, model_type="bpe"))
    torch.manual_seed(0)
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, d_model=32, ffn_dim=64, heads=2,
                      max_positions=64, src_vocab_size=tok.src_vocab_size,
                      tgt_vocab_size=tok.tgt_vocab_size)
    run_config = {"data": {"src_lang": "en", "tgt_lang": tgt_lang}}  # as mt-train records it
    save_atomic(model_state(build_model(cfg).eval(), tok, run_config), tmp_path / "m.pt")
    return (_write(tmp_path / "test.en", src[:12]),
            _write(tmp_path / "test.de", [s.upper() for s in src[:12]]))


def test_a_model_trained_for_the_other_direction_is_said(tmp_path, capsys, caplog):
    """An en-de model scored on a de-en test set gives BLEU near 0 and no other sign."""
    src_file, ref_file = _tiny_model_and_test_set(tmp_path)
    argv = ["-m", str(tmp_path / "m.pt"), "--src", src_file, "--ref", ref_file, "--beam", "1",
            "--max-len-b", "3"]
    with caplog.at_level("WARNING", logger="mt.evaluate"):
        _run([*argv, "--langpair", "en-de"], capsys)
    assert "trained for" not in caplog.text
    with caplog.at_level("WARNING", logger="mt.evaluate"):
        _run([*argv, "--langpair", "de-en"], capsys)
    assert "m.pt was trained for en-de, test set" in caplog.text and "is de-en" in caplog.text


def test_a_chinese_target_without_a_langpair_is_said(tmp_path, capsys, caplog):
    """mt-train scores an en-zh run's test set with sacrebleu's zh tokenizer; mt-eval -m on the
    same files without --langpair took 13a (a Chinese line one token, BLEU near 0) in silence."""
    src_file, ref_file = _tiny_model_and_test_set(tmp_path, tgt_lang="zh")
    argv = ["-m", str(tmp_path / "m.pt"), "--src", src_file, "--ref", ref_file, "--beam", "1",
            "--max-len-b", "3"]
    with caplog.at_level("WARNING", logger="mt.evaluate"):
        result = _run(argv, capsys)
    assert "tok:13a" in result["tests"][0]["systems"][0]["bleu_signature"]
    assert "m.pt was trained for zh targets" in caplog.text
    assert "pass --langpair en-zh" in caplog.text
    caplog.clear()
    for given in (["--langpair", "en-zh"], ["--tokenize", "13a"]):  # said, or chosen
        with caplog.at_level("WARNING", logger="mt.evaluate"):
            _run([*argv, *given], capsys)
        assert "trained for" not in caplog.text


# tokenizer_config.json's target_lang of OPUS-MT's multilingual models (opus-mt-en-ROMANCE,
# opus-mt-de-ZH, abridged), which mt-import records as data.tgt_lang
ROMANCE, ZH = "fr+fr_BE+fr_CA+es+es_AR+pt+pt_BR+it+ro+la", "cmn+cn+yue+ze_zh+zh_cn+zh_TW+zhs+zh"


def test_a_multilingual_opus_mt_side_is_each_of_its_languages(tmp_path, capsys, caplog):
    """An imported en-ROMANCE model scored on an en-fr test set was said to be 'trained for
    en-fr+fr_BE+..., check the direction'; an opus-mt-de-ZH model's BLEU took 13a (the list
    read whole is no language sacrebleu knows), which keeps a Chinese line as one token."""
    from mt.report import bleu_target, make_metric

    src_file, ref_file = _tiny_model_and_test_set(tmp_path, tgt_lang=ROMANCE)
    argv = ["-m", str(tmp_path / "m.pt"), "--src", src_file, "--ref", ref_file, "--beam", "1",
            "--max-len-b", "3"]
    for pair in ("en-fr", "en-pt"):
        with caplog.at_level("WARNING", logger="mt.evaluate"):
            _run([*argv, "--langpair", pair], capsys)
        assert "trained for" not in caplog.text, pair
    with caplog.at_level("WARNING", logger="mt.evaluate"):  # a language not in the list
        _run([*argv, "--langpair", "en-de"], capsys)
    assert f"m.pt was trained for en-{ROMANCE}, test set" in caplog.text
    assert bleu_target(ZH) == "zh" and bleu_target(ROMANCE) == ROMANCE
    assert bleu_target("zh+ja") == "zh+ja"  # two tokenizers: neither
    assert make_metric("bleu", trg_lang=ZH).tokenizer.signature() == "zh"


def test_a_language_group_side_is_not_checked_against_the_test_set(tmp_path, capsys, caplog):
    """A model imported with a group code (mt-import --tgt-lang roa; opus-mt-en-mul's
    tokenizer_config.json) was 'trained for en-roa, test set is en-fr: check the direction': a
    group's members are not known, so that side cannot be checked; the other side still is."""
    from mt.report import bleu_target, make_metric

    for tgt in ("roa", "mul", "ROMANCE", "gem", "zle+zlw"):
        src_file, ref_file = _tiny_model_and_test_set(tmp_path, tgt_lang=tgt)
        argv = ["-m", str(tmp_path / "m.pt"), "--src", src_file, "--ref", ref_file, "--beam",
                "1", "--max-len-b", "3"]
        caplog.clear()
        with caplog.at_level("WARNING", logger="mt.evaluate"):
            _run([*argv, "--langpair", "en-fr"], capsys)
            _run(argv, capsys)  # no langpair: 13a, and no Chinese target to warn of
        assert "trained for" not in caplog.text, tgt
        with caplog.at_level("WARNING", logger="mt.evaluate"):  # the source is still checked
            _run([*argv, "--langpair", "de-fr"], capsys)
        assert f"m.pt was trained for en-{tgt}, test set" in caplog.text, tgt
    assert bleu_target("mul") == "mul" and bleu_target("ROMANCE") == "ROMANCE"  # 13a
    assert make_metric("bleu", trg_lang="mul").tokenizer.signature() == "13a"
    assert bleu_target("zhx") == "zh" and bleu_target("jpx") == "ja"  # families of one script


def test_a_locale_in_capitals_is_one_language_not_a_group(tmp_path, caplog):
    """is_group read any capitals of four characters or more as an OPUS-MT group (ROMANCE), so a
    model for ZH_CN or PT_BR (mt-import --tgt-lang PT_BR) was never checked: scored on an en-fr
    test set, BLEU near 0 and no 'check the direction'."""
    from mt.evaluate_checks import check_direction, is_group

    assert all(map(is_group, ("ROMANCE", "NORTH_EU", "INSULAR_CELTIC", "SCANDINAVIA", "roa")))
    assert not any(map(is_group, ("ZH", "ZH_CN", "PT_BR", "SR_CYRL", "pt_BR", "zh-Hant")))
    for tgt in ("PT_BR", "ZH_CN"):
        src_file, ref_file = _tiny_model_and_test_set(tmp_path, tgt_lang=tgt)
        caplog.clear()
        with caplog.at_level("WARNING", logger="mt.evaluate"):
            check_direction([str(tmp_path / "m.pt")],
                            testsets.TestSet("t", [ref_file], src_file, "en-fr"), None)
        assert f"m.pt was trained for en-{tgt}, test set t is en-fr" in caplog.text, tgt


def test_a_region_or_script_of_the_models_language_is_that_language(tmp_path, caplog):
    """A model for zh-Hant (mt-import --tgt-lang zh-Hant, as its help shows), zh_CN, ZH or pt_BR
    scored on the en-zh or en-pt test set was told to check the direction: the codes were
    compared whole. The language is what the check asks; a wrong one is still said."""
    from mt.evaluate_checks import check_direction

    for tgt, right in (("zh-Hant", "en-zh"), ("zh_CN", "en-zh"), ("ZH", "en-zh"),
                       ("pt_BR", "en-pt"), ("fr+pt_BR", "en-pt"), ("pt", "en-pt_BR")):
        src_file, ref_file = _tiny_model_and_test_set(tmp_path, tgt_lang=tgt)
        for pair in (right, "en-fr" if "fr" not in tgt else "en-de", "pt-" + right[3:]):
            caplog.clear()
            with caplog.at_level("WARNING", logger="mt.evaluate"):
                check_direction([str(tmp_path / "m.pt")],
                                testsets.TestSet("t", [ref_file], src_file, pair), None)
            said = f"m.pt was trained for en-{tgt}, test set t is {pair}" in caplog.text
            assert said == (pair != right), (tgt, pair, caplog.text)


def test_each_test_set_is_checked_against_the_models_direction(tmp_path, capsys, caplog,
                                                                monkeypatch):
    """The direction was checked only on the test set the model was loaded for: an en-de model
    scored on an en-de and an en-fr set said nothing of the second."""
    src_file, ref_file = _tiny_model_and_test_set(tmp_path)
    conf = tmp_path / "testsets"
    conf.mkdir()
    for name, pair in (("same", "en-de"), ("other", "en-fr")):
        (conf / f"{name}.yaml").write_text(f"langpair: {pair}\nsrc: {src_file}\nref: {ref_file}\n")
    monkeypatch.setattr(testsets, "TESTSETS_DIR", conf)
    monkeypatch.setattr(testsets, "REPO_ROOT", tmp_path)
    with caplog.at_level("WARNING", logger="mt.evaluate"):
        _run(["-m", str(tmp_path / "m.pt"), "--test", "same", "other", "--beam", "1",
              "--max-len-b", "3"], capsys)
    assert "m.pt was trained for en-de, test set other is en-fr" in caplog.text, caplog.text
    assert "test set same" not in caplog.text


def test_an_empty_test_set_is_one_line_with_a_model_or_a_file(tmp_path):
    """A model translated the 0 lines of an empty test set, then sacrebleu's corpus_score failed
    on no sentences: an IndexError traceback."""
    _tiny_model_and_test_set(tmp_path)
    empty = _write(tmp_path / "empty.de", [])
    src = _write(tmp_path / "empty.en", [])
    for system in (["-m", str(tmp_path / "m.pt")], ["--hyp", empty]):
        with pytest.raises(SystemExit) as err:
            main([*system, "--src", src, "--ref", empty, "--beam", "1"])
        assert str(err.value) == (f"mt-eval: {empty}: no lines; a test set needs one reference "
                                  "line per sentence")


def test_out_of_memory_while_translating_is_one_line(tmp_path, monkeypatch):
    """The CPU allocator's RuntimeError under a memory limit was a traceback from the KV cache."""
    src_file, ref_file = _tiny_model_and_test_set(tmp_path)

    def translate(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 104857600 bytes.")

    monkeypatch.setattr(evaluate, "translate_test", translate)
    model = str(tmp_path / "m.pt")
    with pytest.raises(SystemExit) as err:
        main(["-m", model, "--src", src_file, "--ref", ref_file, "--batch-tokens", "300"])
    assert str(err.value) == (f"mt-eval: -m {model}, {ref_file}: out of memory: a smaller "
                              "--batch-tokens (now 300) or --beam (now 5), or fewer --workers")


def test_scores_that_are_not_numbers_while_translating_are_one_line(tmp_path):
    """A model whose activations overflow (finite weights): beam search finished nothing and the
    empty n-best lists were an IndexError traceback, after the model had loaded."""
    import torch

    src_file, ref_file = _tiny_model_and_test_set(tmp_path)
    model = str(tmp_path / "m.pt")
    state = torch.load(model, weights_only=False)
    for name, value in state["model"].items():
        if name.startswith("decoder_layers") and name.endswith(".ffn.fc2.weight"):
            value.fill_(1e38)
    torch.save(state, model)
    with pytest.raises(SystemExit) as err:
        main(["-m", model, "--src", src_file, "--ref", ref_file])
    assert str(err.value) == (f"mt-eval: -m {model}, {ref_file}: the model's scores are not "
                              "numbers (NaN): an activation overflowed; the model's weights are "
                              "likely damaged or diverged (huge values)")


def test_bfloat16_evaluation_scores_what_translate_writes(tmp_path, capsys):
    from mt.translate import main as translate_main

    src_file, ref_file = _tiny_model_and_test_set(tmp_path)
    model = str(tmp_path / "m.pt")
    out = _run(["-m", model, "--src", src_file, "--ref", ref_file, "--beam", "3", "--max-len-b",
                "5", "--dtype", "bfloat16", "--output", str(tmp_path / "eval.txt")], capsys)
    translate_main(["-m", model, "-i", src_file, "-o", str(tmp_path / "tr.txt"), "--beam", "3",
                    "--max-len-b", "5", "--dtype", "bfloat16", "--quiet"])
    system = out["tests"][0]["systems"][0]
    assert system["dtype"] == "bfloat16"
    assert (tmp_path / "eval.txt").read_text() == (tmp_path / "tr.txt").read_text()


@pytest.mark.parametrize("search", [["--sampling", "--epsilon", "0.02", "--seed", "4"],
                                    ["--beam", "4", "--mbr", "chrf", "--mbr-candidates", "4"],
                                    ["--sampling", "--mbr", "bleu", "--mbr-candidates", "5"]])
def test_evaluation_searches_as_translate_does(tmp_path, capsys, search):
    """mt-eval takes translate's search flags (one definition, mt.options) and scores exactly
    what translate writes with them; their mistakes are refused in the same words."""
    from mt.translate import main as translate_main

    src_file, ref_file = _tiny_model_and_test_set(tmp_path)
    model = str(tmp_path / "m.pt")
    out = _run(["-m", model, "--src", src_file, "--ref", ref_file, "--max-len-b", "5", *search,
                "--output", str(tmp_path / "eval.txt")], capsys)
    translate_main(["-m", model, "-i", src_file, "-o", str(tmp_path / "tr.txt"),
                    "--max-len-b", "5", *search, "--quiet"])
    assert (tmp_path / "eval.txt").read_text() == (tmp_path / "tr.txt").read_text()
    recorded = out["tests"][0]["systems"][0]["search"]
    assert (recorded["sampling"], recorded["mbr"]) == ("--sampling" in search,
                                                       "chrf" if "chrf" in search else
                                                       "bleu" if "bleu" in search else "")
    with pytest.raises(SystemExit, match="^mt-eval: --epsilon shapes the sampling"):
        evaluate.main(["-m", model, "--src", src_file, "--ref", ref_file, "--epsilon", "0.1"])
    with pytest.raises(SystemExit, match="^mt-eval: --beam must be at least 1, got 0"):
        evaluate.main(["-m", model, "--src", src_file, "--ref", ref_file, "--beam", "0"])


def test_model_translates_and_reports_speed(tmp_path, capsys):
    src_file, ref_file = _tiny_model_and_test_set(tmp_path)
    out = _run(["-m", str(tmp_path / "m.pt"), "--src", src_file, "--ref", ref_file, "--beam", "2",
                "--max-len-b", "5", "--output", str(tmp_path / "hyp.{n}.txt"),
                "--json-out", str(tmp_path / "r.json")], capsys)
    system = out["tests"][0]["systems"][0]
    assert system["kind"] == "model" and system["model"] == str(tmp_path / "m.pt")
    blob = json.dumps(system["model_config"], sort_keys=True).encode()
    assert system["config_hash"] == hashlib.sha256(blob).hexdigest()[:12]
    assert system["decode_seconds"] > 0 and system["tokens_per_second"] >= 0
    assert system["tokens_per_second"] == pytest.approx(
        system["hyp_tokens"] / system["decode_seconds"])
    assert system["search"]["beam"] == 2
    hyps = Path(system["hypotheses"]).read_text().splitlines()
    assert system["hypotheses"] == str(tmp_path / "hyp.1.txt") and len(hyps) == 12
    ref = Path(ref_file).read_text().splitlines()
    assert system["scores"]["bleu"]["score"] == pytest.approx(evaluate.score(hyps, ref)["bleu"])
    assert json.loads((tmp_path / "r.json").read_text())["tests"] == out["tests"]


def test_comma_separated_models_are_one_ensemble_system(tmp_path, capsys):
    """-m a.pt,b.pt scores the ensemble that `translate -m a.pt b.pt` writes, as one system."""
    import torch

    from mt.checkpoint import load_model, model_state, save_atomic
    from mt.translate import main as translate_main

    src_file, ref_file = _tiny_model_and_test_set(tmp_path)
    model, tok, _ = load_model(str(tmp_path / "m.pt"), "cpu")
    torch.manual_seed(1)
    model.reset_parameters()  # a second member with other weights
    save_atomic(model_state(model, tok, None), tmp_path / "m2.pt")
    a, b = str(tmp_path / "m.pt"), str(tmp_path / "m2.pt")
    out = _run(["-m", f"{a},{b}", a, "--src", src_file, "--ref", ref_file, "--beam", "3",
                "--max-len-b", "5", "--output", str(tmp_path / "eval.{n}.txt")], capsys)
    translate_main(["-m", a, b, "-i", src_file, "-o", str(tmp_path / "tr.txt"), "--beam", "3",
                    "--max-len-b", "5", "--quiet"])
    ensemble, single = out["tests"][0]["systems"]
    assert ensemble["model"] == f"{a},{b}" and len(ensemble["model_config"]) == 2
    assert (tmp_path / "eval.1.txt").read_text() == (tmp_path / "tr.txt").read_text()
    assert (tmp_path / "eval.1.txt").read_text() != (tmp_path / "eval.2.txt").read_text()
    # --weights: the members' shares, as translate --weights gives them
    out = _run(["-m", f"{a},{b}", "--src", src_file, "--ref", ref_file, "--beam", "3",
                "--max-len-b", "5", "--weights", "3", "1", "--output",
                str(tmp_path / "weighted.txt")], capsys)
    translate_main(["-m", a, b, "--weights", "3", "1", "-i", src_file, "-o",
                    str(tmp_path / "tr31.txt"), "--beam", "3", "--max-len-b", "5", "--quiet"])
    assert (tmp_path / "weighted.txt").read_text() == (tmp_path / "tr31.txt").read_text()
    assert out["tests"][0]["systems"][0]["weights"] == [3.0, 1.0]
    for systems, weights, message in (
            ([f"{a},{b}"], ["1", "2", "3"], f"3 weights for the 2 members of -m {a},{b}"),
            ([a], ["1", "2"], "no -m system here is one"),
            # refused before any work: -m a would translate the test set first
            ([a, f"{a},{b}"], ["1", "-1"], "--weights must be above 0 and finite")):
        with pytest.raises(SystemExit, match=message):
            main(["-m", *systems, "--src", src_file, "--ref", ref_file, "--weights", *weights])


def test_a_failed_output_write_keeps_the_file_that_was_there(tmp_path):
    """mt-eval --output wrote in place: a full disk left a cut file under the name, and the
    complete one that had been there was gone."""
    from mt.evaluate import EvalError, _write

    out = tmp_path / "hyp.txt"
    out.write_text("one\ntwo\n")

    def lines():
        yield "uno\n"
        raise OSError(28, "No space left on device")

    with pytest.raises(EvalError, match=f"--output {out}: cannot write \\(No space left"):
        _write("--output", str(out), lines())
    assert out.read_text() == "one\ntwo\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hyp.txt"]


def test_hypotheses_from_stdin(files, capsys, monkeypatch):
    """`translate ... | mt-eval --hyp - --ref REF` scores the pipe as sacrebleu reads its stdin
    (it was '-: no such file'); stdin read twice would be empty the second time, so a second
    '-' is refused, and a short pipe is named as stdin."""
    text = Path(files["good"]).read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    piped = _run(["--hyp", "-", "--ref", files["ref"], "-M", "bleu", "chrf", "ter"], capsys)
    cli = _cli([files["ref"]], files["good"], "-m", "bleu", "chrf", "ter")
    scores = piped["tests"][0]["systems"][0]["scores"]
    assert [round(s["score"], 4) for s in scores.values()] == [c["score"] for c in cli]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    with pytest.raises(SystemExit, match=r"- \(stdin\) is given more than once"):
        main(["--hyp", "-", "--ref", "-"])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text[: len(text) // 2])))
    with pytest.raises(SystemExit, match=r"<stdin> has \d+ lines but .*ref.de has 200 lines"):
        main(["--hyp", "-", "--ref", files["ref"]])


@pytest.mark.parametrize("flag,path", [("--json-out", "-"), ("--json-out", "/dev/stdout"),
                                       ("--sentence-scores", "/dev/stdout")])
def test_stdout_is_no_output_file(files, capsys, flag, path):
    """stdout carries the table: a JSON object or sentence scores written there too made stdout
    two documents in one (`--json-out -` gave the JSON, then the table), which no reader parses."""
    with pytest.raises(SystemExit, match=f"{flag} {path}: stdout carries the results"):
        main(["--hyp", files["good"], "--ref", files["ref"], flag, path])
    assert capsys.readouterr().out == ""


def test_test_placeholder_of_an_unnamed_src_ref_set_is_its_reference_path():
    """docs/evaluation.md said nothing of what {test} becomes for --src/--ref without --name:
    the first --ref path as given, / as _ (the examples there); --name replaces it."""
    from mt.evaluate_args import build_parser
    from mt.evaluate_checks import expand
    from mt.testsets import collect_tests

    parser = build_parser()
    for given, path in ((["--ref", "data/test.de"], "out/data_test.de.hyp"),
                        (["--ref", "/data/test.de"], "out/_data_test.de.hyp"),
                        (["--ref", "/data/test.de", "--name", "dev"], "out/dev.hyp")):
        (test,) = collect_tests(parser.parse_args(["--hyp", "h.de", *given]))
        assert expand("out/{test}.hyp", test, 1) == path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text()
    assert "`--output 'out/{test}.hyp'` writes `out/data_test.de.hyp`" in " ".join(docs.split())
