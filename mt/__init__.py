"""mt: neural machine translation with a readable Transformer.

The package follows the path from raw text to BLEU, one module per stage:
``tokenizer`` -> ``data`` (read corpora) -> ``batching`` (encode, filter, token batches) ->
``corpus`` (the training corpus, tokenized and cached) -> ``model`` -> ``search`` -> ``train``
(the command line; ``hydra_errors`` says Hydra's refusals of it in one line and ``hydra_dirs``
takes away the directories a refused one made; ``trainer`` the loop, with ``loss``; ``resume``
what last.pt keeps of it) ->
``lines`` (text to n-best lists, each line's a ``results.LineResult``) -> ``translate`` (its
command line; ``translate_checks`` what it refuses first) -> ``evaluate`` (its command line in
``evaluate_args``; with ``testsets`` and ``report``).
``config`` holds every stage's typed config and ``config_checks`` the ranges of its values;
``distributed`` starts ``torchrun``'s process group and ``runlog`` writes a run's logs, curves and
final test; ``checkpoint`` saves and loads self-contained models and ``average`` (``mt-average``)
averages them; ``inference`` readies them for decoding (dtype, CPU packing, ensembles).
``subwords`` draws subword regularization's segmentations; ``optim`` is the optimizer, its
schedule and the training precision; ``divergence`` catches a run that blows up.
``kvcache`` is the decoder's cache and the attention that reads it; ``incremental`` steps one
model or an ensemble a token at a time for every search; ``workers`` searches batches on several
cores; ``options`` holds the search flags ``translate`` and ``mt-eval`` share; ``textio`` reads
and writes line-parallel text files; ``interrupts`` makes SIGTERM and SIGHUP end a command as
Ctrl-C does.
``constraints`` is the lexically constrained search, ``shortlist`` (``mt-shortlist``) the
vocabulary shortlists that restrict each line's output layer, ``mbr`` minimum Bayes risk decoding,
``scoring`` the teacher-forced scores and attention of given translations, ``alignment`` word
alignments and word scores; ``export`` / ``import_hf`` (CLIs in ``interop``) move models to and
from Hugging Face Marian and CTranslate2; ``demo`` generates the default corpus.
``entry`` holds the console scripts (an interrupt while torch loads is one line); ``spmtrain``
trains SentencePiece in a child process a stop signal can end (``pdeathsig`` makes it, and
``workers``' processes, die with a parent killed outright), ``spm_spec`` reads a tokenizer's
settings from its models; ``startup`` sets a training run up and ``stopping`` says when its
budget ends it.
"""

import argparse

__version__ = "0.1.0"


def version_line() -> str:
    """What every command's ``--version`` prints: mt's version and those of the libraries that
    decide its results, which a bug report or a paper's setup needs (sacreBLEU's signature names
    only its own). Read from the installed packages' metadata, so nothing heavy is imported."""
    from importlib import metadata

    parts = []
    for name in ("torch", "sentencepiece", "sacrebleu", "datasets", "hydra-core"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    return f"mt {__version__} ({', '.join(parts)})"


def described(doc: str | None) -> str:
    """A command's argparse description from its module docstring: the first line, without
    reStructuredText's double backticks, which --help printed as they are (mt-average's began
    with a doubly quoted mt-average). Empty under ``python -OO``, which drops docstrings."""
    return (doc or "").strip().split("\n")[0].replace("``", "")


class _Version(argparse.Action):
    """``--version``: the line unwrapped (argparse's own action folds it at the terminal width),
    and the metadata read only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_line())
        parser.exit()


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """Gives a command ``--version`` (``version_line``)."""
    parser.add_argument("--version", action=_Version,
                        help="print the versions of mt and of the libraries it runs on, and exit")
