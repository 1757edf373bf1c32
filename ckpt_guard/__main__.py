"""``python -m ckpt_guard``: see :mod:`ckpt_guard._cli`."""

import sys

from ckpt_guard._cli import main

if __name__ == "__main__":
    sys.exit(main())
