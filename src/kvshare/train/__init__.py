"""Training and evaluation of the shipped byte-level model on the CPython stdlib sources.

* ``data.py``: the corpus (file list, manifest, held-out split, context sampling).
* ``loop.py``: the next-byte loss through the inference ``Transformer.forward``.
* ``indexer_loss.py``: lightning-indexer distillation (KL to the main attention).
* ``train.py``: ``python -m kvshare.train.train`` (AdamW + cosine, fake-quant with straight-through).
* ``baselines.py``: unigram / bigram byte baselines.
* ``engine_eval.py``: bits per byte through the serving engine (``ScoringRunner``).
* ``eval.py``: ``python -m kvshare.train.eval`` (bits per byte: dense path, engine path, baselines).
"""
