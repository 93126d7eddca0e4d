"""Checkpoint weights: reading, streaming, writing, naming and the released FP8 / FP4 formats.

* `loader.py`: `load_checkpoint` (a state dict) and `load_model` (a model from a directory, a
  shipped model or a config name);
* `checkpoint_stream.py`: a released-naming checkpoint streamed into a built model one tensor at a
  time (FP8 / FP4 repacked from one read, plain tensors mapped), peak memory about the file's size;
* `checkpoint_files.py`: which files to read, safetensors headers, shapes checked before any read;
* `checkpoint_write.py`: `save_checkpoint`, `export_transformers`;
* `hf_naming.py`: DeepSeek's released names and transformers' namings, mapped both ways;
* `weights_quant.py`: the released FP8 / FP4 weight encodings.

The network (`kvshare.model`) never imports this package; it imports the network to build models.
"""
