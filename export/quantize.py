"""Weight-only quantization of an exported graph's MatMuls (ONNX Runtime's MatMulNBits kernels).

``int8`` and ``int4`` quantize every MatMul with a constant weight in blocks of ``BLOCK_SIZE``
along the input dimension (symmetric, one fp32 scale per block), computed by ORT's CPU kernels
with int8 activations (accuracy level 4). int4 keeps the lm_head in int8: on small models int4
logits drift most there (docs/decode-step-study, section 5). Quantization changes the model:
speculative decoding stays exact with respect to the QUANTIZED target, and the export judges how
far the quantized model moved from the unquantized torch model on real text (KL and top-1 agreement
on the calibration text: export/parity.py's ``BOUNDS["int8"]`` / ``BOUNDS["int4"]``).
"""
from __future__ import annotations

from pathlib import Path

BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32  # weights per scale, along the MatMul's input dimension
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations (the fast CPU path)


class QuantizeError(RuntimeError):
    pass


def quantize_graph(path: Path, scheme: str, external_data: bool = False) -> dict:
    """Quantize the graph at ``path`` in place; returns {"scheme", "bits", "block_size", "matmuls"}."""
    import onnx

    if scheme not in BITS:
        raise QuantizeError(f"unknown quantization {scheme!r}; choose one of {', '.join(BITS)}")
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                      MatMulNBitsQuantizer)
    except ImportError as e:  # onnxruntime's quantizer imports onnx_ir
        raise QuantizeError(f"quantization needs onnxruntime's quantizer and onnx_ir ({e}); "
                            "pip install 'specrt[export]'") from None
    import logging

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line per node
    proto = onnx.load(str(path))
    lm_head = [n.name for n in proto.graph.node if n.op_type == "MatMul" and "logits" in n.output]
    passes = [(BITS[scheme], lm_head if scheme == "int4" else [])]
    if scheme == "int4" and lm_head:
        passes.append((8, []))  # then the lm_head, in int8
    for bits, exclude in passes:
        config = DefaultWeightOnlyQuantConfig(block_size=BLOCK_SIZE, is_symmetric=True,
                                              accuracy_level=ACCURACY_LEVEL, bits=bits)
        quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=BLOCK_SIZE, is_symmetric=True,
                                         accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=exclude, algo_config=config)
        quantizer.process()
        proto = quantizer.model.model
    count = sum(n.op_type == "MatMulNBits" for n in proto.graph.node)
    if count == 0:
        raise QuantizeError(f"{path.name}: no MatMul with a constant weight to quantize")
    if external_data:
        onnx.save(proto, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(proto, str(path))
    return {"scheme": scheme, "bits": BITS[scheme], "block_size": BLOCK_SIZE, "matmuls": count}
