"""The demo corpus must be deterministic, disjoint across splits and a real translation problem."""

import re

import pytest

import mt.demo
from mt.demo import (
    LEXICON,
    NP,
    SRC_LANG,
    TGT_LANG,
    Clause,
    generate_pairs,
    render,
    write_demo_corpus,
)


def _words(sentence: str) -> list[str]:
    return sentence.rstrip(".?").split()


def test_deterministic_and_seed_dependent():
    pairs = generate_pairs(300, seed=7)
    assert pairs == generate_pairs(300, seed=7)
    assert pairs != generate_pairs(300, seed=8)
    assert len({en for en, _ in pairs}) == 300
    assert generate_pairs(100, seed=7) == pairs[:100]  # a prefix does not depend on n


def test_splits_disjoint_sizes_and_idempotent(tmp_path):
    counts = write_demo_corpus(tmp_path, n_train=1500, n_valid=100, n_test=120, seed=3)
    assert counts == {"train": 1500, "valid": 100, "test": 120}
    sources = {}
    for split, n in counts.items():
        for lang in (SRC_LANG, TGT_LANG):
            data = (tmp_path / f"{split}.{lang}").read_bytes()
            assert data.endswith(b"\n") and b"\r" not in data
            assert len(data.decode("utf-8").splitlines()) == n
        sources[split] = set((tmp_path / f"{split}.{SRC_LANG}").read_text().splitlines())
        assert len(sources[split]) == n
    assert not sources["train"] & sources["valid"]
    assert not sources["train"] & sources["test"]
    assert not sources["valid"] & sources["test"]

    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.iterdir()}
    assert write_demo_corpus(tmp_path, n_train=1500, n_valid=100, n_test=120, seed=3) == counts
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.iterdir()}
    assert after == before  # nothing rewritten


def test_a_folder_of_someone_elses_data_is_not_overwritten(tmp_path):
    """data=demo writes into data.dir; a user's own train.en there (the run in cwd by an empty
    hydra.run.dir, or data.dir given) was replaced by the generated corpus without a word."""
    (tmp_path / "train.en").write_text("mine\n")
    with pytest.raises(ValueError, match=r"train\.en: not the demo corpus's .* not overwritten"):
        write_demo_corpus(tmp_path, n_train=50, n_valid=5, n_test=5)
    assert (tmp_path / "train.en").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.en"]
    (tmp_path / "MANIFEST").write_text("a list of the corpus's files\n")  # not the demo's
    with pytest.raises(ValueError, match="not overwritten"):
        write_demo_corpus(tmp_path, n_train=50, n_valid=5, n_test=5)
    assert (tmp_path / "train.en").read_text() == "mine\n"


@pytest.mark.parametrize("flag", ["--train", "--valid", "--test"])
def test_a_split_size_below_one_is_refused_by_the_command(tmp_path, flag, capsys):
    """``python -m mt.demo DIR --train -5`` wrote empty files for every split (the negative
    count shifted the others' slices) and printed "train -5" as if that were done."""
    with pytest.raises(SystemExit) as stop:
        mt.demo.main([str(tmp_path / "d"), flag, "-5"])
    assert stop.value.code == 2 and "must be at least 1, got -5" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_the_command_says_a_folder_it_cannot_write_in_one_line(tmp_path, capsys):
    """A file in the way, or someone else's data, was a traceback (FileExistsError,
    NotADirectoryError, ValueError)."""
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "train.en").write_text("mine\n")
    for given, said in [("afile", "afile: File exists"), ("afile/sub", "afile/sub: Not a "
                         "directory"), ("theirs", "train.en: not the demo corpus's")]:
        with pytest.raises(SystemExit) as stop:
            mt.demo.main([str(tmp_path / given), "--train", "5", "--valid", "1", "--test", "1"])
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.startswith("python -m mt.demo: "), err
        assert said in err and len(err.splitlines()) == 1, err


def test_an_empty_folder_name_is_refused(tmp_path, capsys, monkeypatch):
    """``python -m mt.demo "$UNSET"`` wrote the corpus's seven files into the working
    directory, among whatever was there."""
    monkeypatch.chdir(tmp_path)
    for given in ("", "  "):
        with pytest.raises(SystemExit) as stop:
            mt.demo.main([given, "--train", "5", "--valid", "1", "--test", "1"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "out_dir" in err and "name the directory" in err, err
    assert not list(tmp_path.iterdir())


def test_an_interrupted_write_is_redone(tmp_path, monkeypatch):
    """The folder is the demo's from its first write on: files half written, then a rerun."""
    from mt import demo

    real, calls = demo.replace_file, []

    def dies_on_the_third(path, data):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(demo, "replace_file", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        write_demo_corpus(tmp_path, n_train=50, n_valid=5, n_test=5)
    monkeypatch.setattr(demo, "replace_file", real)
    assert write_demo_corpus(tmp_path, n_train=50, n_valid=5, n_test=5)["train"] == 50
    assert len((tmp_path / "test.zz").read_text().splitlines()) == 5


def test_word_order_is_not_copied():
    en, zz = render(Clause(NP("dog", adjs=("big",)), "see", obj=NP("cat", definite=False)))
    assert en == "The big dog sees a cat."
    assert zz[0].isupper() and zz.endswith(".")
    words = _words(zz.lower())
    assert words[-1].startswith(LEXICON["see"])  # SOV: the verb ends the clause
    noun = next(i for i, w in enumerate(words) if w.startswith(LEXICON["dog"]))
    adj = next(i for i, w in enumerate(words) if w.startswith(LEXICON["big"]))
    assert noun < adj  # adjectives follow the noun
    # Prepositions become postpositions after their noun phrase.
    _, zz = render(Clause(NP("I"), "sleep", prep="under", pobj=NP("table")))
    words = _words(zz.lower())
    assert words.index(LEXICON["under"]) > words.index(LEXICON["table"])


def test_agreement():
    singular = _words(render(Clause(NP("dog"), "sleep"))[1].lower())
    plural = _words(render(Clause(NP("dog", plural=True), "sleep"))[1].lower())
    assert singular[:2] != plural[:2]  # article and noun both inflect for number
    assert singular[-1] != plural[-1]  # and so does the verb
    assert render(Clause(NP("child", plural=True), "watch"))[0] == "The children watch."

    verb_i = _words(render(Clause(NP("I"), "see", obj=NP("cat")))[1])[-1]
    verb_they = _words(render(Clause(NP("they"), "see", obj=NP("cat")))[1])[-1]
    assert verb_i != verb_they and verb_i.startswith(LEXICON["see"])

    en, zz = render(Clause(NP("she"), "carry", obj=NP("apple", definite=False), tense="past"))
    assert en == "She carried an apple."
    en, zz = render(Clause(NP("he"), "watch", obj=NP("I"), negated=True))
    assert en == "He does not watch me."
    en, zz = render(Clause(NP("they"), "eat", tense="future", question=True))
    assert en == "Will they eat?" and zz.endswith("?")


def test_vocabulary_size():
    pairs = generate_pairs(12000, seed=1234)
    en_types = {w for en, _ in pairs for w in re.findall(r"[a-z]+", en.lower())}
    zz_types = {w for _, zz in pairs for w in re.findall(r"[a-z]+", zz.lower())}
    assert len(en_types) >= 300
    assert len(zz_types) >= 300
    assert all(re.fullmatch(r"[A-Z][a-z ]*[.?]", zz) for _, zz in pairs)
    assert all(4 <= len(en.split()) <= 18 for en, _ in pairs)


def test_module_docstring_example_is_current():
    clause = Clause(
        NP("dog", plural=True, number="two", adjs=("old",)),
        "see",
        obj=NP("ball", definite=False, adjs=("red",)),
        prep="in",
        pobj=NP("garden"),
        tense="past",
        negated=True,
    )
    en, zz = render(clause)
    assert f"    {en}\n    {zz}\n" in mt.demo.__doc__
