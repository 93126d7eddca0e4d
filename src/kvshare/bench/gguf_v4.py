"""Write a kvshare V4 checkpoint as a bf16 GGUF with llama.cpp's own converter (run as a script).

``python -m kvshare.bench.gguf_v4 CKPT_DIR OUT.gguf`` must run with llama.cpp's converter on
``PYTHONPATH`` (its source directory, holding ``conversion/``, and its ``gguf-py/``);
``kvshare.bench.llamacpp_files`` finds or fetches them and starts this script.

Upstream's ``DeepseekV4Model`` converts the released DeepSeek-V4 checkpoints, and two of its steps
assume what those checkpoints hold and the benchmark model does not:

* routed experts: upstream repacks FP4 experts (weight + e8m0 scale) into MXFP4. The benchmark's
  experts are plain bf16 matrices, so they are stacked per projection (w1 = gate, w2 = down,
  w3 = up) into one ``[n_expert, out, in]`` tensor each and written in their own dtype, the
  layout llama.cpp's loader reads for any expert type;
* tokenizer: the benchmark model has none (prompts are token ids), so the GGUF gets llama.cpp's
  id-only vocabulary (tokenizer model ``none`` with ``deepseek4.vocab_size`` dummy tokens).

Everything else (tensor names, hyper-parameters, the hash-routing table as I32, dtypes: bf16
tensors stay BF16, fp32 ones F32) is upstream's conversion unchanged. ``--outtype q8_0`` writes
the matrices kvshare runs in bf16 (attention, experts, indexer query, embedding, head) as Q8_0
and keeps what kvshare keeps in fp32 (mHC, compressors, router, norms) as stored, as upstream
does for the released checkpoint's FP8 matrices. (``llama_model_quantize`` would quantise the
fp32 matrices too.)

``--outtype released`` converts a checkpoint in the release's formats (``kvshare.bench.real_checkpoint``:
FP4 experts with ue8m0 scales, FP8 linears with 128 x 128 block scales) with upstream's rules
unchanged, only the vocabulary id-only: FP4 experts repacked losslessly to MXFP4, FP8 linears
dequantised and written Q8_0, bf16 tensors BF16, fp32 ones F32 (upstream's conversion of
DeepSeek-V4-Flash, file type MOSTLY_MXFP4_MOE).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Iterable

_EXPERT_STACK = re.compile(r"layers\.(\d+)\.ffn\.experts\.(w[123])\.weight$")
# GGUF tensors the q8_0 file keeps as stored: what kvshare keeps in fp32 in every dtype (mHC,
# compressors, router, hash table, norms)
_KEEP = re.compile(r"hc_|compressor|ffn_gate_inp|tid2eid|_norm\.")


def _converter_class() -> Any:
    """A subclass of upstream's DeepseekV4Model (defined here because its base is only importable
    with llama.cpp's converter on sys.path)."""
    import gguf
    import torch
    from conversion.base import LazyTorchTensor, TextModel
    from conversion.deepseek import DeepseekV4Model

    proj_keys = {"w1": gguf.MODEL_TENSOR.FFN_GATE_EXP, "w2": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
                 "w3": gguf.MODEL_TENSOR.FFN_UP_EXP}

    class KvshareV4Model(DeepseekV4Model):
        """Upstream's V4 conversion with unquantised experts and an id-only vocabulary."""

        model_arch = gguf.MODEL_ARCH.DEEPSEEK4

        def set_vocab(self) -> None:
            self.gguf_writer.add_tokenizer_model("none")
            self.gguf_writer.add_vocab_size(int(self.hparams["vocab_size"]))

        def generate_extra_tensors(self) -> Iterable[tuple[str, Any]]:
            if self._dsv4_mxfp4_generated:
                return
            consumed = self._write_hash_routing_tensors()
            n_experts = int(self.hparams["n_routed_experts"])
            for bid in range(self.hparams["num_hidden_layers"]):
                for proj in proj_keys:
                    names = [f"layers.{bid}.ffn.experts.{e}.{proj}.weight" for e in range(n_experts)]
                    missing = [n for n in names if n not in self.model_tensors]
                    if missing:
                        raise KeyError(f"checkpoint lacks routed expert tensors, e.g. {missing[0]}")
                    mats = [LazyTorchTensor.to_eager(self.model_tensors[n]()) for n in names]
                    stacked = torch.stack(mats)
                    if all(m.dtype == torch.bfloat16 for m in mats):
                        self._dsv4_bf16_tensors.add(f"layers.{bid}.ffn.experts.{proj}.weight")
                    consumed.extend(names)
                    yield f"layers.{bid}.ffn.experts.{proj}.weight", stacked
            for name in consumed:
                del self.model_tensors[name]
            self._dsv4_mxfp4_generated = True

        def modify_tensors(self, data_torch: Any, name: str, bid: int | None) -> Iterable[tuple[str, Any]]:
            m = _EXPERT_STACK.match(name)
            if m is not None:
                return [(self.format_tensor_name(proj_keys[m.group(2)], bid), data_torch)]
            return super().modify_tensors(data_torch, name, bid)

        def tensor_force_quant(self, name: str, new_name: str, bid: int | None, n_dims: int) -> Any:
            # q8_0: the matrices kvshare runs in bf16 become Q8_0 (upstream quantises the released
            # checkpoint's FP8 matrices to Q8_0 the same way); mHC, compressors, router stay as stored
            if self.ftype == gguf.LlamaFileType.MOSTLY_Q8_0 and n_dims >= 2 and not _KEEP.search(new_name):
                return gguf.GGMLQuantizationType.Q8_0
            return super().tensor_force_quant(name, new_name, bid, n_dims)

        def prepare_tensors(self) -> None:
            TextModel.prepare_tensors(self)  # upstream's V4 override only marks the file as MXFP4

    return KvshareV4Model


def _released_converter_class() -> Any:
    """Upstream's DeepseekV4Model with an id-only vocabulary (the benchmark checkpoints have no tokenizer)."""
    import gguf
    from conversion.deepseek import DeepseekV4Model

    class KvshareReleasedV4Model(DeepseekV4Model):
        """Upstream's conversion of a released-format V4 checkpoint (MXFP4 experts, Q8_0 from FP8)."""

        model_arch = gguf.MODEL_ARCH.DEEPSEEK4

        def set_vocab(self) -> None:
            self.gguf_writer.add_tokenizer_model("none")
            self.gguf_writer.add_vocab_size(int(self.hparams["vocab_size"]))

    return KvshareReleasedV4Model


def convert(ckpt_dir: Path, out_path: Path, outtype: str = "bf16") -> Path:
    """Convert `ckpt_dir` (config.json + safetensors, kvshare's released naming) to a GGUF.

    `outtype` "bf16": bf16 tensors BF16, fp32 ones F32 (upstream's rule for V4); "q8_0": the
    matrices kvshare runs in bf16 Q8_0, the rest as "bf16"; "f32": all F32; "released": a
    released-format checkpoint by upstream's rules (module doc)."""
    import gguf
    import torch

    ftypes = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "f32": gguf.LlamaFileType.ALL_F32, "released": gguf.LlamaFileType.MOSTLY_BF16}
    if outtype not in ftypes:
        raise ValueError(f"outtype must be one of {sorted(ftypes)}, got {outtype!r}")
    cls = _released_converter_class() if outtype == "released" else _converter_class()
    with torch.inference_mode():
        model = cls(Path(ckpt_dir), ftypes[outtype], Path(out_path), model_name="kvshare-bench-v4")
        model.write()
    return Path(out_path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", default="bf16", choices=["bf16", "q8_0", "f32", "released"])
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    convert(args.ckpt_dir, args.out, args.outtype)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
