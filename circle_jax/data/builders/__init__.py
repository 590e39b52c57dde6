"""tfds builders of the deep-metric-learning datasets (see ``base``)."""

from circle_jax.data.builders.base import EncodedImageBuilder
from circle_jax.data.builders.base import MissingDatasetFilesError
from circle_jax.data.builders.base import split_labels
from circle_jax.data.builders.base import split_super_labels
from circle_jax.data.builders.sources import CorruptImageError
from circle_jax.data.builders.sources import EncryptedArchiveError
from circle_jax.data.builders.cars196 import Cars196
from circle_jax.data.builders.cub200 import Cub200
from circle_jax.data.builders.digits import Digits
from circle_jax.data.builders.inaturalist2018 import INaturalist2018
from circle_jax.data.builders.inshop import Inshop
from circle_jax.data.builders.omniglot import Omniglot
from circle_jax.data.builders.omniglot import OmniglotSmall
from circle_jax.data.builders.sop import Sop

BUILDERS = {
    cls.name: cls
    for cls in (Cub200, Cars196, Sop, Inshop, Omniglot, OmniglotSmall, Digits,
                INaturalist2018)
}
