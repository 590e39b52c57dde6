"""Input-pipeline throughput: build time and decoded+augmented images/s.

  python -m experiments.bench.data [--manual_dir DIR]   (default: the bundled archives)
      [--steps 30] [--out experiments/results/bench/data_cpu.md]

Measures, on this machine:
* the tfds build (``download_and_prepare``) of ``omniglot_small`` from the
  shared archives (4,840 PNGs) and of ``digits``;
* train-pipeline throughput (images/s, after 3 warm-up batches) for
  - ``omniglot_small`` + ``grayscale`` 28x28, P x K = 32 x 4;
  - ``omniglot_small`` + ``grayscale_affine`` 28x28, P x K = 16 x 4 (the
    train input of experiments/configs/omniglot_fewshot.py): small images
    whose decoding and warping hold Python's GIL, so threads do not add
    throughput and worker processes do (on a lent H200's 16-core host this
    input, not the GPU, bounded the recipe to 24-35 steps/s per run);
  - CUB-like JPEGs (500x375, quality 90, an in-memory source) +
    ``bninception`` train 224 (random-resized-crop + flip), batch 60 x 2;
  with worker threads and processes varied.
"""

from __future__ import annotations

import io
import tempfile
import time

import numpy as np
from PIL import Image


from circle_jax import data
from experiments.bench import timing


def throughput(source, sampler, preprocess, steps, **kw):
  it = data.train_iterator(source, sampler=sampler, preprocess=preprocess,
                           process_index=0, process_count=1, **kw)
  for _ in range(3):
    next(it)
  t, c = time.perf_counter(), time.process_time()
  for _ in range(steps):
    next(it)
  dt, dc = time.perf_counter() - t, time.process_time() - c
  it.close()
  n = steps * sampler.batch_size
  # CPU time of this process only (workers' processes are not counted).
  per_cpu = "" if kw.get("num_workers") else f", {n / dc:,.0f} per CPU-s"
  return f"{n / dt:,.0f} images/s{per_cpu}"


def jpeg_source(n=240, classes=60):
  rng = np.random.default_rng(0)
  base = rng.integers(0, 256, (375 // 15, 500 // 20, 3), dtype=np.uint8)
  out = []
  for i in range(n):
    im = Image.fromarray(np.roll(base, i, axis=0)).resize((500, 375),
                                                          Image.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    out.append({"image": buf.getvalue(), "label": i % classes,
                "path": f"synthetic/{i}.jpg".encode()})
  return out


def main():
  ap = timing.parser(__doc__, hugepages=False, out="write the table here too")
  ap.add_argument("--manual_dir", default=None,
                  help="Omniglot zips (default: the ones shipped with the "
                  "package)")
  ap.add_argument("--steps", type=int, default=30)
  args = ap.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, manual in (("omniglot_small", args.manual_dir), ("digits", None)):
      t = time.perf_counter()
      data.load_split(name, "train", data_dir=tmp, manual_dir=manual)
      rows.append((f"build `{name}` (all splits)",
                   f"{time.perf_counter() - t:.1f} s"))
    src = data.load_split("omniglot_small", "train", data_dir=tmp)
    pk = data.PKSampler(data.split_labels(src), classes_per_batch=32,
                        images_per_class=4, seed=0)
    gray = data.get_preprocess("grayscale", train=True, image_size=28)
    for threads, workers in ((0, 0), (1, 0), (4, 0), (2, 2)):
      ips = throughput(src, pk, gray, args.steps, num_threads=threads,
                       num_workers=workers)
      rows.append((f"omniglot_small grayscale-28, PxK 32x4, threads={threads} "
                   f"workers={workers}", ips))
    affine = data.get_preprocess("grayscale_affine", train=True,
                                 image_size=28)
    pk = data.PKSampler(data.split_labels(src), classes_per_batch=16,
                        images_per_class=4, seed=0)
    for threads, workers in ((0, 0), (4, 0), (0, 2)):
      ips = throughput(src, pk, affine, args.steps * 2, num_threads=threads,
                       num_workers=workers)
      rows.append((f"omniglot_small grayscale_affine-28, PxK 16x4, "
                   f"threads={threads} workers={workers}", ips))
    jpegs = jpeg_source()
    pk = data.PKSampler([r["label"] for r in jpegs], classes_per_batch=60,
                        images_per_class=2, seed=0)
    bn = data.get_preprocess("bninception", train=True)
    for threads, workers in ((0, 0), (2, 0), (2, 2)):
      ips = throughput(jpegs, pk, bn, max(args.steps // 5, 3),
                       num_threads=threads, num_workers=workers)
      rows.append((f"500x375 JPEG bninception-train-224, PxK 60x2, "
                   f"threads={threads} workers={workers}",
                   ips))
  lines = [
      "# Input pipeline throughput",
      "",
      timing.machine_line(),
      "Command: `python -m experiments.bench.data --out "
      "experiments/results/bench/data_cpu.md`",
      "",
      "Wall-clock images/s depend on the load of the shared CPUs; images per",
      "CPU-second (this process, workers=0) are the load-independent figure.",
      "",
      "| what | result |",
      "| --- | --- |",
      *[f"| {a} | {b} |" for a, b in rows],
  ]
  timing.write_table("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
  main()
