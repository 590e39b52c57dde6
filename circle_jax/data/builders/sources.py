"""Source trees: a folder, a zip or a tar(.gz) seen as ``relative path ->
bytes``, and :func:`find_source`, which finds a dataset's archive or its
extracted folder in the manual directory (:mod:`.base` builds on them)."""

from __future__ import annotations

import abc
import pathlib
import tarfile
import zipfile
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

from circle_jax.errors import UserError

# Non-image files that archive trees keep in memory on their first scan, so
# metadata can be read from a .tgz without a second pass.
_METADATA_SUFFIXES = (".txt", ".mat", ".csv", ".json")
_MAX_METADATA_BYTES = 64 << 20


class CorruptImageError(UserError, ValueError):
  """Raised when an image of a dataset cannot be decoded; names the file."""


class SourceTree(abc.ABC):
  """Read-only view of files addressed by '/'-separated relative paths."""

  description: str

  @abc.abstractmethod
  def names(self) -> List[str]:
    """All file paths in the tree."""

  @abc.abstractmethod
  def read_bytes(self, rel: str) -> bytes:
    """Content of one (metadata) file; KeyError if absent."""

  @abc.abstractmethod
  def iter_files(self, rels: Iterable[str]) -> Iterator[Tuple[str, bytes]]:
    """Yields `(rel, content)` for each requested path, in storage order.

    Raises:
      CorruptImageError: listing requested paths that are not in the tree.
    """

  def exists(self, rel: str) -> bool:
    return rel in self._name_set()

  def _name_set(self):
    if not hasattr(self, "_names_cache"):
      self._names_cache = set(self.names())
    return self._names_cache

  def _missing(self, rels):
    missing = sorted(set(rels) - self._name_set())
    if missing:
      shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
      raise CorruptImageError(
          f"{len(missing)} image file(s) listed by the metadata are missing from "
          f"{self.description}: {shown}. The copy is incomplete; download it "
          "again.")


class DirTree(SourceTree):
  """An extracted folder.

  ``prefix``: the tree addresses ``root/x`` as ``'<prefix>/x'``, for an
  extracted folder renamed by its user (``manual_dir`` = ``.../cub/`` holding
  what the archive has under ``CUB_200_2011/``).
  """

  def __init__(self, root, prefix: str = ""):
    self.root = pathlib.Path(root)
    self.prefix = prefix.strip("/") + "/" if prefix else ""
    self.description = f"folder {str(self.root)!r}"

  def _path(self, rel) -> Optional[pathlib.Path]:
    if not rel.startswith(self.prefix):
      return None
    return self.root / rel[len(self.prefix):]

  def names(self):
    return [self.prefix + p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*") if p.is_file()]

  def exists(self, rel):
    path = self._path(rel)
    return path is not None and path.is_file()

  def read_bytes(self, rel):
    if not self.exists(rel):
      raise KeyError(rel)
    return self._path(rel).read_bytes()

  def iter_files(self, rels):
    rels = list(rels)
    missing = [r for r in rels if not self.exists(r)]
    if missing:
      self._names_cache = set(rels) - set(missing)
      self._missing(rels)
    for rel in rels:
      yield rel, self._path(rel).read_bytes()


class EncryptedArchiveError(UserError, ValueError):
  """A zip archive is password-protected; says where to extract it."""


class ZipTree(SourceTree):
  """A zip archive (random access).

  ``extract_to``: the folder that the builder reads when it holds the
  archive's files, named by the error for a password-protected archive.
  """

  def __init__(self, path, extract_to=None):
    self.path = pathlib.Path(path)
    self.description = f"archive {str(self.path)!r}"
    try:
      with zipfile.ZipFile(self.path) as zf:
        infos = [i for i in zf.infolist() if not i.is_dir()]
    except (zipfile.BadZipFile, OSError) as e:
      raise CorruptImageError(
          f"Cannot read the zip archive {str(self.path)!r} ({e}); it is "
          "truncated or corrupt. Download it again.") from e
    self._names = [i.filename for i in infos]
    encrypted = [i.filename for i in infos if i.flag_bits & 0x1]
    if encrypted:
      raise encrypted_archive_error(self.path, encrypted, extract_to)

  def names(self):
    return list(self._names)

  def read_bytes(self, rel):
    with zipfile.ZipFile(self.path) as zf:
      return zf.read(rel)

  def iter_files(self, rels):
    rels = list(rels)
    self._missing(rels)
    with zipfile.ZipFile(self.path) as zf:
      for rel in rels:
        try:
          data = zf.read(rel)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
          raise CorruptImageError(
              f"Cannot read {rel!r} from {self.description} ({e}).") from e
        yield rel, data


class TarTree(SourceTree):
  """A tar archive, possibly compressed; read as a stream (one pass per call).

  The first scan records every member name and keeps small metadata files
  (``.txt``, ``.mat``, ...) in memory; ``iter_files`` then streams the archive
  once more and yields the requested members in archive order.
  """

  def __init__(self, path):
    self.path = pathlib.Path(path)
    self.description = f"archive {str(self.path)!r}"
    self._names = None
    self._small = {}

  def _scan(self):
    if self._names is not None:
      return
    names = []
    for member, tf in self._members():
      names.append(member.name)
      if (member.name.endswith(_METADATA_SUFFIXES)
          and member.size <= _MAX_METADATA_BYTES):
        self._small[member.name] = tf.extractfile(member).read()
    self._names = names

  def _members(self):
    try:
      with tarfile.open(self.path, mode="r|*") as tf:
        for member in tf:
          if member.isfile():
            name = member.name[2:] if member.name.startswith("./") else member.name
            member.name = name
            yield member, tf
    except (tarfile.TarError, OSError, EOFError) as e:
      raise CorruptImageError(
          f"Cannot read the tar archive {str(self.path)!r} ({e}); it is "
          "truncated or corrupt. Download it again.") from e

  def names(self):
    self._scan()
    return list(self._names)

  def read_bytes(self, rel):
    self._scan()
    if rel in self._small:
      return self._small[rel]
    for member, tf in self._members():
      if member.name == rel:
        return tf.extractfile(member).read()
    raise KeyError(rel)

  def iter_files(self, rels):
    wanted = set(rels)
    self._scan()
    self._missing(wanted)
    for member, tf in self._members():
      if member.name in wanted:
        yield member.name, tf.extractfile(member).read()


def encrypted_archive_error(path, encrypted: Sequence[str], extract_to=None
                            ) -> EncryptedArchiveError:
  """One line: the archive is password-protected; extract it with its
  password into the folder the builder reads (``extract_to``; default: the
  archive's own folder, which then holds the archive's top-level folder)."""
  path = pathlib.Path(path)
  dest = path.parent
  target = (pathlib.Path(extract_to) if extract_to is not None
            else dest / encrypted[0].split("/")[0])
  return EncryptedArchiveError(
      f"The archive '{path}' is password-protected ({len(encrypted)} "
      f"encrypted file(s), e.g. '{encrypted[0]}'): extract it with its "
      f"password (`unzip -P PASSWORD '{path}' -d '{dest}'`, or 7-Zip) so "
      f"that its files are in '{target}/', which the builder then reads; "
      "the dataset's authors give the password on request.")


def open_tree(path, extract_to=None) -> SourceTree:
  """A folder, a ``.zip`` or a tar archive as a :class:`SourceTree`."""
  path = pathlib.Path(path)
  if path.is_dir():
    return DirTree(path)
  if zipfile.is_zipfile(path):
    return ZipTree(path, extract_to=extract_to)
  return TarTree(path)


def find_source(manual_dir, *, folder: str, archives: Sequence[str],
                marker: Optional[str] = None) -> Optional[SourceTree]:
  """Finds `folder` (extracted) or one of `archives` under `manual_dir`.

  The returned tree addresses files as ``'<folder>/...'`` in both cases (the
  official archives contain the folder at their top level). `manual_dir` may
  also be the extracted folder itself.

  An extracted folder is preferred to an archive beside it (a
  password-protected archive is read once extracted). With a ``marker``,
  `manual_dir` may be the extracted folder under any name (it holds the
  marker).

  Args:
    manual_dir: directory to search (or None).
    folder: the top-level folder of the official archive.
    archives: archive file names, relative to `manual_dir`.
    marker: a file inside `folder` whose presence identifies an extracted
      copy (default: the folder merely existing).

  Returns:
    A tree, or None if nothing was found.
  """
  if manual_dir is None:
    return None
  root = pathlib.Path(manual_dir)
  def ok(d):
    return d.is_dir() and (marker is None or (d / marker).exists())
  if ok(root / folder):
    return DirTree(root)
  if root.name == folder and ok(root):
    return DirTree(root.parent)
  if marker is not None and ok(root):  # the extracted folder, renamed
    return DirTree(root, prefix=folder)
  for name in archives:
    if (root / name).is_file():
      return open_tree(root / name, extract_to=(root / name).parent / folder)
  return None
