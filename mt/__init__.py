"""mt: neural machine translation with a readable Transformer.

The package follows the path from raw text to BLEU, one module per stage:
``tokenizer`` -> ``data`` -> ``model`` -> ``search`` -> ``train`` -> ``translate`` -> ``evaluate``.
"""

__version__ = "0.1.0"
