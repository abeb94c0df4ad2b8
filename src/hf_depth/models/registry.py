# ruff: noqa: I001  (registration order: the baseline first, as listed in the README)
"""Every residual design, by name. Adding a design = one ``design_<name>.py`` file (which builds its ``Design`` with
``residual.register``) + one import line here. At run time, ``hf_depth.register_design`` adds one from anywhere.

(Each import is ``from .design_x import DESIGN``: transformers' remote-code copier follows only that form of
relative import when it copies this folder next to the weights.)
"""

from .design_pre_ln import DESIGN as PRE_LN  # noqa: F401  (first: the baseline)
from .design_post_ln import DESIGN as POST_LN  # noqa: F401
from .design_sandwich import DESIGN as SANDWICH_LN  # noqa: F401
from .design_lns import DESIGN as LNS  # noqa: F401
from .design_deepnorm import DESIGN as DEEPNORM  # noqa: F401
from .design_keel import DESIGN as KEEL  # noqa: F401
from .design_hc import DESIGN as HC  # noqa: F401
from .design_mhc import DESIGN as MHC  # noqa: F401
from .design_attnres import BLOCK_DESIGN as BLOCK_ATTNRES, DESIGN as ATTNRES  # noqa: F401
from .design_moda import DESIGN as MODA  # noqa: F401
from .design_hires import DESIGN as HIRES  # noqa: F401
from .residual import DESIGNS, MODEL_CLASSES, Design, register  # noqa: F401  (the registry itself)
