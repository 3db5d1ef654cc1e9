"""``python -m torchrl_oni.serve`` runs ``oni-serve``."""
import sys

from torchrl_oni.serve.cli import main

sys.exit(main())
