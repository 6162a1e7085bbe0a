"""A graph's initializers read and written one at a time, so that no step of an export holds all the weights.

``TensorStore(base_dir, data_file)`` reads an initializer (embedded, or ONNX external data under
``base_dir``) with ``array`` and makes new ones with ``tensor``: appended to ``data_file`` (aligned, as
``onnx.save``'s external data is) or, without a data file or below ``EMBED_BELOW`` bytes, embedded in
the proto. The graph passes (export/fused_graph.py, export/smooth.py, export/quantize.py,
export/quantize_integer.py, export/prefill_graph.py) take one, so the same code rewrites a small graph
in memory and a 7B one through its data file. Rewritten tensors leave their old bytes behind in the
file; ``compact`` copies the ones the graph still reads into a fresh file.

    store = TensorStore(path.parent, path.with_name(path.name + ".data"))
    w = store.array(init)                        # one tensor, as numpy
    proto.graph.initializer.append(store.tensor("w/q", quantize(w)))
    compact(proto, store)                        # then onnx.save(proto, path): references stay valid
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ALIGN = 4096  # tensors of ALIGN_ABOVE bytes or more start at a page boundary (ONNX Runtime can map them)
ALIGN_ABOVE = 1 << 20
EMBED_BELOW = 1024  # smaller tensors stay in the proto (onnx.save's default size threshold)


class TensorStore:
    """Reads initializers from ``base_dir``; writes new ones to ``data_file`` (None: into the proto)."""

    def __init__(self, base_dir: Path | None = None, data_file: Path | None = None):
        self.base_dir, self.data_file = base_dir, data_file

    def array(self, tensor) -> np.ndarray:
        from onnx import numpy_helper

        return numpy_helper.to_array(tensor, base_dir=str(self.base_dir or ""))

    def tensor(self, name: str, array: np.ndarray):
        """A TensorProto of ``array`` named ``name``, its bytes in the data file where there is one."""
        from onnx import TensorProto, helper, numpy_helper

        array = np.ascontiguousarray(array)
        if self.data_file is None or array.nbytes < EMBED_BELOW:
            return numpy_helper.from_array(array, name)
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        with open(self.data_file, "ab") as f:
            offset = _append(f, memoryview(array).cast("B"))
        _point(t, self.data_file.name, offset, array.nbytes)
        return t


def _point(t, location: str, offset: int, length: int) -> None:
    """Make TensorProto ``t`` read its bytes from ``location`` at ``offset`` (ONNX external data)."""
    from onnx import TensorProto

    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = TensorProto.EXTERNAL


def _append(f, raw) -> int:
    """Write ``raw`` at the end of the open file ``f`` (aligned where large); returns its offset."""
    offset = f.tell()
    if len(raw) >= ALIGN_ABOVE and offset % ALIGN:
        f.write(b"\0" * (ALIGN - offset % ALIGN))
        offset = f.tell()
    f.write(raw)
    return offset


def drop_unread(proto, names) -> None:
    """Remove the initializers named in ``names`` that no node of ``proto`` reads any more (rewritten weights)."""
    read = {x for node in proto.graph.node for x in node.input}
    for init in [i for i in proto.graph.initializer if i.name in set(names) - read]:
        proto.graph.initializer.remove(init)


def compact(proto, store: TensorStore) -> None:
    """Rewrite ``store.data_file`` to hold only the tensors of ``proto`` that point into it (in graph order),
    updating their offsets; tensors in other files are left as they are."""
    from onnx import external_data_helper

    name = store.data_file.name
    if not store.data_file.exists():
        return
    tmp = store.data_file.with_name(name + ".compact")
    tmp.unlink(missing_ok=True)
    with open(store.data_file, "rb") as src, open(tmp, "wb") as dst:
        for t in proto.graph.initializer:
            if not external_data_helper.uses_external_data(t):
                continue
            info = external_data_helper.ExternalDataInfo(t)
            if info.location != name:
                continue
            src.seek(info.offset)
            _point(t, name, _append(dst, src.read(info.length)), info.length)
    os.replace(tmp, store.data_file)


def externalize(proto, store: TensorStore) -> None:
    """Move ``proto``'s embedded initializers of ``EMBED_BELOW`` bytes or more into ``store.data_file``."""
    from onnx import TensorProto, external_data_helper

    for t in proto.graph.initializer:
        if not external_data_helper.uses_external_data(t) and t.data_type != TensorProto.STRING:
            a = store.array(t)
            if a.nbytes >= EMBED_BELOW:
                t.CopyFrom(store.tensor(t.name, a))
