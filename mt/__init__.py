"""mt: neural machine translation with a readable Transformer.

The package follows the path from raw text to BLEU, one module per stage:
``tokenizer`` -> ``data`` (read corpora) -> ``batching`` (encode, filter, token batches) ->
``model`` -> ``search`` -> ``train`` (with ``loss``) -> ``lines`` (text to n-best lists) ->
``translate`` (its command line) -> ``evaluate`` (with ``testsets`` and ``report``).
``distributed`` starts ``torchrun``'s process group and ``runlog`` writes a run's logs, curves
and final test; ``checkpoint`` saves and loads self-contained models; ``inference`` readies them
for decoding (dtype, CPU packing, ensembles); ``constraints`` is the lexically constrained search;
``export`` / ``import_hf`` (CLIs in ``interop``) move models to and from Hugging Face Marian and
CTranslate2; ``demo`` generates the default corpus.
"""

__version__ = "0.1.0"
