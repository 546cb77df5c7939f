"""Which file and folder names are images, and which are skipped, when folders of images are read
(:class:`~lightning_dml.data.folder.ImageFolderDataModule`, an index's gallery: :mod:`lightning_dml.index.gallery`).

Standard library only, so that ``lightning-dml search`` reads its queries without importing Lightning.
"""

from __future__ import annotations

#: Image file extensions recognised in folders (compared in lower case)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")

#: Folders that tools leave beside the images and that are never classes or images: macOS's archive resource forks.
SKIPPED_FOLDERS = ("__MACOSX",)


def is_hidden(name: str) -> bool:
    """Whether a file or folder name is skipped when class folders are read: dot-files and dot-folders (``.DS_Store``,
    macOS's ``._<name>`` AppleDouble resource forks, ``.ipynb_checkpoints``, ``.git``) and :data:`SKIPPED_FOLDERS`."""
    return name.startswith(".") or name in SKIPPED_FOLDERS


__all__ = ["IMAGE_EXTENSIONS", "SKIPPED_FOLDERS", "is_hidden"]
