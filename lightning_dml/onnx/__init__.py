"""ONNX export of the embedding model and its ONNX Runtime (issue 31 s.1; docs/serving.md, "ONNX Runtime").

* :mod:`lightning_dml.onnx.export` (needs torch): :func:`~lightning_dml.onnx.export.export_onnx` writes
  ``embedding_model.onnx`` (dynamic batch axis) and, with ``quantize="int8"``, ``embedding_model.int8.onnx``
  (onnxruntime's dynamic int8 quantisation), verified against the PyTorch model at export, with the errors recorded
  in ``onnx_export.json``;
* :mod:`lightning_dml.onnx.runtime` (no torch): :class:`~lightning_dml.onnx.runtime.OnnxEmbedder`, the image
  preprocessing of the index (PIL and NumPy) and an ``onnxruntime`` session (CPU, or CUDA where available);
* :mod:`lightning_dml.onnx.folder_search` (no torch): an index folder's faiss files and table searched from NumPy
  queries (float32 or compressed vectors, :mod:`lightning_dml.index.faiss_search`), :mod:`lightning_dml.onnx.cuts`
  (``--threshold`` and the calibrated ``match`` flags on arrays), and :mod:`lightning_dml.onnx.search`, the command
  ``lightning-dml search --runtime onnx`` on them;
* :mod:`lightning_dml.onnx.build` (``index build --runtime onnx``) and :mod:`lightning_dml.onnx.serve` (``serve
  --runtime onnx``), which need torch (the checkpoint, the server's search).

Nothing here is imported by ``import lightning_dml.onnx``: the runtime modules must stay free of torch.
"""

from __future__ import annotations

__all__: list[str] = []
