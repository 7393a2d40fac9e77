"""mt: neural machine translation with a readable Transformer.

The package follows the path from raw text to BLEU, one module per stage:
``tokenizer`` -> ``data`` (read corpora) -> ``batching`` (encode, filter, token batches) ->
``corpus`` (the training corpus, tokenized and cached) -> ``model`` -> ``search`` -> ``train``
(the command line; ``trainer`` the loop, with ``loss``; ``resume`` what last.pt keeps of it) ->
``lines`` (text to n-best lists, each line's a ``results.LineResult``) -> ``translate`` (its
command line; ``translate_checks`` what it refuses first) -> ``evaluate`` (with ``testsets`` and
``report``).
``config`` holds every stage's typed config and ``config_checks`` the ranges of its values;
``distributed`` starts ``torchrun``'s process group and ``runlog`` writes a run's logs, curves and
final test; ``checkpoint`` saves and loads self-contained models and ``average`` (``mt-average``)
averages them; ``inference`` readies them for decoding (dtype, CPU packing, ensembles).
``subwords`` draws subword regularization's segmentations; ``optim`` is the optimizer, its
schedule and the training precision; ``divergence`` catches a run that blows up.
``kvcache`` is the decoder's cache and the attention that reads it; ``incremental`` steps one
model or an ensemble a token at a time for every search; ``workers`` searches batches on several
cores; ``options`` holds the search flags ``translate`` and ``mt-eval`` share; ``textio`` reads
and writes line-parallel text files.
``constraints`` is the lexically constrained search, ``shortlist`` (``mt-shortlist``) the
vocabulary shortlists that restrict each line's output layer, ``mbr`` minimum Bayes risk decoding,
``scoring`` the teacher-forced scores and attention of given translations, ``alignment`` word
alignments and word scores; ``export`` / ``import_hf`` (CLIs in ``interop``) move models to and
from Hugging Face Marian and CTranslate2; ``demo`` generates the default corpus.
"""

__version__ = "0.1.0"
