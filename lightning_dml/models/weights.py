"""Where the pretrained backbone weights come from: :data:`WEIGHTS`, name -> URL, cache file name, sha256.

``pretrained: true`` looks for ``$TORCH_HOME/hub/checkpoints/<file_name>`` (the cache torchvision and
``pretrainedmodels`` use, under the names they use) and downloads a missing file from ``url`` with
``torch.hub.download_url_to_file`` (the downloader of ``torch.hub.load_state_dict_from_url``), checking its
sha256. The hash is held apart from the file name, so a file from a mirror (set by ``LIGHTNING_DML_RESOURCES``,
see :mod:`lightning_dml.download`) is verified too.

Sources of the facts below:

* torchvision: the ``IMAGENET1K_V1`` entries of ``ResNet50_Weights``, ``ResNet101_Weights`` and
  ``GoogLeNet_Weights`` (https://pytorch.org/vision/stable/models.html). Their file names follow torch hub's
  ``<name>-<sha256 prefix>.<ext>`` convention ("the first eight or more digits of the SHA256 hash of the contents
  of the file", https://pytorch.org/docs/stable/hub.html#torch.hub.load_state_dict_from_url), so the prefix is
  the published hash.
* BN-Inception: the URL ``pretrainedmodels`` (Cadene/pretrained-models.pytorch,
  ``pretrainedmodels/models/bninception.py``) downloads, whose file name carries the sha256 prefix ``52deb4733``
  in the same convention.

No mirror is listed: none publishes a hash for these files.
"""

from __future__ import annotations

from lightning_dml.download import RemoteFile, resolve_entry

__all__ = ["WEIGHTS", "weights_entry"]

#: backbone weights name -> :class:`~lightning_dml.download.RemoteFile` (URL, cache file name, sha256 prefix)
WEIGHTS: dict[str, RemoteFile] = {
    "bninception": RemoteFile(
        url="http://data.lip6.fr/cadene/pretrainedmodels/bn_inception-52deb4733.pth",
        file_name="bn_inception-52deb4733.pth",
        sha256="52deb4733",
    ),
    "googlenet": RemoteFile(
        url="https://download.pytorch.org/models/googlenet-1378be20.pth",
        file_name="googlenet-1378be20.pth",
        sha256="1378be20",
    ),
    "resnet50": RemoteFile(
        url="https://download.pytorch.org/models/resnet50-0676ba61.pth",
        file_name="resnet50-0676ba61.pth",
        sha256="0676ba61",
    ),
    "resnet101": RemoteFile(
        url="https://download.pytorch.org/models/resnet101-63fe2227.pth",
        file_name="resnet101-63fe2227.pth",
        sha256="63fe2227",
    ),
}


def weights_entry(name: str) -> RemoteFile:
    """``WEIGHTS[name]`` with the fields the ``LIGHTNING_DML_RESOURCES`` file sets for ``name`` replaced."""
    return resolve_entry(WEIGHTS, name, "weights", RemoteFile)
