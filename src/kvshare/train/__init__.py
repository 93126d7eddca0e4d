"""Training and evaluation of the shipped byte-level model on the CPython stdlib sources.

* ``data.py``: the corpus (file list, manifest, held-out split, context sampling).
* ``loop.py``: the next-byte loss through the inference ``Transformer.forward``.
* ``train.py``: ``python -m kvshare.train.train`` (AdamW + cosine, fake-quant with straight-through).
* ``baselines.py``: unigram / bigram byte baselines.
* ``eval.py``: ``python -m kvshare.train.eval`` (bits per byte: dense path, engine path, baselines).
"""
