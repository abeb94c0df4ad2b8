"""``python -m hf_depth.olmo_core SRC OUT ...``: the same as ``hf-depth convert-olmo-core``."""

import sys

from .cli import main

if __name__ == "__main__":  # importing this module (e.g. walking the package) runs nothing
    sys.exit(main())
