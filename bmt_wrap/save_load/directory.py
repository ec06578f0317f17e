"""A checkpoint given as a file or as a directory ``save_pretrained`` wrote, opened as one ``Source``.

A directory holds ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors`` named by
``model.safetensors.index.json``'s ``weight_map`` (``pytorch_model.bin`` and its index alike). Every key
is checked against the file its index names before anything is read, so a wrong index fails on every
rank at once, naming the file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError, listed
from .formats import Source, open_source

# In transformers' order of preference.
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


class FilesSource:
    """Several checkpoint files read as one: each key from the file the index names."""

    def __init__(self, path: Path, files: dict[str, Source], where: dict[str, str]) -> None:
        self.path = path
        self.files = files
        self.where = where
        self.checksums = {n: files[f].checksums[n] for n, f in where.items() if n in files[f].checksums}

    def keys(self) -> list[str]:
        """Every tensor name the index lists."""
        return list(self.where)

    def file_of(self, name: str) -> Path:
        """The file that holds ``name``."""
        return self.files[self.where[name]].path

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``name``."""
        return self.files[self.where[name]].info(name)

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``, from its file (into ``out``)."""
        return self.files[self.where[name]].read(name, start, end, out)


def open_checkpoint(path: Path) -> Source | FilesSource:
    """A checkpoint file, or the weights of a ``save_pretrained`` directory; ``CheckpointError`` naming what
    is missing or wrong."""
    if not path.is_dir():
        return open_source(path)
    for name in INDEXES:
        if (path / name).is_file():
            return _indexed(path / name)
    for name in WEIGHTS:
        if (path / name).is_file():
            return open_source(path / name)
    raise CheckpointError(f"{path} is a directory without {', '.join(INDEXES + WEIGHTS)}: pass a checkpoint "
                          "file, or a directory written by save_pretrained")


def _indexed(index: Path) -> FilesSource:
    try:
        where = json.loads(index.read_text())["weight_map"]
        if not isinstance(where, dict) or not all(isinstance(v, str) for v in where.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a checkpoint index ({type(exc).__name__}: {exc}): save the "
                              "model again with save_pretrained") from exc
    files = {name: open_source(index.parent / name) for name in dict.fromkeys(where.values())}
    held = {name: set(source.keys()) for name, source in files.items()}
    absent = [f"{key!r} (in {name})" for key, name in where.items() if key not in held[name]]
    if absent:
        raise CheckpointError(f"{index} names tensors its files do not hold: {listed(absent, fmt=str)}; the "
                              "checkpoint is incomplete: save it again, or download the missing files")
    return FilesSource(index.parent, files, where)
