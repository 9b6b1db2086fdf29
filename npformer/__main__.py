"""``python -m npformer``: the same as the ``npformer`` console script."""
import sys

from npformer.cli import main

sys.exit(main())
