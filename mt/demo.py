"""The embedded demo corpus: English -> Zetan, a small invented language with a real grammar.

The toolkit needs a default corpus that ships without a download, trains in minutes on a CPU and
still exercises what translation models must learn. Copying or word-for-word substitution would
be too easy, so Zetan differs from English in the ways real languages do:

- Word order is SOV: subject, postpositional phrase, object, adverb, (negation), verb. Adjectives
  follow the noun (in mirror order); prepositions become postpositions after their noun phrase.
- Every noun has one of three genders (a/e/o, drawn at random). The article agrees with the noun
  in gender, number and definiteness: definite ``l`` + gender vowel, indefinite ``y`` + gender
  vowel, plus ``n`` in the plural (``la``, ``yen``, ``lon``...). Adjectives take the same vowel,
  ``n`` in the plural and ``s`` when definite. Plural nouns take ``-i``, ``-en`` or ``-u``.
- The object is marked by the particle ``ke``; ``nu`` negates the verb, ``ku`` ends a yes/no
  question. Verbs add a tense suffix (present none, past ``-et``, future ``-is``) and a subject
  agreement suffix (I ``-u``, you ``-e``, he/she/it ``-a``, we ``-un``, they ``-an``).

One pair, with a word-by-word gloss of the Zetan side::

    The two old dogs did not see a red ball in the garden.
    Len dofod molen rehutens le rad sugobop yo gosefel deko ke nu divepetan.
    the.PL two dog-PL old-PL.DEF | the garden in | a ball red ACC | not see-PAST-3PL

English stays grammatical: a/an, regular and irregular plurals (child/children), third person -s
(watches, carries), irregular pasts (saw, bought), do-support in negations and questions. Target
stems (1-3 syllables of lowercase ASCII) are drawn once from a fixed seed, so the language is the
same for every corpus; the corpus seed only changes which sentences are drawn. Only
``random.Random`` with integer seeds is used (never set order), so output is byte-identical across
Python versions (3.10+).
"""

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from mt import described
from mt.config import positive_int
from mt.textio import blank_name_mistake, replace_file

SRC_LANG = "en"
TGT_LANG = "zz"
VERSION = "zetan-1"  # bump whenever the output for a given seed changes
LEXICON_SEED = 20240601

# English lexicon; "base:form" gives an irregular plural (nouns) or past tense (verbs).
NOUNS = """
dog cat horse cow pig goat bird duck goose:geese mouse:mice rabbit fox wolf:wolves bear lion tiger
monkey elephant snake frog owl eagle spider bee ant donkey camel zebra turtle whale dolphin parrot
man:men woman:women child:children person:people boy girl baby teacher doctor farmer king queen
soldier student baker driver sailor nurse artist thief:thieves friend uncle aunt cousin
book pen box cup bottle hat shoe coat key knife:knives spoon plate table chair bed lamp clock ball
kite drum guitar basket bag ring candle mirror bucket rope ladder wheel umbrella apple banana egg
onion tomato potato carrot cake cookie sandwich house car boat train bus bridge tower garden forest
river mountain island village city road window door wall tree flower leaf:leaves stone shell cloud
star letter picture map coin flag gift tooth:teeth foot:feet
""".split()
# Adjectives by kind, in English order (opinion, size, age/shape/texture, colour/material).
ADJ_GROUPS = [
    """beautiful ugly pretty strange famous kind brave clever lazy busy angry hungry tired
    happy sad proud shy calm polite silly wise friendly gentle wild noisy quiet dirty
    expensive""".split(),
    "big small huge tiny tall short long heavy thin thick".split(),
    "old young new ancient fresh round square sharp soft hard warm cold hot wet dry empty".split(),
    "red blue green black white yellow brown orange purple golden silver wooden".split(),
]
ADJECTIVES = [a for group in ADJ_GROUPS for a in group]
TRANSITIVE = """
see:saw watch find:found follow help carry hold:held like love hate want need take:took
bring:brought buy:bought sell:sold build:built break:broke clean cook draw:drew paint eat:ate
drink:drank write:wrote open close push pull wash fix catch:caught throw:threw kick visit call
meet:met hear:heard know:knew remember forget:forgot choose:chose hide:hid keep:kept feed:fed touch
teach:taught chase lift move miss greet pay:paid borrow protect
""".split()
INTRANSITIVE = """
sleep:slept run:ran swim:swam sing:sang dance laugh cry wait sit:sat jump work play smile rest
fall:fell shout
""".split()
ADVERBS = """quickly slowly quietly loudly carefully happily sadly gladly easily gently calmly badly
often sometimes again together""".split()
PREPOSITIONS = "in on under near behind beside with without from above below for".split()
NUMBERS = "one two three four five six seven eight nine ten".split()
PRONOUNS = {  # subject form: (object form, person, plural)
    "I": ("me", 1, False),
    "you": ("you", 2, False),
    "he": ("him", 3, False),
    "she": ("her", 3, False),
    "it": ("it", 3, False),
    "we": ("us", 1, True),
    "they": ("them", 3, True),
}


def _split_forms(tokens: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separates "base:irregular" tokens into the lemma list and an irregular-form table."""
    parts = [token.partition(":") for token in tokens]
    return [base for base, _, _ in parts], {base: form for base, _, form in parts if form}


NOUNS, IRREGULAR_PLURAL = _split_forms(NOUNS)
TRANSITIVE, IRREGULAR_PAST = _split_forms(TRANSITIVE)
INTRANSITIVE, _past_intransitive = _split_forms(INTRANSITIVE)
IRREGULAR_PAST.update(_past_intransitive)
VERBS = TRANSITIVE + INTRANSITIVE

# Zetan function words and suffixes (see the module docstring).
GENDER_VOWELS = "aeo"
NOUN_PLURAL = ("i", "en", "u")
TENSE_SUFFIX = {"present": "", "past": "et", "future": "is"}
AGREEMENT = {(1, False): "u", (2, False): "e", (3, False): "a", (1, True): "un", (3, True): "an"}
ACCUSATIVE, NEGATION, QUESTION = "ke", "nu", "ku"
FUNCTION_WORDS = [d + v + n for d in "ly" for v in GENDER_VOWELS for n in ("", "n")]
FUNCTION_WORDS += [ACCUSATIVE, NEGATION, QUESTION]

# Stems end in a consonant that no suffix ends in, so an inflected form never equals another stem.
_ONSETS = "bdfghkmprstvz"
_VOWELS = "aeiou"
_CODAS = "bdgklmprtv"


def _make_lexicon() -> tuple[dict[str, str], dict[str, int]]:
    """Draws one unique stem per English lemma and a gender per noun, from a fixed seed."""
    rng = random.Random(LEXICON_SEED)
    lemmas = NOUNS + ADJECTIVES + VERBS + ADVERBS + PREPOSITIONS + NUMBERS + list(PRONOUNS)
    if len(set(lemmas)) != len(lemmas):
        raise AssertionError("an English lemma is listed twice")
    english = lemmas + [forms[0] for forms in PRONOUNS.values()]
    taken = set(FUNCTION_WORDS) | {word.lower() for word in english}  # no Zetan "him" for "she"
    lexicon = {}
    for lemma in lemmas:
        while True:
            syllables = rng.choices((1, 2, 3), weights=(2, 5, 3))[0]
            stem = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
            stem += rng.choice(_CODAS)
            if stem not in taken:
                break
        taken.add(stem)
        lexicon[lemma] = stem
    return lexicon, {noun: rng.randrange(3) for noun in NOUNS}


LEXICON, GENDER = _make_lexicon()


@dataclass(frozen=True)
class NP:
    """A noun phrase: a noun lemma with its modifiers, or a pronoun (subject form, e.g. "they")."""

    noun: str
    plural: bool = False
    definite: bool = True
    number: str | None = None  # "one".."ten"; "one" only with a singular indefinite
    adjs: tuple[str, ...] = ()  # in English order


@dataclass(frozen=True)
class Clause:
    """One sentence, language-neutral, so both sides are rendered from the same meaning."""

    subject: NP
    verb: str
    obj: NP | None = None
    prep: str | None = None
    pobj: NP | None = None  # the noun phrase governed by ``prep``
    adverb: str | None = None
    tense: str = "present"  # present | past | future
    negated: bool = False
    question: bool = False


def _add_s(word: str) -> str:
    """English -s for plural nouns and third-person verbs: boxes, cities, plays, tomatoes."""
    if word.endswith(("s", "x", "z", "ch", "sh", "o")):
        return word + "es"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def _past(verb: str) -> str:
    if verb in IRREGULAR_PAST:
        return IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _en_np(np: NP, as_object: bool = False) -> list[str]:
    if np.noun in PRONOUNS:
        return [PRONOUNS[np.noun][0] if as_object else np.noun]
    noun = (IRREGULAR_PLURAL.get(np.noun) or _add_s(np.noun)) if np.plural else np.noun
    words = ["the"] if np.definite else [] if np.number else ["some" if np.plural else "a"]
    words += ([np.number] if np.number else []) + list(np.adjs) + [noun]
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return words


def _zz_np(np: NP) -> list[str]:
    if np.noun in PRONOUNS:
        return [LEXICON[np.noun]]
    gender = GENDER[np.noun]
    vowel, plural = GENDER_VOWELS[gender], "n" if np.plural else ""
    words = [("l" if np.definite else "y") + vowel + plural]
    words += [LEXICON[np.number]] if np.number else []
    words.append(LEXICON[np.noun] + (NOUN_PLURAL[gender] if np.plural else ""))
    ending = vowel + plural + ("s" if np.definite else "")
    return words + [LEXICON[adj] + ending for adj in reversed(np.adjs)]


def _sentence(words: list[str], question: bool) -> str:
    text = " ".join(words)
    return text[0].upper() + text[1:] + ("?" if question else ".")


def render(c: Clause) -> tuple[str, str]:
    """Renders one clause as an (English, Zetan) pair; the single source of truth for both sides."""
    s = c.subject
    person, plural = PRONOUNS[s.noun][1:] if s.noun in PRONOUNS else (3, s.plural)
    third_singular = person == 3 and not plural
    if c.tense == "future":
        aux, verb = "will", c.verb
    elif c.negated or c.question:  # do-support
        aux, verb = ("did" if c.tense == "past" else "does" if third_singular else "do"), c.verb
    else:
        aux = None
        verb = _past(c.verb) if c.tense == "past" else _add_s(c.verb) if third_singular else c.verb
    subject = _en_np(c.subject)
    if c.question:
        en = [aux, *subject, verb]
    else:
        en = subject + ([aux] if aux else []) + (["not"] if c.negated else []) + [verb]
    en += _en_np(c.obj, as_object=True) if c.obj else []
    en += [c.adverb] if c.adverb else []
    en += [c.prep, *_en_np(c.pobj, as_object=True)] if c.prep else []

    zz = _zz_np(c.subject)
    zz += _zz_np(c.pobj) + [LEXICON[c.prep]] if c.prep else []
    zz += _zz_np(c.obj) + [ACCUSATIVE] if c.obj else []
    zz += [LEXICON[c.adverb]] if c.adverb else []
    zz += [NEGATION] if c.negated else []
    zz.append(LEXICON[c.verb] + TENSE_SUFFIX[c.tense] + AGREEMENT[(person, plural)])
    zz += [QUESTION] if c.question else []
    return _sentence(en, c.question), _sentence(zz, c.question)


def _random_np(rng: random.Random, pronoun_p: float, avoid: str | None = None) -> NP:
    if rng.random() < pronoun_p:
        pronoun = rng.choice([p for p in PRONOUNS if p != avoid])
        return NP(pronoun, plural=PRONOUNS[pronoun][2])
    definite, plural = rng.random() < 0.5, rng.random() < 0.35
    number = None
    if plural and rng.random() < 0.3:
        number = rng.choice(NUMBERS[1:])
    elif not plural and not definite and rng.random() < 0.1:
        number = "one"
    n_adjs = rng.choices((0, 1, 2), weights=(50, 35, 15))[0]
    groups = sorted(rng.sample(range(len(ADJ_GROUPS)), n_adjs))  # two adjectives of different kinds
    adjs = tuple(rng.choice(ADJ_GROUPS[g]) for g in groups)
    return NP(rng.choice(NOUNS), plural, definite, number, adjs)


def _random_clause(rng: random.Random) -> Clause:
    subject = _random_np(rng, pronoun_p=0.3)
    transitive = rng.random() < 0.75
    verb = rng.choice(TRANSITIVE if transitive else INTRANSITIVE)
    avoid = subject.noun if subject.noun in PRONOUNS else None  # no "I see me"
    obj = _random_np(rng, pronoun_p=0.15, avoid=avoid) if transitive else None
    prep = rng.choice(PREPOSITIONS) if rng.random() < 0.35 else None
    pobj = _random_np(rng, pronoun_p=0.1) if prep else None
    adverb = rng.choice(ADVERBS) if rng.random() < 0.3 else None
    tense = rng.choices(("present", "past", "future"), weights=(45, 30, 25))[0]
    question = rng.random() < 0.15
    negated = not question and rng.random() < 0.25
    return Clause(subject, verb, obj, prep, pobj, adverb, tense, negated, question)


def generate_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n unique (english, target) pairs, deterministic for a seed.

    Sentences are drawn until n distinct English sides are found, so the first k pairs for a seed
    are the same whatever n is, and any split of the list has no source sentence in common.
    Sentences outside 4-18 English words are redrawn to keep lengths in a useful range.

    Args:
        n: How many pairs to return.
        seed: Seed of the sentence sampler (the lexicon itself is fixed).

    Returns:
        A list of n (English, Zetan) sentence pairs.
    """
    rng = random.Random(seed)
    pairs: dict[str, str] = {}
    for _ in range(100 * n + 1000):  # the space is huge; the bound only guards against a bug
        if len(pairs) >= n:
            break
        en, zz = render(_random_clause(rng))
        if 4 <= en.count(" ") + 1 <= 18:
            pairs.setdefault(en, zz)
    if len(pairs) < n:
        raise ValueError(f"could only generate {len(pairs)} unique pairs, not {n}")
    return list(pairs.items())


def write_demo_corpus(
    out_dir: str | os.PathLike,
    n_train: int = 12000,
    n_valid: int = 500,
    n_test: int = 500,
    seed: int = 1234,
) -> dict[str, int]:
    """Writes {train,valid,test}.{en,zz} (UTF-8, one sentence per line, LF, final newline).

    Idempotent and cheap to call on every run: a ``MANIFEST`` records the generator version, the
    seed, the counts and each file's size; when it matches, nothing is generated or rewritten, so
    file modification times (and caches keyed on them) stay valid. Files are replaced atomically
    and the manifest is written last, so an interrupted write is redone on the next call. A
    folder that holds a file of the corpus's names but no manifest is someone's data: refused.

    Args:
        out_dir: Directory to write into (created if needed).
        n_train: Number of training pairs.
        n_valid: Number of validation pairs.
        n_test: Number of test pairs.
        seed: Seed of the sentence sampler.

    Returns:
        The line count of each split, e.g. ``{"train": 12000, "valid": 500, "test": 500}``.
    """
    out = Path(out_dir)
    counts = {"train": n_train, "valid": n_valid, "test": n_test}
    names = [f"{split}.{lang}" for split in counts for lang in (SRC_LANG, TGT_LANG)]
    manifest_path = out / "MANIFEST"
    wanted = {"version": VERSION, "seed": seed, "counts": counts}
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        sizes = manifest.pop("sizes")
        if manifest == wanted and all((out / f).stat().st_size == sizes[f] for f in names):
            return dict(counts)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # missing, stale or unreadable: regenerate

    if not _ours(manifest_path) and (theirs := [f for f in names if (out / f).exists()]):
        raise ValueError(f"{out / theirs[0]}: not the demo corpus's (no demo MANIFEST beside "
                         "it), so not overwritten: data=demo writes its corpus into data.dir; "
                         "give an empty or new folder (or delete the folder if it is a demo "
                         "corpus an older mt left half-written)")
    out.mkdir(parents=True, exist_ok=True)
    # Ours from here on, even if the write is interrupted: no sizes, so the next call redoes it.
    replace_file(manifest_path, b'{"writing": true}\n')
    pairs = generate_pairs(sum(counts.values()), seed)
    sizes, start = {}, 0
    for split, n in counts.items():
        chunk, start = pairs[start : start + n], start + n
        for lang, side in ((SRC_LANG, 0), (TGT_LANG, 1)):
            name = f"{split}.{lang}"
            sizes[name] = _write_if_changed(out / name, "".join(p[side] + "\n" for p in chunk))
    _write_if_changed(manifest_path, json.dumps({**wanted, "sizes": sizes}, indent=1) + "\n")
    return dict(counts)


def _ours(manifest: Path) -> bool:
    """Whether ``manifest`` is a demo corpus's: JSON with its keys, not any file of that name
    (a common one in data folders)."""
    try:
        said = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(said, dict) and ("writing" in said or {"version", "seed"} <= said.keys())


def _write_if_changed(path: Path, text: str) -> int:
    """Atomically writes text unless the file already holds exactly it; returns the byte size."""
    data = text.encode("utf-8")
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return len(data)
    replace_file(path, data)
    return len(data)


def main(argv: list[str] | None = None) -> None:
    """``python -m mt.demo DIR``: writes the demo corpus into DIR and prints the line counts."""
    # the prog as it is run: argparse's default was "demo.py", a command that does not exist
    parser = argparse.ArgumentParser(prog="python -m mt.demo", description=described(__doc__))
    parser.add_argument("out_dir", help="directory for {train,valid,test}.{en,zz}")
    # at least 1: a negative count shifted the other splits' slices and every file came out empty
    parser.add_argument("--train", type=positive_int, default=12000, help="training pairs")
    parser.add_argument("--valid", type=positive_int, default=500, help="validation pairs")
    parser.add_argument("--test", type=positive_int, default=500, help="test pairs")
    parser.add_argument("--seed", type=int, default=1234, help="sentence sampler seed")
    args = parser.parse_args(argv)
    # an empty name ("$UNSET") is the working directory: seven files scattered there
    if blank := blank_name_mistake("out_dir", args.out_dir, "directory"):
        parser.error(blank)
    try:
        counts = write_demo_corpus(args.out_dir, args.train, args.valid, args.test, args.seed)
    except OSError as err:  # a file in the way, a folder that cannot be written: a traceback
        parser.exit(1, f"{parser.prog}: {err.filename or args.out_dir}: "
                       f"{err.strerror or err}\n")
    except ValueError as err:  # a folder of someone else's data
        parser.exit(1, f"{parser.prog}: {err}\n")
    for split, n in counts.items():
        print(f"{split}\t{n}")


if __name__ == "__main__":
    main()
