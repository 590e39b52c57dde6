"""Engines that run a pair-loss *rule* over anchors and candidates.

A pair loss is split in two:

* its **rule**, in the loss's own module (e.g. ``circle.py``): what the loss
  computes from a tile of similarities and the anchors' positive / negative
  pair masks (the interface: :mod:`~circle_jax.losses.engine.rule`);
* an **engine**, here, that evaluates any rule and derives its gradient. No
  engine holds a loss formula and nothing here imports a loss.

The rooms, read top to bottom:

=============  ===========================================================
``reductions`` the (global) batch reductions of per-anchor terms
``rule``       the rule interface (:class:`PairRule`, ``rule_dataclass``)
``geometry``   the similarity of a tile (:class:`Cosine`, :class:`Dot`,
               the distances :class:`Lp` and :class:`SNR`; the
               Poincaré ball's is in the losses room)
``tiles``      tile pieces: sides, the one pair-mask helper, tiling, online
               statistics, the rule-derived ``dL/ds`` of a tile
``sides``      the anchors and the candidates (:class:`Candidates`)
``dense``      the dense engine (one ``[M, N]`` block, autodiff)
``backward``   the backward sweep shared by the tiled engines' ``custom_vjp``
``blockwise``  the blockwise engine (tiles, ``O(block^2)`` memory)
``ring``       the device-ring engine (column shards over ``ppermute``)
``dispatch``   the one choice of engine, the loss front ends and their
               options (:data:`OPTIONS`, :data:`EXECUTION_OPTIONS`)
=============  ===========================================================

Imports go one way: ``rule`` <- ``geometry``, ``reductions``; ``tiles`` <- ``rule``;
``sides``, ``dense``, ``backward`` <- ``tiles``; ``blockwise``, ``ring``
<- ``backward``; ``dispatch`` <- all engines. Engines import only
``tiles``, ``backward``, ``rule`` / ``geometry``, ``reductions`` and
:mod:`circle_jax.ops`.

Adding a pair loss: write its rule (a :func:`rule_dataclass` subclass of
:class:`PairRule`) and its public functions in its own module, calling
:func:`embedding_loss` (``**options``: the shared keywords, documented
there once) and :func:`matrix_loss` (a distance form: a static
``on_distance`` field read by :func:`as_distance`, and
:func:`distance_matrix_loss`), and its ``REGISTRY`` entry
(:mod:`circle_jax.losses.entries`) next to it; add the module to
:mod:`circle_jax.losses.registry`'s list and export the loss from
:mod:`circle_jax.losses`. Three files, no engine touched. A pair term that
reads a per-anchor statistic with its gradient (N-pair, lifted structure)
is a two-stage rule: ``first_stage()`` gives the statistic (e.g. a
:class:`NegativeLogsumexp`) and every engine hands it to the rule's pairs
as the sides' ``aux`` and differentiates through it
(:mod:`~circle_jax.losses.engine.rule`).

Adding an engine: a new module here, a function ``(rule, rows, cols, ...)
-> (per_anchor, valid)`` built from the tile pieces (:func:`tiles.tile`,
``prepass_update``, ``stats_init`` / ``stats_update`` / ``stats_finish``,
``finish_rows``) and, for its ``custom_vjp``, :func:`backward.sweep`; then one
branch in :func:`dispatch.embedding_loss`. No loss touched.

Adding a geometry: a :class:`geometry.Geometry` subclass (``embed``,
``tile``, optionally ``tile_vjp`` and ``to_distance``), passed to any pair
loss as its ``geometry`` option (every rule has the static field, which
:func:`with_geometry` replaces) or named with :func:`register_geometry`.
No engine and no loss touched.
"""

from circle_jax.losses.engine.dense import dense_per_anchor, selected_pairs
from circle_jax.losses.engine.dispatch import (
    COLLECTIVES,
    EXECUTION_OPTIONS,
    OPTIONS,
    check_collective,
    class_level_loss,
    dense_block,
    distance_matrix_loss,
    embedding_loss,
    matrix_loss,
    reduce_per_anchor,
)
from circle_jax.losses.engine.blockwise import (
    blockwise_per_anchor,
    check_block_size,
)
from circle_jax.losses.engine.geometry import (
    COSINE,
    DOT,
    SNR,
    Cosine,
    Dot,
    Geometry,
    Lp,
)
from circle_jax.losses.engine.geometry import build as build_geometry
from circle_jax.losses.engine.geometry import fields as geometry_fields
from circle_jax.losses.engine.geometry import names as geometry_names
from circle_jax.losses.engine.geometry import register as register_geometry
from circle_jax.losses.engine.geometry import resolve as resolve_geometry
from circle_jax.losses.engine.geometry import require_cosine
from circle_jax.losses.engine.ring import ring_per_anchor
from circle_jax.losses.engine.rule import (
    NegativeLogsumexp,
    PairRule,
    PairSetMeans,
    PositivePairMean,
    as_distance,
    both_sets_nonempty,
    rule_dataclass,
    with_geometry,
)
from circle_jax.losses.engine.sides import (
    Candidates,
    pair_block,
    pair_sides,
    square_block,
)
from circle_jax.losses.engine.tiles import PairSide, pair_masks
from circle_jax.losses.engine.dispatch import pair_terms, term_kind
from circle_jax.losses.engine.reductions import (
    REDUCTIONS,
    MultipleReducers,
    PerAnchorReducer,
    Reduction,
    as_reduction,
    reduce_pair_sets,
    reduce_terms,
    refuse_reduction,
)
