"""Every residual design, by name. Adding a design = one ``design_<name>.py`` file + one import line here.

(Each import is ``from .design_x import DESIGN as ...``: transformers' remote-code copier follows only that
form of relative import when it copies this folder next to the weights.)
"""

from .design_attnres import BLOCK_DESIGN as BLOCK_ATTNRES
from .design_attnres import DESIGN as ATTNRES
from .design_deepnorm import DESIGN as DEEPNORM
from .design_hc import DESIGN as HC
from .design_hires import DESIGN as HIRES
from .design_keel import DESIGN as KEEL
from .design_lns import DESIGN as LNS
from .design_mhc import DESIGN as MHC
from .design_moda import DESIGN as MODA
from .design_post_ln import DESIGN as POST_LN
from .design_pre_ln import DESIGN as PRE_LN
from .design_sandwich import DESIGN as SANDWICH_LN

DESIGNS = {}
for _d in (
    PRE_LN,
    POST_LN,
    SANDWICH_LN,
    LNS,
    DEEPNORM,
    KEEL,
    HC,
    MHC,
    ATTNRES,
    BLOCK_ATTNRES,
    MODA,
    HIRES,
):
    DESIGNS[_d.name] = _d
