"""Writers of tiny datasets in each dataset's exact official layout.

Images are small generated JPEG/PNG files; metadata files have the official
names, headers and formats. ``full_*`` writers produce the metadata of the
complete datasets (every row, official split sizes) without the images, for
tests of the split logic; ``tiny_*`` writers produce a few real images.
"""

from __future__ import annotations

import io
import pathlib
import tarfile
import zipfile

import numpy as np
import scipy.io
from PIL import Image


def encode(kind: str, seed: int, size=(12, 9), mode="RGB") -> bytes:
  """A small random image, encoded as 'JPEG' or 'PNG'."""
  rng = np.random.default_rng(seed)
  shape = (size[1], size[0]) + ((3,) if mode == "RGB" else ())
  im = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)
  buf = io.BytesIO()
  im.save(buf, format=kind)
  return buf.getvalue()


def write_tree(files, root, *, archive=None, prefix=""):
  """Writes `{relpath: bytes}` as a folder, or as a .tgz/.zip `archive`.

  Archives hold the paths as given (the official archives have the dataset
  folder at their top level).
  """
  root = pathlib.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  if archive is None:
    for rel, data in files.items():
      path = root / rel
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_bytes(data)
    return root
  path = root / archive
  path.parent.mkdir(parents=True, exist_ok=True)
  if archive.endswith(".zip"):
    with zipfile.ZipFile(path, "w") as zf:
      dirs = sorted({str(pathlib.PurePosixPath(r).parent) + "/"
                     for r in files})
      for d in dirs:  # The official zips list directory entries too.
        zf.writestr(zipfile.ZipInfo(d), b"")
      for rel, data in files.items():
        zf.writestr(rel, data)
  else:
    with tarfile.open(path, "w:gz") as tf:
      for rel, data in files.items():
        info = tarfile.TarInfo(prefix + rel)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
  return path


# --------------------------------------------------------------------- CUB --


def cub_files(class_counts, *, seed=0, with_images=True):
  """CUB_200_2011/ metadata (+ images) for `{class_id: n_images}`.

  Image ids are shuffled across classes, as the split must come from the
  class ids and not from the order of the files.
  """
  rng = np.random.default_rng(seed)
  rows = [(c, k) for c, n in sorted(class_counts.items()) for k in range(n)]
  ids = rng.permutation(len(rows)) + 1
  files = {}
  images, labels, split, boxes = [], [], [], []
  classes = [f"{c} {c:03d}.Bird_{c}" for c in range(1, 201)]
  for image_id, (c, k) in sorted(zip(ids, rows)):
    rel = f"{c:03d}.Bird_{c}/Bird_{c}_{k:04d}_{image_id}.jpg"
    images.append(f"{image_id} {rel}")
    labels.append(f"{image_id} {c}")
    split.append(f"{image_id} {int(rng.integers(0, 2))}")
    boxes.append(f"{image_id} 1.0 2.0 5.0 4.0")
    if with_images:
      files[f"CUB_200_2011/images/{rel}"] = encode("JPEG", int(image_id))
  for name, lines in (("images.txt", images), ("classes.txt", classes),
                      ("image_class_labels.txt", labels),
                      ("train_test_split.txt", split),
                      ("bounding_boxes.txt", boxes)):
    files[f"CUB_200_2011/{name}"] = ("\n".join(lines) + "\n").encode()
  files["CUB_200_2011/README"] = b"CUB-200-2011 fixture\n"
  files["attributes.txt"] = b"1 has_bill_shape::curved\n"
  return files


def cub_full_counts():
  """Per-class counts summing to the official 5,864 / 5,924 images."""
  counts = {c: 59 if c <= 64 else 58 for c in range(1, 101)}
  counts.update({c: 60 if c <= 124 else 59 for c in range(101, 201)})
  return counts


# -------------------------------------------------------------------- Cars --


def cars_annos(class_ids, *, tests=None):
  """cars_annos.mat content: the official `annotations` struct array."""
  n = len(class_ids)
  tests = np.zeros(n, int) if tests is None else tests
  dt = [(f, "O") for f in ("relative_im_path", "bbox_x1", "bbox_y1",
                           "bbox_x2", "bbox_y2", "class", "test")]
  ann = np.zeros((1, n), dtype=dt)
  for i, (c, t) in enumerate(zip(class_ids, tests)):
    ann[0, i] = (np.array([f"car_ims/{i + 1:06d}.jpg"]),
                 np.array([[3]], np.uint8), np.array([[2]], np.uint8),
                 np.array([[9]], np.uint8), np.array([[7]], np.uint8),
                 np.array([[c]], np.uint8), np.array([[t]], np.uint8))
  names = np.empty((1, 196), dtype=object)
  for c in range(196):
    names[0, c] = np.array([f"Make Model {c + 1} 2012"])
  buf = io.BytesIO()
  scipy.io.savemat(buf, {"annotations": ann, "class_names": names})
  return buf.getvalue()


def cars_full_class_ids(seed=0):
  """16,185 class ids: 8,054 in classes 1-98, 8,131 in 99-196, shuffled."""
  low = np.repeat(np.arange(1, 99), 82)[:8054]
  low = np.concatenate([low, np.arange(1, 99)[:8054 - len(low)]])
  high = np.concatenate([np.repeat(np.arange(99, 197), 82),
                         np.arange(99, 197)[:8131 - 82 * 98]])
  ids = np.concatenate([low, high])
  return np.random.default_rng(seed).permutation(ids)


def cars_devkit_annos(fnames, class_ids):
  """The devkit's cars_train_annos.mat / cars_test_annos_withlabels.mat:
  an `annotations` struct array with fields bbox_*, class and fname."""
  dt = [(f, "O") for f in ("bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2",
                           "class", "fname")]
  ann = np.zeros((1, len(fnames)), dtype=dt)
  for i, (fname, c) in enumerate(zip(fnames, class_ids)):
    ann[0, i] = (np.array([[3]], np.uint8), np.array([[2]], np.uint8),
                 np.array([[9]], np.uint8), np.array([[7]], np.uint8),
                 np.array([[c]], np.uint8), np.array([fname]))
  buf = io.BytesIO()
  scipy.io.savemat(buf, {"annotations": ann})
  return buf.getvalue()


def cars_class_names():
  """196 names; class 5 has a '/' (as 'Ram C/V Cargo Van Minivan 2012')."""
  return [f"Make Model{' C/V' if c == 5 else ''} {c} 2012"
          for c in range(1, 197)]


def cars_layouts(class_ids, tests, seed=0):
  """The same images in the three Cars-196 layouts.

  Args:
    class_ids: class id (1..196) of each image, in official order.
    tests: 1 for the images of the classification benchmark's test half.

  Returns:
    ``{layout: {relpath: bytes}}`` for 'official' (car_ims/ +
    cars_annos.mat), 'tfds' (cars_train/, cars_test/, devkit/,
    cars_test_annos_withlabels.mat) and 'pml' (pytorch-metric-learning's
    Kaggle mirror), and ``images``: the image bytes in official order.
  """
  images = [encode("JPEG", seed + i) for i in range(len(class_ids))]
  official = {f"car_ims/{i + 1:06d}.jpg": im for i, im in enumerate(images)}
  official["cars_annos.mat"] = cars_annos(class_ids, tests=np.asarray(tests))
  tfds, pml = {}, {}
  names = cars_class_names()
  pml["names.csv"] = ("\n".join(names) + "\n").encode()
  for split, flag in (("train", 0), ("test", 1)):
    idx = [i for i, t in enumerate(tests) if t == flag]
    fnames = [f"{k + 1:05d}.jpg" for k in range(len(idx))]
    ids = [class_ids[i] for i in idx]
    rows = []
    for fname, i, c in zip(fnames, idx, ids):
      tfds[f"cars_{split}/{fname}"] = images[i]
      pml[f"car_data/car_data/{split}/{names[c - 1].replace('/', '-')}/"
          f"{fname}"] = images[i]
      rows.append(f"{fname},3,2,9,7,{c}")
    pml[f"anno_{split}.csv"] = ("\n".join(rows) + "\n").encode()
    annos = cars_devkit_annos(fnames, ids)
    if split == "train":
      tfds["devkit/cars_train_annos.mat"] = annos
    else:
      tfds["cars_test_annos_withlabels.mat"] = annos
      # The devkit's own test annotations carry no class.
      tfds["devkit/cars_test_annos.mat"] = b"unused"
  meta = io.BytesIO()
  scipy.io.savemat(meta, {"class_names": np.array([names], dtype=object)})
  tfds["devkit/cars_meta.mat"] = meta.getvalue()
  return {"official": official, "tfds": tfds, "pml": pml, "images": images}


# --------------------------------------------------------------------- SOP --

SOP_SUPER = ("bicycle", "cabinet", "chair", "coffee_maker", "fan", "kettle",
             "lamp", "mug", "sofa", "stapler", "table", "toaster")


def sop_lists(train_counts, test_counts):
  """Ebay_train.txt / Ebay_test.txt / Ebay_info.txt for per-class counts.

  Class ids are 1..len(train) for train and continue for test (official).
  """
  out, image_id, class_id, rels = {}, 1, 1, []
  info = ["image_id class_id super_class_id path"]
  for split, counts in (("train", train_counts), ("test", test_counts)):
    lines = ["image_id class_id super_class_id path"]
    for n in counts:
      sup = (class_id - 1) % len(SOP_SUPER)
      for k in range(n):
        rel = (f"{SOP_SUPER[sup]}_final/{100000 + class_id}_{k}.JPG")
        line = f"{image_id} {class_id} {sup + 1} {rel}"
        lines.append(line)
        info.append(line)
        rels.append(rel)
        image_id += 1
      class_id += 1
    out[f"Stanford_Online_Products/Ebay_{split}.txt"] = (
        "\n".join(lines) + "\n").encode()
  out["Stanford_Online_Products/Ebay_info.txt"] = ("\n".join(info) + "\n").encode()
  return out, rels


def sop_full_counts():
  """Per-class counts with the official 11,318/59,551 and 11,316/60,502."""
  def spread(classes, images):
    base, extra = divmod(images, classes)
    return [base + (i < extra) for i in range(classes)]
  return spread(11318, 59551), spread(11316, 60502)


# ------------------------------------------------------------------ In-Shop --


def inshop_partition(rows):
  """list_eval_partition.txt for rows `(path, item_id, status)`."""
  lines = [str(len(rows)), "image_name item_id evaluation_status"]
  lines += [f"{p:<60}{i:<20}{s}" for p, i, s in rows]
  return ("\n".join(lines) + "\n").encode()


def inshop_rows(train_items, test_items, query, gallery, seed=0):
  """Rows with `train_items` train items holding `train` images etc.

  `train_items`: list of image counts per train item; `query`/`gallery`:
  per-test-item counts.
  """
  rng = np.random.default_rng(seed)
  rows, item = [], 1
  cats = ("WOMEN/Dresses", "MEN/Denim", "WOMEN/Blouses_Shirts")
  def add(n, status, item_id, start):
    cat = cats[item_id % len(cats)]
    for k in range(n):
      rows.append((f"img/{cat}/id_{item_id:08d}/{start + k:02d}_{k % 4 + 1}_"
                   "front.jpg", f"id_{item_id:08d}", status))
  for n in train_items:
    add(n, "train", item, 1)
    item += 1
  for q, g in zip(query, gallery):
    add(q, "query", item, 1)
    add(g, "gallery", item, 1 + q)
    item += 1
  order = rng.permutation(len(rows))
  return [rows[i] for i in order]


def inshop_full_counts():
  def spread(classes, images):
    base, extra = divmod(images, classes)
    return [base + (i < extra) for i in range(classes)]
  return spread(3997, 25882), spread(3985, 14218), spread(3985, 12612)


# ----------------------------------------------------------------- Omniglot --


def omniglot_files(folder, alphabets, *, drawers=2, seed=0):
  """`<folder>/<Alphabet>/characterNN/<id>_<drawer>.png` for `{alphabet: n}`."""
  files, char_id = {}, 1
  for alphabet, n_chars in alphabets.items():
    for c in range(1, n_chars + 1):
      for d in range(1, drawers + 1):
        rel = f"{folder}/{alphabet}/character{c:02d}/{char_id:04d}_{d:02d}.png"
        files[rel] = encode("PNG", seed + 100 * char_id + d, size=(10, 10),
                            mode="L")
      char_id += 1
  return files


# ------------------------------------------------------ encrypted archives --


def encrypted_zip(files, path, password="secret", *, tool=True):
  """A password-protected zip of `{relpath: bytes}`, as DeepFashion's.

  ``tool``: made by Info-ZIP's ``zip -P`` (real ZipCrypto, which Python's
  zipfile decrypts with ``pwd=``) when it is installed; else, or with
  ``tool=False``, a plain zip whose entries have general-purpose flag bit 0
  (encrypted) set in the local and central headers, which is what zipfile
  refuses with 'is encrypted, password required for extraction'.

  Returns:
    True when the archive is real ZipCrypto.
  """
  import shutil  # pylint: disable=g-import-not-at-top
  import struct  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if tool and shutil.which("zip"):
    with tempfile.TemporaryDirectory() as tmp:
      write_tree(files, tmp)
      subprocess.run(["zip", "-q", "-r", "-P", password, str(path.resolve()),
                      *sorted({r.split("/")[0] for r in files})],
                     cwd=tmp, check=True)
    return True
  write_tree(files, path.parent, archive=path.name)
  raw = bytearray(path.read_bytes())
  for sig, offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
    start = 0
    while (start := raw.find(sig, start)) >= 0:
      flags, = struct.unpack_from("<H", raw, start + offset)
      struct.pack_into("<H", raw, start + offset, flags | 0x1)
      start += 4
  path.write_bytes(bytes(raw))
  return False
