"""The retrieval report (``lightning-dml report``, :class:`~lightning_dml.callbacks.RetrievalReport`): a folder
with an ``index.html`` that opens offline from disk, showing what the model retrieves (``docs/report.md``).

* :mod:`~lightning_dml.report.writer`: :func:`write_report`, the folder from a
  :class:`~lightning_dml.retrieval.RetrievalResults`;
* :mod:`~lightning_dml.report.thumbnails`: where the items' images come from (:func:`image_source`) and their
  thumbnails (:class:`ThumbnailWriter`, written once, content-addressed);
* :mod:`~lightning_dml.report.grid`: :func:`results_grid`, the worst queries as one image (TensorBoard, W&B);
* :mod:`~lightning_dml.report.folder`: which folders a report may be written into (new, empty, an earlier report,
  or with ``overwrite``), recognised by their marker ``report.json``;
* :mod:`~lightning_dml.report.command`: the ``lightning-dml report`` command.
"""

from lightning_dml.report.folder import ReportFolderError, is_report_folder
from lightning_dml.report.grid import results_grid
from lightning_dml.report.thumbnails import DatasetImages, ImageSource, PathImages, ThumbnailWriter, image_source
from lightning_dml.report.writer import Report, report_data, report_metrics, write_report

__all__ = [
    "DatasetImages",
    "ImageSource",
    "PathImages",
    "Report",
    "ReportFolderError",
    "ThumbnailWriter",
    "image_source",
    "is_report_folder",
    "report_data",
    "report_metrics",
    "results_grid",
    "write_report",
]
